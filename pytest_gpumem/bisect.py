"""``gpumem bisect``: the first commit at which a gpumem test's gated figure grew past the tolerance.

    gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- <pytest args naming one test>
    gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- measure [options] -- PROGRAM ...

GOOD is measured first: its gated figure at the failing size is the reference, and the tolerance
is the test's own as its report records it (``--tolerance`` overrides). BAD must then be more than
the tolerance above it. The commits between them (BAD's first-parent history, from the first one
that contains GOOD) are searched by halving: a commit more than the tolerance above GOOD's figure is bad, one within
it good, and one whose test does not collect, errors or does not measure that size is skipped (a
neighbour is tried instead, as ``git bisect skip`` does). Every commit tried is printed with its
figure and verdict; the last line names the first bad commit.

Why a search of our own rather than ``git bisect run``: the verdict needs GOOD's figure and the
step's report, which a ``bisect run`` script would have to carry between processes; git's search
leaves state (refs, BISECT_LOG) that an interrupted run must reset; and skipping "the nearest
neighbour" is deterministic here, so a test can count the steps.

Nothing of the user's checkout is touched: each step checks the commit out in one temporary
``git worktree`` (hooks off) under a private temporary folder, with the report and the baselines
folder in that folder (``--gpumem-missing-baseline=ignore``). The measuring pytest or ``gpumem
measure`` runs in a fresh interpreter, in a session of its own bound to die with us; on Ctrl-C,
SIGTERM or SIGHUP it is interrupted (its launch kills its ranks), then killed if it lingers, and
the worktree and the folder are removed before we exit. The plugin that measures is the one
installed here: a ``sitecustomize`` in the temporary folder loads this very ``pytest_gpumem``
before the checked-out tree is on ``sys.path``, in pytest and in every rank, so a revision that
holds its own ``pytest_gpumem`` only provides the project under test.

Exit 0: found; 1: not found (the skipped commits leave it ambiguous); 2: bad input, GOOD not
good, BAD not bad; 130/143: interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping, Sequence

import psutil

from .config.settings import option
from .config.spec import SpecError, Tolerance, parse_tolerance
from .judging.growth import compare as compare_sites
from .judging.record import ReportError, SizeRecord, TestRecord, parse_report
from .judging.verdict import against_reference
from .sampling.sites import from_dicts

USAGE = ("gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- <pytest args naming one test>\n"
         "       gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- measure [options] -- PROGRAM ...")
EXAMPLE = "e.g. -- tests/test_train.py::test_ddp"
# What a step's pytest must not write where the user would find it: outputs named by the user's
# environment (each step would overwrite them) and the baselines (the step has its own folder).
_STRIPPED_ENV = tuple(option(name).env or "" for name in (
    "report", "markdown", "plots", "benchmark_json", "torch_snapshot", "baselines", "missing_baseline",
)) + ("GITHUB_STEP_SUMMARY",)
_QUIET = {"-v", "-vv", "-vvv", "--verbose", "-q", "-qq", "--quiet"}
_GRACE_S = 30.0  # how long an interrupted step may take to kill its ranks before it is killed


class BadInput(Exception):
    """Exit 2: the message says what was given and what is accepted."""


class _Stop(Exception):
    """SIGTERM or SIGHUP, raised in the main thread so that the clean-up runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# ---------------------------------------------------------------------------------------------- peak sites


def _sites_of(size: SizeRecord | Mapping[str, Any]) -> tuple[Any, Any] | None:
    """(sites keyed by rank, gated rank) of a size, typed or raw JSON; None without sites."""
    if isinstance(size, Mapping):
        return (size["sites"], size.get("gated_rank")) if size.get("sites") is not None else None
    sites = getattr(size, "sites", None)
    return None if sites is None else (sites, size.gated_rank)


def _listed(sites: Any, rank: int) -> list[Mapping[str, Any]]:
    listed = sites.get(str(rank), sites.get(rank)) if isinstance(sites, Mapping) else None
    return [dict(site) if isinstance(site, Mapping) else site for site in listed or ()]


def site_lines(good: SizeRecord | Mapping[str, Any], bad: SizeRecord | Mapping[str, Any]) -> list[str]:
    """The peak sites of the gated rank that grew from ``good`` to ``bad`` (or are new), largest
    first, by the rule a failing test uses (judging/growth.py): ``+256.0 MiB  examples/x.py:57
    train_step (all_gather)``, then one line summing what is not listed.

    Each side is one size of a report: a :class:`SizeRecord` or its raw JSON (``sizes[i]``), whose
    ``sites`` map a rank (``"0"``) to ``[{"mib", "count", "where", "function", "detail"}, ...]``.
    The rank is the bad side's gated rank (0 when it names none). [] when either side has no
    sites (a report that does not record them).
    """
    found_good, found_bad = _sites_of(good), _sites_of(bad)
    if found_good is None or found_bad is None:
        return []
    rank = found_bad[1] if isinstance(found_bad[1], int) and not isinstance(found_bad[1], bool) else 0
    after = from_dicts(_listed(found_bad[0], rank))
    if not after:
        return []
    return compare_sites(from_dicts(_listed(found_good[0], rank)), after, "the last good commit").lines()


# ---------------------------------------------------------------------------------------------- the search


def search(count: int, probe: Callable[[int], str]) -> tuple[int, int, list[int]]:
    """Halving over commits ``0 .. count-1`` (oldest first), where -1 (GOOD) is good and
    ``count - 1`` (BAD) is bad; ``probe(i)`` says ``good``, ``bad`` or ``skip``.

    Returns ``(last good, first bad, skipped between them)``: with no skipped commit between, the
    first bad commit is ``first bad``; otherwise it is one of the skipped ones or ``first bad``.
    A skipped middle is replaced by its nearest untried neighbour, the later one on a tie.
    """
    good, bad, skipped = -1, count - 1, set[int]()
    while True:
        left = [i for i in range(good + 1, bad) if i not in skipped]
        if not left:
            return good, bad, sorted(i for i in skipped if good < i < bad)
        middle = (good + bad) // 2
        pick = min(left, key=lambda i: (abs(i - middle), -i))
        verdict = probe(pick)
        if verdict == "good":
            good = pick
        elif verdict == "bad":
            bad = pick
        else:
            skipped.add(pick)


# ---------------------------------------------------------------------------------------------- git


def _git(repo: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-C", str(repo), *args],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip() if done.returncode == 0 else ""


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str

    @property
    def short(self) -> str:
        return self.sha[:10]


def _commit(repo: Path, rev: str, name: str) -> Commit:
    sha = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", check=False)
    if not sha:
        raise BadInput(f"{name} {rev!r} is not a commit of {repo}: expected a commit, branch, tag or "
                       f"revision such as HEAD~5")
    return Commit(sha, _git(repo, "log", "-1", "--format=%s", sha))


def between(repo: Path, good: Commit, bad: Commit) -> list[Commit]:
    """BAD's first-parent history after GOOD, oldest first and BAD last, less the commits that do not
    contain GOOD (those before the merge of a GOOD on a side branch)."""
    descendants = set(_git(repo, "rev-list", "--ancestry-path", f"{good.sha}..{bad.sha}").split())
    out = _git(repo, "rev-list", "--first-parent", "--reverse", "--format=%H %s", f"{good.sha}..{bad.sha}")
    commits = []
    for line in out.splitlines():
        sha, _, subject = line.partition(" ")
        if sha != "commit" and sha in descendants:
            commits.append(Commit(sha, subject))
    return commits


# ---------------------------------------------------------------------------------------------- one step


@dataclass
class Measurement:
    """One commit's run: its record (None when it produced none) and why it has no figure."""

    record: TestRecord | None = None
    raw: dict[str, Any] | None = None  # the record's JSON, for what the typed record does not carry yet
    problem: str | None = None
    selected: list[str] | None = None  # the gpumem tests of its report (None: no report read)

    def size(self, nproc: int) -> SizeRecord | None:
        size = self.record.size(nproc) if self.record is not None else None
        return size if size is not None and not size.predicted and size.gated_mib is not None else None

    def raw_size(self, nproc: int) -> Mapping[str, Any] | SizeRecord | None:
        for size in (self.raw or {}).get("sizes") or ():
            if isinstance(size, dict) and size.get("nproc") == nproc:
                return size
        return self.size(nproc)

    def launched(self) -> list[int]:
        return [s.nproc for s in self.record.sizes if not s.predicted] if self.record is not None else []

    def why_no_figure(self, nproc: int) -> str:
        if self.problem is not None:
            return self.problem
        return f"nproc={nproc} not measured here (launched: {', '.join(map(str, self.launched())) or 'none'})"


def _pin_plugin(folder: Path) -> None:
    """A sitecustomize that loads this ``pytest_gpumem`` (then any sitecustomize it shadows)."""
    package = Path(__file__).resolve().parent
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "# Written by gpumem bisect: the plugin that measures is the one installed where gpumem bisect\n"
        "# runs, whatever the checked-out revision holds; the revision only provides the project.\n"
        "import importlib.machinery, importlib.util, os, sys\n"
        f"_spec = importlib.util.spec_from_file_location('pytest_gpumem', {str(package / '__init__.py')!r},\n"
        f"                                               submodule_search_locations=[{str(package)!r}])\n"
        "_module = importlib.util.module_from_spec(_spec)\n"
        "sys.modules['pytest_gpumem'] = _module\n"
        "_spec.loader.exec_module(_module)\n"
        "_here = os.path.dirname(os.path.abspath(__file__))\n"
        "_next = importlib.machinery.PathFinder.find_spec(\n"
        "    'sitecustomize', [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])\n"
        "if _next is not None and _next.loader is not None:\n"
        "    _next.loader.exec_module(importlib.util.module_from_spec(_next))\n"
    )


def _tail(log: str) -> str:
    """The line of a step's output that says what went wrong: pytest's last ``E`` line, else the last line."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"E\s{2,}\S", line)]
    picked = (errors or lines or ["(no output)"])[-1]
    picked = re.sub(r"^E\s+", "", picked)
    return picked if len(picked) <= 160 else picked[:157] + "..."


def _collection_failed(log: str) -> bool:
    """pytest's summary counts collection errors (exit code 2, or 4 when a node id was named)."""
    return bool(re.search(r"error during collection|errors during collection|\b\d+ errors? in [\d.]+s", log))


def _stop_child(proc: subprocess.Popen) -> None:
    """Interrupt a step (pytest then kills its launch's ranks), kill it if it lingers, and kill any
    descendant left over."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except OSError:
        pass
    try:
        proc.wait(_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
    for child in family:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=5)


class Workspace:
    """The temporary folder: one git worktree checked out at each step, the reports, the baselines
    folder, the plugin pin. ``close()`` removes all of it, and the worktree's entry in the repository."""

    def __init__(self, repo: Path, relative_cwd: Path, command: Sequence[str]) -> None:
        self.repo = repo
        self.relative_cwd = relative_cwd
        self.command = list(command)
        self.measure_mode = self.command[:1] == ["measure"]
        self.root = Path(tempfile.mkdtemp(prefix="gpumem-bisect-"))
        self.tree = self.root / "tree"
        self.baselines = self.root / "baselines"
        self.steps = 0
        self.child: subprocess.Popen | None = None
        _pin_plugin(self.root / "pin")
        base = {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}
        base["PYTHONPATH"] = os.pathsep.join([str(self.root / "pin"), *filter(None, [base.get("PYTHONPATH")])])
        self.env = base

    def checkout(self, commit: Commit) -> Path:
        if not self.tree.exists():
            _git(self.repo, "worktree", "add", "--quiet", "--detach", str(self.tree), commit.sha)
        else:
            _git(self.tree, "checkout", "--quiet", "--detach", "--force", commit.sha)
            _git(self.tree, "clean", "-ffdxq")
        return self.tree / self.relative_cwd

    def _run(self, argv: Sequence[str], cwd: Path, log: Path) -> int:
        # ``rank exec`` binds the step to die with us, even if we are SIGKILLed (its ranks die with it).
        bound = [sys.executable, "-m", "pytest_gpumem.rankside.rank", "exec", sys.executable]
        with open(log, "wb") as out:
            self.child = subprocess.Popen([*bound, *argv], cwd=cwd, env=self.env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return self.child.wait()
            finally:
                if self.child.poll() is None:
                    _stop_child(self.child)
                self.child = None

    def collect(self, commit: Commit) -> tuple[int, list[str], str]:
        """pytest's collection of the user's arguments at ``commit``: (exit code, node ids, what went
        wrong); exit code 2 when a module does not collect."""
        cwd = self.checkout(commit)
        if not cwd.is_dir():
            return 4, [], f"the folder {str(self.relative_cwd)!r} does not exist at this commit"
        log = self.root / "collect.log"
        args = [a for a in self.command if a not in _QUIET]
        code = self._run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args], cwd, log)
        text = log.read_text(errors="replace")
        if code != 0 and _collection_failed(text):
            return 2, [], _tail(text)
        ids = []
        for line in text.splitlines():
            if not line.strip():
                break
            ids.append(line.strip())
        return code, ids if code == 0 else [], _tail(text)

    def measure(self, commit: Commit) -> Measurement:
        cwd = self.checkout(commit)
        if not cwd.is_dir():
            return Measurement(problem=f"the folder {str(self.relative_cwd)!r} does not exist at this commit")
        self.steps += 1
        report, log = self.root / f"report-{self.steps}.json", self.root / f"step-{self.steps}.log"
        if self.measure_mode:
            options, sep, program = _split(self.command[1:])
            argv = ["-m", "pytest_gpumem.cli", "measure", *options, "--report", str(report), *sep, *program]
        else:
            shutil.rmtree(self.baselines, ignore_errors=True)
            argv = ["-m", "pytest", *self.command, "--gpumem", f"--gpumem-report={report}", "-p", "no:cacheprovider",
                    "--gpumem-missing-baseline=ignore", f"--gpumem-baselines={self.baselines}"]
        code = self._run(argv, cwd, log)
        accepted = (0, 1)  # pytest: passed / failed; gpumem measure: passed / a launch failed
        if code not in accepted or not report.exists():
            text = log.read_text(errors="replace")
            if not self.measure_mode and _collection_failed(text):
                return Measurement(problem=f"the test does not collect: {_tail(text)}")
            what = "gpumem measure" if self.measure_mode else "pytest"
            return Measurement(problem=f"{what} exit code {code}: {_tail(text)}")
        try:
            raw = json.loads(report.read_text())
            records = parse_report(raw)
        except (ValueError, ReportError) as exc:
            return Measurement(problem=f"unreadable report: {exc}")
        names = [r.test for r in records]
        if len(records) != 1:
            return Measurement(problem=f"{len(records)} gpumem tests ran: {', '.join(names) or 'none'}",
                               selected=names)
        record = records[0]
        found = Measurement(record=record, raw=raw["tests"][0], selected=names)
        errored = record.status == "failed" and record.cause not in ("limit", "xpass-strict")  # crash, baseline
        if errored or record.status == "skipped":
            first = (record.messages[0] if record.messages else record.status).strip().splitlines()
            found.problem = f"the test {'errors' if errored else 'is skipped'}: " + (
                first[-1] if first else record.status)
        return found

    def close(self) -> None:
        if self.child is not None and self.child.poll() is None:
            _stop_child(self.child)
        if self.tree.exists():
            _git(self.repo, "worktree", "remove", "--force", str(self.tree), check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        _git(self.repo, "worktree", "prune", check=False)


def _split(args: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(options, ["--"] or [], program) of a ``measure`` command."""
    if "--" in args:
        at = list(args).index("--")
        return list(args[:at]), ["--"], list(args[at + 1:])
    return list(args), [], []


# ---------------------------------------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpumem bisect", usage=USAGE,
        description="Find the first commit at which a gpumem test's gated peak, at the failing world size, "
                    "grew past the tolerance of GOOD's figure. Each commit is measured in a temporary git "
                    "worktree (your checkout, its working tree and its baselines stay untouched); commits "
                    "that do not collect or whose test errors are skipped. Prints every commit tried "
                    "(sha, subject, gated MiB, good/bad/skip and why), then the peak sites that grew, and "
                    "last 'first bad commit: <sha> <subject>'.",
        epilog="Everything after -- names one gpumem test as pytest arguments (run with --gpumem, a private "
               "report and baselines folder), or is a gpumem measure command. Exit 0: found; 1: not found "
               "(skipped commits leave it ambiguous; the range is printed); 2: bad input, GOOD not good "
               "or BAD not bad.")
    p.add_argument("good", metavar="GOOD", help="a commit where the figure was fine: the reference")
    p.add_argument("bad", metavar="BAD", help="a later commit (GOOD must be its ancestor) where it grew")
    p.add_argument("--nproc", type=_nproc, help="the failing world size (default: the largest size "
                   "launched at BAD)")
    p.add_argument("--tolerance", metavar="TOL", type=_tolerance, help='growth allowed above GOOD\'s figure, '
                   'e.g. "max(5%%, 32MiB)", the larger of the two (default: the test\'s own tolerance, as '
                   'GOOD\'s report records it)')
    return p


def _nproc(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: expected a world size >= 1")
    return int(text)


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text, "--tolerance")
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail(message: str) -> int:
    print(f"gpumem bisect: {message}", file=sys.stderr)
    return 2


def _line(label: str, commit: Commit, mib: float | None, verdict: str, why: str, width: int) -> str:
    """One commit tried; ``width``: the subjects' column (the longest subject, at most 40)."""
    figure = "-" if mib is None else f"{mib:.1f} MiB"
    subject = commit.subject if len(commit.subject) <= width else commit.subject[:width - 1] + "~"
    return f"{label:>4}  {commit.short}  {subject:<{width}}  {figure:>10}  {verdict} ({why})"


@dataclass
class _Judge:
    nproc: int
    reference: float
    tolerance: Tolerance

    def __call__(self, found: Measurement) -> tuple[str, str]:
        size = found.size(self.nproc)
        if size is None or size.gated_mib is None:
            return "skip", found.why_no_figure(self.nproc)
        kind, allowance = against_reference(size.gated_mib, self.reference, self.tolerance)
        growth = size.gated_mib - self.reference
        if kind == "regression":
            return "bad", f"{growth:+.1f} MiB, over the +{allowance:.1f} allowed"
        return "good", f"{growth:+.1f} MiB, within +{allowance:.1f}"


class _Signals:
    """SIGTERM and SIGHUP raise, as SIGINT does; while cleaning up, all three wait."""

    _NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}
        self.held: list[int] = []

    def __enter__(self) -> _Signals:
        for name in self._NAMES[1:]:
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                self.saved[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signum)

    def hold(self) -> None:
        for name in self._NAMES:
            sig = getattr(signal, name, None)
            if sig is not None:
                self.saved.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, lambda signum, frame: self.held.append(signum))

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    args = parser().parse_args(options)  # exits 2 naming the argument on a bad value
    if not command:
        return _fail("the test is missing: expected -- and then pytest arguments naming one gpumem test "
                     f"({EXAMPLE}), or -- measure [options] -- PROGRAM")
    try:
        repo = Path(_git(Path.cwd(), "rev-parse", "--show-toplevel"))
    except RuntimeError:
        return _fail(f"{Path.cwd()} is not inside a git repository: run gpumem bisect in the checkout to search")
    relative = Path.cwd().resolve().relative_to(repo.resolve())
    try:
        good, bad = _commit(repo, args.good, "GOOD"), _commit(repo, args.bad, "BAD")
        if good.sha == bad.sha:
            raise BadInput(f"GOOD and BAD are the same commit {good.short}: expected GOOD older than BAD")
        if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good.sha, bad.sha],
                          capture_output=True).returncode != 0:
            raise BadInput(f"GOOD {good.short} is not an ancestor of BAD {bad.short}: expected GOOD to be an "
                           f"older commit of BAD's history")
        commits = between(repo, good, bad)
    except BadInput as exc:
        return _fail(str(exc))
    signals, space, stopped = _Signals(), None, 0
    with signals:
        try:
            space = Workspace(repo, relative, command)
            code = _bisect(space, good, bad, commits, args)
        except (BadInput, RuntimeError) as exc:  # RuntimeError: a git command failed, with its message
            code = _fail(str(exc))
        except KeyboardInterrupt:
            stopped = signal.SIGINT
        except _Stop as exc:
            stopped = exc.signum
        finally:
            signals.hold()  # a second Ctrl-C must not cut the clean-up short
            if space is not None:
                space.close()
    stopped = stopped or (signals.held[0] if signals.held else 0)
    if stopped:
        print(f"gpumem bisect: stopped by {signal.Signals(stopped).name}; the temporary worktree and "
              f"every process of the step are gone", file=sys.stderr)
        return 128 + stopped
    return code


def _bisect(space: Workspace, good: Commit, bad: Commit, commits: list[Commit], args: argparse.Namespace) -> int:
    selected = _check_selection(space, good) if not space.measure_mode else None
    reference = space.measure(good)
    if reference.selected is not None and len(reference.selected) != 1:
        given = " ".join(space.command)
        if not reference.selected:
            raise BadInput(f"the pytest arguments {given!r} select {selected or 'a test'} at GOOD {good.short}, "
                           f"which is not a gpumem test (its report holds no gpumem test): expected one test "
                           f"marked gpumem, {EXAMPLE}")
        raise BadInput(f"the command {given!r} ran {len(reference.selected)} gpumem tests at GOOD {good.short}: "
                       f"{', '.join(reference.selected)}; expected exactly one")
    if reference.problem is not None or reference.record is None:
        raise BadInput(f"GOOD {good.short} is not good: {reference.why_no_figure(args.nproc or 0)}")
    if reference.record.status == "failed" and reference.record.cause == "limit":
        raise BadInput(f"GOOD {good.short} is not good: its test fails there too: "
                       f"{(reference.record.messages or ('failed',))[0]}; expected an older GOOD where it passes")
    test = reference.record.test
    tolerance = args.tolerance or parse_tolerance(reference.record.limits.tolerance)
    latest = space.measure(bad)
    if latest.record is not None and latest.record.test != test:
        latest.problem = f"it ran {latest.record.test}, not {test}"
    nproc = args.nproc or max(latest.launched() or reference.launched() or [1])
    good_size = reference.size(nproc)
    if good_size is None or good_size.gated_mib is None:
        raise BadInput(f"GOOD {good.short} did not measure nproc={nproc}: it launched "
                       f"{', '.join(map(str, reference.launched()))}; expected --nproc among those")
    judge = _Judge(nproc, good_size.gated_mib, tolerance)
    print(f"gpumem bisect: {test}, gated peak at nproc={nproc} ({good_size.gated_label}), growth allowed "
          f"above GOOD: {tolerance}; {len(commits) - 1} commits between GOOD and BAD")
    width = min(40, max(len(c.subject) for c in [good, *commits]))
    print(_line("GOOD", good, good_size.gated_mib, "good", "the reference", width))
    verdict, why = judge(latest)
    bad_size = latest.size(nproc)
    print(_line("BAD", bad, bad_size.gated_mib if bad_size else None, verdict, why, width), flush=True)
    if verdict != "bad":
        raise BadInput(f"BAD {bad.short} is not bad: {why}" + (
            "" if verdict == "skip" else f" (GOOD {good.short}: {good_size.gated_mib:.1f} MiB at nproc={nproc})"))

    measured: dict[int, Measurement] = {-1: reference, len(commits) - 1: latest}
    tried = 0

    def probe(index: int) -> str:
        nonlocal tried
        tried += 1
        commit = commits[index]
        found = space.measure(commit)
        if found.record is not None and found.record.test != test:
            found.problem = f"it ran {found.record.test}, not {test}"
        measured[index] = found
        step_verdict, step_why = judge(found)
        size = found.size(nproc)
        print(_line(str(tried), commit, size.gated_mib if size else None, step_verdict, step_why, width),
              flush=True)
        return step_verdict

    last_good, first_bad, skipped = search(len(commits), probe)
    print(f"gpumem bisect: {tried} commits measured besides GOOD and BAD")
    if skipped:
        span = [commits[i] for i in range(last_good + 1, first_bad + 1)]
        print(f"gpumem bisect: the skipped commits leave it ambiguous: the first bad commit is one of "
              f"{len(span)} commits after {(commits[last_good] if last_good >= 0 else good).short}:")
        for commit in span:
            print(f"  {commit.sha} {commit.subject}" + ("  (skipped)" if commits.index(commit) in skipped else ""))
        print(f"the first bad commit could be any of: {' '.join(c.short for c in span)}")
        return 1
    before = measured[last_good]
    after = measured[first_bad]
    old, new = before.size(nproc), after.size(nproc)
    assert old is not None and new is not None and old.gated_mib is not None and new.gated_mib is not None
    against = commits[last_good] if last_good >= 0 else good
    sites = site_lines(old, new)
    if sites:
        print(f"peak sites that grew at nproc={nproc} ({new.gated_label}) since {against.short}:")
        for line in sites[:10]:
            print(f"  {line}")
        if len(sites) > 10:
            print(f"  ... and {len(sites) - 10} more")
    else:
        print("peak sites: not recorded in these reports")
    first = commits[first_bad]
    print(f"first bad commit: {first.sha} {first.subject} ({new.gated_mib - old.gated_mib:+.1f} MiB at "
          f"nproc={nproc}, {new.gated_label}: {old.gated_mib:.1f} -> {new.gated_mib:.1f} MiB since {against.short})")
    return 0


def _check_selection(space: Workspace, good: Commit) -> str:
    """The pytest arguments must name exactly one test at GOOD (collected without launching anything)."""
    code, ids, last = space.collect(good)
    if code == 2:  # errors during collection: the revision, not the arguments
        raise BadInput(f"GOOD {good.short} is not good: the test does not collect there: {last}")
    if code != 0 or not ids:
        raise BadInput(f"the pytest arguments {' '.join(space.command)!r} select no test at GOOD {good.short} "
                       f"({last}): expected arguments naming one gpumem test, {EXAMPLE}")
    if len(ids) > 1:
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        raise BadInput(f"the pytest arguments {' '.join(space.command)!r} select {len(ids)} tests at GOOD "
                       f"{good.short}: {shown}; expected exactly one gpumem test, {EXAMPLE}")
    return ids[0]

