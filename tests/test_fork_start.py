"""Ranks forked from pytest (--gpumem-start, issue 20): the same rank, its faults handled the same.

A forked rank skips the second interpreter, pytest start-up and collection (benchmarks/speed.py).
These launches are real forks of a real pytest (``runpytest_subprocess``: a fresh, single-threaded
process, as a user's is), on the host: ``--gpumem-start=fork`` forks wherever it is safe, and
``--gpumem-track-host=off`` makes it safe on CPU (the tracker must see a rank's imports, so tracked
ranks are exec'd). ``auto`` forks GPU launches only; the GPU machine's run is in
benchmarks/results/gpu_speed.txt. Every test reads how its ranks were started from the JSON
report, so none passes by quietly exec'ing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from test_faults import DIRECT_FAULTS, HELPERS, NEXT, SUBPROCESS_TIMEOUT_S, direct_fault_project

from conftest import processes_tagged

pytestmark = pytest.mark.slow
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
FORK = ("--gpumem-start=fork", "--gpumem-track-host=off")


def run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, list[str]]]:
    """pytest --gpumem in a subprocess; also how each test's sizes were started, from the report."""
    report = pytester.path / "gpumem-report.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                           *args, timeout=SUBPROCESS_TIMEOUT_S)
    starts = {}
    if report.exists():
        starts = {t["test"].split("::")[-1]: [s["start"] for s in t["sizes"]]
                  for t in json.loads(report.read_text())["tests"]}
    return result, starts


@pytest.mark.torch
@needs_torch
def test_forked_rank_runs_the_body_with_its_fixtures_and_frameworks_in_place(pytester, launch_tag):
    """The body runs in a child of pytest (not a fresh interpreter), torch already imported there,
    its fixtures set up in the rank; a CPU matmul in pytest before the fork does not hang the child's
    (OpenMP's pool is dead in a child: the rank runs one thread, as OMP_NUM_THREADS=1 gives an exec'd one)."""
    pytester.makeconftest('''
import pytest

@pytest.fixture
def where():
    import os
    return os.getpid()
''')
    pytester.makepyfile(test_forked='''
import os
import sys

import psutil
import pytest
import torch

# pytest runs this at collection: OpenMP's worker threads now exist in pytest, not in a forked child
WARM = (torch.ones(512, 512) @ torch.ones(512, 512)).sum().item()


@pytest.mark.gpumem(nproc=[1, 2], timeout=60)
def test_forked(where):
    me = psutil.Process()
    assert where == me.pid, "the fixture ran in the rank"
    assert "pytest_gpumem.rankside.rank" not in " ".join(me.cmdline()), "forked, not exec'd"
    assert "pytest" in " ".join(me.parent().cmdline()), "its parent is the user's pytest"
    assert torch.get_num_threads() == 1
    assert (torch.ones(512, 512) @ torch.ones(512, 512)).sum().item() == WARM
    fresh = torch.Generator().manual_seed(67280421310721)  # a fresh interpreter's default generator
    assert torch.randn(3).tolist() == torch.randn(3, generator=fresh).tolist(), "not pytest's RNG state"
    assert os.environ["WORLD_SIZE"] in ("1", "2") and os.environ["OMP_NUM_THREADS"] == "1"
''')
    result, starts = run(pytester, *FORK)
    result.assert_outcomes(passed=1)
    assert starts == {"test_forked": ["fork", "fork"]}
    assert processes_tagged(launch_tag) == []


def test_forked_rank_imports_the_project_afresh_with_its_own_environment(pytester, launch_tag):
    """The test module and its conftest run again in the rank, as in an exec'd one: module-level code
    sees the rank's RANK, WORLD_SIZE and marker env, and none of the state an earlier test left in pytest."""
    pytester.makeconftest('''
import os

import pytest

RANK_AT_IMPORT = os.environ.get("RANK")


@pytest.fixture
def conftest_rank():
    return RANK_AT_IMPORT
''')
    pytester.makepyfile(test_afresh='''
import os

import pytest

AT_IMPORT = (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("BATCH"))
SEEN = []


def test_a_plain_test_first():
    SEEN.append("plain")  # in pytest's own process


@pytest.mark.gpumem(nproc=2, timeout=60, env={"BATCH": "64"})
def test_afresh(conftest_rank):
    assert AT_IMPORT == (os.environ["RANK"], "2", "64")
    assert SEEN == [], "module state left by the plain test in pytest"
    assert conftest_rank == os.environ["RANK"]
''')
    result, starts = run(pytester, *FORK)
    result.assert_outcomes(passed=2)
    assert starts == {"test_afresh": ["fork"]}


def test_a_pytest_xdist_worker_forks_its_ranks(pytester, launch_tag, monkeypatch):
    """A worker runs no Python thread of its own, and gets PYTHONDONTWRITEBYTECODE after it starts
    (the controller's): the forked rank applies it (sys.dont_write_bytecode), so it still forks."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    pytester.makepyfile(test_worker='''
import sys

import psutil
import pytest

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_worker():
    assert "pytest_gpumem.rankside.rank" not in " ".join(psutil.Process().cmdline())
    assert sys.dont_write_bytecode
''')
    result, starts = run(pytester, "-n", "1", *FORK)
    assert starts == {"test_worker": ["fork"]}
    result.assert_outcomes(passed=1)


def test_exec_and_auto_on_the_host_start_fresh_interpreters(pytester):
    """exec always; auto forks GPU launches only, so on the host nothing changes (the record says exec)."""
    pytester.makepyfile(test_exec='''
import psutil
import pytest

@pytest.mark.gpumem(nproc=1, timeout=60)
def test_exec():
    assert "pytest_gpumem.rankside.rank" in " ".join(psutil.Process().cmdline())
''')
    for args in (("--gpumem-start=exec", "--gpumem-track-host=off"), ()):
        result, starts = run(pytester, *args)
        result.assert_outcomes(passed=1)
        assert starts == {"test_exec": ["exec"]}, args


@pytest.mark.parametrize("case", sorted(DIRECT_FAULTS))
def test_forked_rank_fault_is_named_the_session_goes_on_and_baselines_stay(pytester, launch_tag, case):
    """The direct launcher's faults (tests/test_faults.py), with forked ranks: same words, no survivor."""
    lines, stored, before = direct_fault_project(pytester, case)
    result, starts = run(pytester, "--gpumem-refresh", *FORK)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(lines)
    result.stdout.no_fnmatch_line("*pytest_gpumem/launching/*")  # the stack shows the rank's frames, not pytest's
    assert starts == {"test_fault": ["fork"], "test_next": ["fork"]}
    assert processes_tagged(launch_tag) == []
    doc = json.loads(stored.read_text())
    assert json.loads(before)["tests"]["test_fault"] == doc["tests"]["test_fault"], "a failed launch never refreshes"


def test_forked_rank_that_hangs_ends_at_timeout_with_its_stack(pytester, launch_tag):
    pytester.makepyfile(test_hang=HELPERS + '''

@pytest.mark.gpumem(nproc=2, timeout=4)
def test_hangs():
    if os.environ["RANK"] == "1":
        wait_for_peer()
''' + NEXT)
    result, starts = run(pytester, *FORK)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 2 hung: no result when the launch timed out after 4 s*",
                                 "*in wait_for_peer*", "*in test_hangs*"])
    assert starts["test_hangs"] == ["fork"]
    assert processes_tagged(launch_tag) == []


def test_pytest_killed_takes_its_forked_ranks_along(pytester, launch_tag, tmp_path, monkeypatch):
    """A forked rank is bound to die with pytest (PR_SET_PDEATHSIG), as an exec'd one is."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    pytester.makepyfile(test_killed=HELPERS + '''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_killed():
    if os.environ["RANK"] == "1":
        os.kill(pytest_pid(), signal.SIGKILL)
    time.sleep(30)
''')
    result, _ = run(pytester, *FORK)
    assert result.ret == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while processes_tagged(launch_tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_tagged(launch_tag) == []


REFUSALS = {
    "marker-env": ('@pytest.mark.gpumem(nproc=1, timeout=60, env={"MALLOC_ARENA_MAX": "2"})', "", (),
                   "the ranks' MALLOC_ARENA_MAX differs from what pytest started with (read as an interpreter "
                   "or a library starts, before a fork could set it)"),
    "pythonpath": ("@pytest.mark.gpumem(nproc=1, timeout=60)", "import os\nos.environ['PYTHONPATH'] = 'elsewhere'\n",
                   (), "the ranks' PYTHONPATH differs from what pytest started with (read as an interpreter "
                   "or a library starts, before a fork could set it)"),
    "tracked": ("@pytest.mark.gpumem(nproc=1, timeout=60)", "", ("--gpumem-track-host=on",),
                "host allocations are tracked (a forked rank's start-up would be pytest's, not its own)"),
    "thread": ("@pytest.mark.gpumem(nproc=1, timeout=60)",
               "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name='users-poller', "
               "daemon=True).start()\n", (), "pytest runs other Python threads (users-poller)"),
    "omp": ("@pytest.mark.gpumem(nproc=1, timeout=60)", "import os\nos.environ['OMP_NUM_THREADS'] = '4'\n", (),
            "OMP_NUM_THREADS=4 for the ranks (a forked rank keeps pytest's OpenMP pool)"),
    "faulthandler": ("@pytest.mark.gpumem(nproc=1, timeout=60)", "", ("-o", "faulthandler_timeout=300"),
                     "faulthandler_timeout is set (its watchdog cannot be re-armed in a forked rank)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_fork_refused_where_it_would_change_the_rank_says_why(pytester, case):
    """Asked for fork where a fork would change the rank: exec'd, and the warning and record say why."""
    marker, conftest, args, why = REFUSALS[case]
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_refused=f'''
import psutil
import pytest

{marker}
def test_refused():
    assert "pytest_gpumem.rankside.rank" in " ".join(psutil.Process().cmdline())
''')
    track = () if case == "tracked" else ("--gpumem-track-host=off",)
    result, starts = run(pytester, "--gpumem-start=fork", *track, *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*ranks exec'd, not forked: {why}*"])
    assert starts == {"test_refused": [f"exec ({why})"]}


def test_forked_rank_gets_a_marker_env_read_late_and_leaves_no_launch_folder(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    pytester.makepyfile(test_tidy='''
import pytest

@pytest.mark.gpumem(nproc=2, timeout=60, env={"FROM_THE_MARKER": "yes"})
def test_tidy():
    import gc
    import os

    assert os.environ["FROM_THE_MARKER"] == "yes"  # read late, by the body: set in the forked child
    assert gc.get_freeze_count() > 0, "pytest's objects stay frozen in the child (no copy-on-write by its collector)"
''')
    result, starts = run(pytester, *FORK)
    result.assert_outcomes(passed=1)
    assert starts == {"test_tidy": ["fork"]}
    assert [p.name for p in Path(tmp_path).glob("gpumem-*")] == []
    assert not os.environ.get("GPUMEM_WORKDIR")


# --- The checks themselves, on files made to order --------------------------------------------------

def test_startup_variables_that_differ_from_the_process_start_are_named(tmp_path, monkeypatch):
    from pytest_gpumem.launching.forking import startup_env_changes

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # a plain pytest (an xdist worker: below)

    started = tmp_path / "environ"
    started.write_bytes(b"PATH=/bin\0MALLOC_ARENA_MAX=4\0HOME=/h\0")
    on_path = os.pathsep.join(sys.path[:2])  # where this process imports from, whatever it started with
    same = {"PATH": "/usr/bin", "PYTHONPATH": on_path, "MALLOC_ARENA_MAX": "4", "NCCL_DEBUG": "INFO",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert startup_env_changes(same, started) == []  # late variables and the ones a fork handles
    changed = {**same, "PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{on_path}", "LD_PRELOAD": "x.so"}
    del changed["MALLOC_ARENA_MAX"]
    assert startup_env_changes(changed, started) == ["LD_PRELOAD", "MALLOC_ARENA_MAX", "PYTHONPATH"]
    assert startup_env_changes(same, tmp_path / "missing") == ["the environment (unreadable)"]


def test_an_xdist_worker_counts_the_library_variables_it_was_given_after_its_start(tmp_path, monkeypatch):
    """pytest-xdist starts a worker with an almost empty environment, then applies the controller's
    before anything is imported: OpenBLAS and OpenMP, loaded later, read the applied values."""
    from pytest_gpumem.launching.forking import startup_env_changes

    started = tmp_path / "environ"
    started.write_bytes(b"PATH=/bin\0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("LD_PRELOAD", "x.so")  # read by the loader at exec: the worker started without it
    ranks = dict(os.environ)  # the ranks' environment is the worker's, as the launch builds it
    ranks = {k: v for k, v in ranks.items() if not k.startswith(("PYTHON", "LD_", "MALLOC_", "GLIBC_"))}
    ranks["LD_PRELOAD"] = "x.so"
    assert startup_env_changes(ranks, started) == ["LD_PRELOAD"]
    assert startup_env_changes({**ranks, "OPENBLAS_CORETYPE": "Zen"}, started) == ["LD_PRELOAD", "OPENBLAS_CORETYPE"]


def test_cuda_counts_as_initialised_only_where_the_driver_says_so(tmp_path):
    from pytest_gpumem.launching.forking import cuda_initialized

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libnvidia-ml.so.1\n")
    assert cuda_initialized(maps) is False  # NVML alone: forking is fine
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n")
    # Mapped according to the file, but not loaded in this test process: cannot ask, so no fork.
    assert cuda_initialized(maps) is True
    assert cuda_initialized(tmp_path / "missing") is True  # unreadable: cannot tell, so no fork
