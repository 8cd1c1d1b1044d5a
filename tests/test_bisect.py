"""``gpumem bisect``: a real git repository of 16 commits, real launches, a real Ctrl-C.

The repository's gpumem test holds a buffer in every rank (8 MiB, then 72 MiB from commit 11 on:
+64 MiB, twice the default tolerance's 32 MiB); commit 6 breaks the helper the test imports and
commit 7 mends it. It also holds a ``pytest_gpumem`` package that fails on import, which only the
bisect's pin on the installed plugin keeps out of the measuring processes.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import OWN_CACHES, TAG_ENV, processes_tagged
from pytest_gpumem.bisect.command import _line, last_line
from pytest_gpumem.bisect.commits import Commit, between, resolve_commit
from pytest_gpumem.bisect.search import Judge, search, site_lines
from pytest_gpumem.bisect.workspace import _tail
from pytest_gpumem.config.spec import Tolerance
from pytest_gpumem.judging.record import SizeRecord
from pytest_gpumem.results.size import SizeResult
from pytest_gpumem.sampling.sites import from_dicts

GPUMEM = Path(sys.executable).with_name("gpumem")  # the console script, as a user runs it

TEST_MODULE = '''\
import os
import time

from helper import held_mib
from pytest_gpumem import gpumem


@gpumem(nproc=[1, 2], launcher="direct", device="cpu")
def test_step():
    held = bytearray(held_mib() * 2**20)
    time.sleep(float(os.environ.get("BISECT_TEST_SLEEP", "0")))  # the Ctrl-C test's window
    assert len(held)


@gpumem(nproc=1, launcher="direct", device="cpu")
def test_other():
    pass


def test_plain():
    pass
'''
TRAIN = "from helper import held_mib\nheld = bytearray(held_mib() * 2**20)\n"
HELPER = "def held_mib():\n    return {mib}\n"
BROKEN = "def held_mib(:\n    return 8\n"


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("project")
    return root, make_repo(root)


def make_repo(root: Path, count: int = 16, broken: tuple[int, ...] = (6,), grows: int = 11) -> list[str]:
    """``count`` commits in ``root`` (shas oldest first): commit k's subject is ``commit k``; the
    helper does not import at the ``broken`` ones and holds 64 MiB more from ``grows`` on."""
    git(root, "init", "-q", "-b", "main")
    (root / "test_mem.py").write_text(TEST_MODULE)
    (root / "train.py").write_text(TRAIN)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "pytest_gpumem").mkdir()  # a decoy: importing it from the checkout fails
    (root / "pytest_gpumem" / "__init__.py").write_text("raise ImportError('the checkout\\'s pytest_gpumem')\n")
    (root / "baselines").mkdir()
    (root / "baselines" / "test_mem.json").write_text('{"stored": "by the user"}\n')
    shas = []
    for k in range(1, count + 1):
        helper = BROKEN if k in broken else HELPER.format(mib=72 if k >= grows else 8)
        (root / "helper.py").write_text(helper)
        (root / "NOTES").write_text(f"commit {k}\n")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"commit {k}")
        shas.append(git(root, "rev-parse", "HEAD"))
    return shas


def bisect(repo: Path, tmp: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """``gpumem bisect ARGS`` run in the checkout, with a private TMPDIR."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") or k in (TAG_ENV, *OWN_CACHES)}
    run_env.update(TMPDIR=str(tmp), **(env or {}))
    return subprocess.run([str(GPUMEM), "bisect", *args], cwd=repo, env=run_env, capture_output=True,
                          text=True, timeout=timeout)


def snapshot(repo: Path) -> dict[str, str]:
    """HEAD, the status and a digest of every file of the working tree."""
    files = {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(repo.rglob("*")) if p.is_file() and ".git" not in p.relative_to(repo).parts}
    return {"HEAD": git(repo, "rev-parse", "HEAD"), "status": git(repo, "status", "--porcelain"), **files}


def steps(out: str) -> list[tuple[str, str, str]]:
    """(label, subject, verdict) of every commit line printed."""
    found = re.findall(r"^\s*(GOOD|BAD|\d+)  [0-9a-f]{10}  (commit \d+)\s+(?:[\d.]+ MiB|-)\s+(good|bad|skip) \(",
                       out, re.MULTILINE)
    return [(label, subject, verdict) for label, subject, verdict in found]


@pytest.fixture
def private_tmp(tmp_path):
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    return folder


def leftovers(repo: Path, tmp: Path) -> tuple[list[str], list[str]]:
    worktrees = [line for line in git(repo, "worktree", "list", "--porcelain").splitlines()
                 if line.startswith("worktree ")]
    return worktrees, [p.name for p in tmp.iterdir() if p.name.startswith("gpumem-bisect")]


# ---------------------------------------------------------------------------------------------- the search


def test_the_search_halves_and_skips_to_the_nearest_neighbour():
    first_bad, broken = 9, {4}
    tried = []

    def probe(i: int) -> str:
        tried.append(i)
        return "skip" if i in broken else "bad" if i >= first_bad else "good"

    assert search(15, probe) == (8, 9, [])
    assert tried == [6, 10, 8, 9]
    tried.clear()
    assert search(11, probe) == (8, 9, [])
    assert tried == [4, 5, 7, 8, 9]  # 4 skipped: its later neighbour


def test_skips_next_to_the_answer_leave_a_range():
    verdicts = {0: "good", 1: "skip", 2: "skip"}
    last_good, first_bad, skipped = search(4, lambda i: verdicts[i])
    assert (last_good, first_bad, skipped) == (0, 3, [1, 2])


def test_a_commit_s_growth_reads_the_same_in_its_row_and_in_the_last_line():
    """Issue 27: the table said +64.2 MiB and the last line +64.1 for the same commit (one against
    GOOD's 473.40, the other against the last good commit's 473.45, each rounded after subtracting)."""
    good, first = Commit("a" * 40, "good"), Commit("b" * 40, "grows")
    judge = Judge(nproc=2, reference=473.40, tolerance=Tolerance(percent=5.0, mib=32.0))
    verdict, why = judge(537.56, "unused")
    row = _line("2", first, 537.56, verdict, why, width=10)
    last = last_line(first, good, 473.40, 537.56, 2, "rank 0")
    assert (verdict, why) == ("bad", "+64.2 MiB, over the +32.0 allowed")
    assert "537.6 MiB  bad (+64.2 MiB" in row
    assert last == (f"first bad commit: {'b' * 40} grows "
                    "(+64.2 MiB at nproc=2, rank 0: 473.4 -> 537.6 MiB since GOOD aaaaaaaaaa)")
    # a growth is the difference of the printed figures: 473.44 -> 537.56 reads 473.4 -> 537.6, +64.2
    assert Judge(2, 473.44, judge.tolerance)(537.56, "")[1].startswith("+64.2 MiB")  # was +64.1
    assert judge(None, "nproc=2 not measured here") == ("skip", "nproc=2 not measured here")


def test_the_commits_searched_are_the_first_parent_history_that_contains_good(tmp_path):
    git(tmp_path, "init", "-q", "-b", "main")

    def commit(name: str) -> None:
        (tmp_path / name).write_text(name)
        git(tmp_path, "add", name)
        git(tmp_path, "commit", "-q", "-m", name)

    commit("m1")
    git(tmp_path, "checkout", "-q", "-b", "side")
    commit("s1")
    commit("s2")
    git(tmp_path, "checkout", "-q", "main")
    commit("m2")
    git(tmp_path, "merge", "-q", "--no-ff", "side", "-m", "merge")
    commit("m3")

    def subjects(good: str) -> list[str]:
        return [c.subject for c in between(tmp_path, resolve_commit(tmp_path, good, "GOOD"),
                                           resolve_commit(tmp_path, "main", "BAD"))]

    assert subjects("main~3") == ["m2", "merge", "m3"]  # s1 and s2 are not on the first-parent line
    assert subjects("side~1") == ["merge", "m3"]  # m2 does not contain GOOD


# ---------------------------------------------------------------------------------------------- peak sites


def _size(sites: dict | None, gated_rank: int = 0) -> SizeRecord:
    """A size as a report holds it: its sites read back from their JSON (rank -> list of sites)."""
    listed = {int(rank): tuple(from_dicts(raw)) for rank, raw in (sites or {}).items()}
    measured = SizeResult(2, "cpu", {}, sites=listed)
    return SizeRecord(measured, gated_rank=gated_rank, gated_label=f"rank {gated_rank}", gated_mib=1.0)


GOOD = {"0": [{"mib": 10.0, "count": 1, "where": "a.py:3", "function": "f", "detail": ""},
              {"mib": 64.0, "count": 2, "where": "a.py:9", "function": "g", "detail": "all_gather"}],
        "1": [{"mib": 1.0, "count": 1, "where": "z.py:1", "function": "z", "detail": ""}]}
BAD = {"0": [{"mib": 10.0, "count": 1, "where": "a.py:3", "function": "f", "detail": ""},
             {"mib": 320.0, "count": 4, "where": "a.py:9", "function": "g", "detail": "all_gather"},
             {"mib": 4.25, "count": 1, "where": "b.py:7", "function": "h", "detail": ""},
             {"mib": 0.5, "count": 1, "where": "a.py:1", "function": "", "detail": ""}],
       "1": [{"mib": 900.0, "count": 1, "where": "z.py:1", "function": "z", "detail": ""}]}


def test_site_lines_lists_what_grew_or_is_new_largest_first():
    good, bad = _size(GOOD), _size(BAD)
    assert site_lines(good, bad) == ["+256.0 MiB  a.py:9 g (all_gather)", "+4.2 MiB  b.py:7 h  (new)",
                                     "(1 smaller site +0.5 MiB)"]
    assert site_lines(_size(GOOD, 1), _size(BAD, 1)) == ["+899.0 MiB  z.py:1 z"]


def test_site_lines_is_empty_without_sites():
    typed = SizeRecord(SizeResult(2, "cpu", {}), gated_rank=0, gated_label="rank 0", gated_mib=1.0)
    assert site_lines(typed, typed) == []
    assert site_lines(_size(None), _size({"0": [{"mib": 5.0, "where": "a.py:1"}]})) == []
    shrunk = _size({"0": [{"mib": 5.0, "count": 1, "where": "a.py:1", "function": "f", "detail": ""}]})
    assert site_lines(shrunk, _size({"0": []})) == []
    smaller = _size({"0": [{"mib": 4.0, "count": 1, "where": "a.py:1", "function": "f", "detail": ""}]})
    assert site_lines(shrunk, smaller) == ["(1 site shrank by 1.0 MiB)"]


COLLECT_LOG = """
==================================== ERRORS ====================================
_________________________ ERROR collecting test_job.py _________________________
test_job.py::test_job: invalid gpumem marker: unknown argument 'nprocs': did you mean 'nproc'? accepted are nproc
=========================== short test summary info ============================
ERROR test_job.py - test_job.py::test_job: invalid gpumem marker: unknown arg...
no tests collected, 1 error in 0.00s
ERROR: found no collectors for /tmp/w/test_job.py::test_job
"""


def test_a_commit_that_does_not_collect_is_named_by_its_reason_not_pytests_last_line():
    """Issue 55: a marker argument spelled as an earlier version accepted it read 'found no collectors'."""
    assert _tail(COLLECT_LOG) == ("test_job.py::test_job: invalid gpumem marker: unknown argument 'nprocs': "
                                  "did you mean 'nproc'? accepted are nproc")
    assert _tail("E   SyntaxError: invalid syntax\nERROR: found no collectors for x") == "SyntaxError: invalid syntax"
    assert _tail("1 passed in 0.1s") == "1 passed in 0.1s"
    setup = ("___ ERROR at setup of test_job ___\ntest_job.py::test_job: invalid gpumem marker: nproc=0 is not accepted"
             "\n=== short test summary info ===\nERROR test_job.py::test_job - Failed: test_job.py::test_job: inv...\n"
             "1 error in 0.01s")
    assert _tail(setup) == "test_job.py::test_job: invalid gpumem marker: nproc=0 is not accepted"  # issue 64


# ---------------------------------------------------------------------------------------------- real bisects

@pytest.mark.slow
def test_names_commit_11_in_at_most_6_steps_and_leaves_the_checkout_as_it_was(repo, private_tmp, launch_tag):
    root, shas = repo
    (root / "NOTES").write_text("an uncommitted change\n")
    (root / "baselines" / "test_mem.json").write_text('{"stored": "and edited by the user"}\n')
    before = snapshot(root)
    try:
        done = bisect(root, private_tmp, shas[0], shas[15], "--", "test_mem.py::test_step")
        assert snapshot(root) == before
    finally:
        git(root, "checkout", "-q", "--", ".")
    assert done.returncode == 0, done.stdout + done.stderr
    tried = steps(done.stdout)
    assert tried[:2] == [("GOOD", "commit 1", "good"), ("BAD", "commit 16", "bad")]
    assert 1 <= len(tried) - 2 <= 6
    assert {subject for _, subject, verdict in tried if verdict == "bad"} >= {"commit 11"}
    lines = done.stdout.splitlines()
    growth = re.match(rf"first bad commit: {shas[10]} commit 11 \(\+(\d+\.\d) MiB at nproc=2, rank 0: ", lines[-1])
    # the buffer is 64 MiB; the interpreter's own 1 MiB arenas may come and go between runs
    assert growth and abs(float(growth.group(1)) - 64.0) <= 2.0, lines[-1]
    heading = lines.index(next(line for line in lines if line.startswith("peak sites that grew at nproc=2")))
    held = next(i for i, line in enumerate(TEST_MODULE.splitlines(), 1) if "held = bytearray" in line)
    assert lines[heading + 1] == f"  +64.0 MiB  test_mem.py:{held} test_step"  # the line that holds the buffer
    assert leftovers(root, private_tmp) == ([f"worktree {root}"], [])


@pytest.mark.slow
def test_a_commit_that_does_not_import_is_skipped_and_the_answer_stands(repo, private_tmp, launch_tag):
    root, shas = repo
    done = bisect(root, private_tmp, shas[0], shas[11], "--", "test_mem.py::test_step")
    assert done.returncode == 0, done.stdout + done.stderr
    tried = steps(done.stdout)
    assert ("1", "commit 6", "skip") == tried[2]
    skip_line = next(line for line in done.stdout.splitlines() if re.match(r"\s*1  ", line))
    assert skip_line.endswith("skip (the test does not collect: SyntaxError: invalid syntax)")
    assert len(tried) - 2 <= 6
    assert done.stdout.splitlines()[-1].startswith(f"first bad commit: {shas[10]} commit 11 ")


@pytest.mark.slow
def test_skips_next_to_the_growth_leave_it_ambiguous_and_say_where(tmp_path, private_tmp, launch_tag):
    root = tmp_path / "project"
    root.mkdir()
    shas = make_repo(root, count=4, broken=(2, 3), grows=3)
    done = bisect(root, private_tmp, shas[0], shas[3], "--", "test_mem.py::test_step")
    assert done.returncode == 1, done.stdout + done.stderr
    assert [(s, v) for _, s, v in steps(done.stdout)] == [
        ("commit 1", "good"), ("commit 4", "bad"), ("commit 2", "skip"), ("commit 3", "skip")]
    lines = done.stdout.splitlines()
    assert lines[-5:] == [
        f"gpumem bisect: the skipped commits leave it ambiguous: the first bad commit is one of 3 commits "
        f"after {shas[0][:10]}:",
        f"  {shas[1]} commit 2  (skipped)", f"  {shas[2]} commit 3  (skipped)", f"  {shas[3]} commit 4",
        f"the first bad commit could be any of: {shas[1][:10]} {shas[2][:10]} {shas[3][:10]}"]
    assert leftovers(root, private_tmp) == ([f"worktree {root}"], [])


@pytest.mark.slow
def test_a_measure_command_is_bisected_too(repo, private_tmp, launch_tag):
    root, shas = repo
    done = bisect(root, private_tmp, shas[8], shas[12], "--nproc", "2", "--",
                  "measure", "--nproc", "1,2", "--", "train.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s for _, s, _ in steps(done.stdout)][:2] == ["commit 9", "commit 13"]
    assert done.stdout.splitlines()[-1].startswith(f"first bad commit: {shas[10]} commit 11 ")


@pytest.mark.slow
@pytest.mark.parametrize("case, args, message", [
    ("GOOD does not collect", (6, 16, "test_mem.py::test_step"),
     "GOOD {6} is not good: the test does not collect there: SyntaxError"),
    ("BAD is not bad", (12, 16, "test_mem.py::test_step"),
     "BAD {16} is not bad: [-+][01].0 MiB, within +"),  # the same 72 MiB buffer at both (1 MiB: an arena)
    ("no test", (1, 16, "test_mem.py::test_missing"),
     "the pytest arguments 'test_mem.py::test_missing' select no test at GOOD {1} ("),
    ("two tests", (1, 16, "test_mem.py", "-k", "step or other"),
     "the pytest arguments 'test_mem.py -k step or other' select 2 tests at GOOD {1}: "
     "test_mem.py::test_step, test_mem.py::test_other; expected exactly one gpumem test"),
    ("not a gpumem test", (1, 16, "test_mem.py::test_plain"),
     "the pytest arguments 'test_mem.py::test_plain' select test_mem.py::test_plain at GOOD {1}, which is "
     "not a gpumem test (its report holds no gpumem test): expected one test marked gpumem"),
    ("GOOD after BAD", (16, 1, "test_mem.py::test_step"),
     "GOOD {16} is not an ancestor of BAD {1}: expected GOOD to be an older commit of BAD's history"),
])
def test_bad_input_exits_2_and_says_why(repo, private_tmp, launch_tag, case, args, message):
    root, shas = repo
    good, bad, *rest = args
    done = bisect(root, private_tmp, shas[good - 1], shas[bad - 1], "--", *rest)
    assert done.returncode == 2, done.stdout + done.stderr
    expected = re.sub(r"\{(\d+)\}", lambda m: shas[int(m.group(1)) - 1][:10], message)
    pattern = re.escape(f"gpumem bisect: {expected}").replace(re.escape("[-+][01].0"), "[-+][01]\\.0")
    assert re.search(pattern, done.stderr), done.stderr
    assert leftovers(root, private_tmp) == ([f"worktree {root}"], [])


def test_arguments_that_name_nothing_exit_2(repo, private_tmp):
    root, shas = repo
    done = bisect(root, private_tmp, "xyz", shas[0], "--", "test_mem.py::test_step")
    assert done.returncode == 2
    assert f"gpumem bisect: GOOD 'xyz' is not a commit of {root}: expected a commit" in done.stderr
    done = bisect(root, private_tmp, shas[0], shas[1])
    assert done.returncode == 2
    assert "gpumem bisect: the test is missing: expected -- and then pytest arguments" in done.stderr
    done = bisect(root, private_tmp, shas[0], shas[1], "--nproc", "0", "--", "test_mem.py::test_step")
    assert done.returncode == 2
    assert "argument --nproc: '0' is not accepted: expected a world size >= 1" in done.stderr
    assert leftovers(root, private_tmp) == ([f"worktree {root}"], [])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_mid_bisect_leaves_no_worktree_and_no_process(repo, private_tmp, launch_tag, signum):
    root, shas = repo
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") or k in (TAG_ENV, *OWN_CACHES)}
    env.update(TMPDIR=str(private_tmp), BISECT_TEST_SLEEP="120")
    proc = subprocess.Popen([str(GPUMEM), "bisect", shas[0], shas[15], "--", "test_mem.py::test_step"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    ranks: list[int] = []
    while not ranks and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        ranks = [pid for pid in processes_tagged(launch_tag)
                 if "pytest_gpumem.rankside.rank" in " ".join(_cmdline(pid)) and "exec" not in _cmdline(pid)]
    assert ranks, "no rank started"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signum, out + err
    name = signal.Signals(signum).name
    assert f"stopped by {name}; the temporary worktree and every process of the step are gone" in err
    assert leftovers(root, private_tmp) == ([f"worktree {root}"], [])
    assert processes_tagged(launch_tag) == []


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
