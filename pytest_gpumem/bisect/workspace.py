"""One step of ``gpumem bisect``: a commit checked out in a temporary git worktree, its test measured
by a fresh pytest (or ``gpumem measure``) bound to die with us, its report read into a Measurement.

Nothing of the user's checkout is touched: the worktree (hooks off), the report and the baselines
folder live in one private temporary folder that ``Workspace.close()`` removes. The plugin that
measures is the one installed here: a ``sitecustomize`` in that folder loads this very
``pytest_gpumem`` before the checked-out tree is on ``sys.path``, in pytest and in every rank, so a
revision that holds its own ``pytest_gpumem`` only provides the project under test.
"""

from __future__ import annotations

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
from typing import Sequence

import psutil

from ..config.settings import option
from ..judging.record import ReportError, SizeRecord, TestRecord
from ..judging.record_reader import parse_report
from .commits import Commit, git

# What a step's pytest must not write where the user would find it: outputs named by the user's
# environment (each step would overwrite them) and the baselines (the step has its own folder).
_STRIPPED_ENV = tuple(option(name).env or "" for name in (
    "report", "markdown", "plots", "benchmark_json", "torch_snapshot", "baselines", "missing_baseline",
)) + ("GITHUB_STEP_SUMMARY",)
_QUIET = {"-v", "-vv", "-vvv", "--verbose", "-q", "-qq", "--quiet"}
_GRACE_S = 30.0  # how long an interrupted step may take to kill its ranks before it is killed


@dataclass
class Measurement:
    """One commit's run: its record (None when it produced none) and why it has no figure."""

    record: TestRecord | None = None
    problem: str | None = None
    selected: list[str] | None = None  # the gpumem tests of its report (None: no report read)

    def size(self, nproc: int) -> SizeRecord | None:
        size = self.record.size(nproc) if self.record is not None else None
        return size if size is not None and not size.predicted and size.gated_mib is not None else None

    def launched(self) -> list[int]:
        return [s.nproc for s in self.record.sizes if not s.predicted] if self.record is not None else []

    def why_no_figure(self, nproc: int) -> str:
        if self.problem is not None:
            return self.problem
        return f"nproc={nproc} not measured here (launched: {', '.join(map(str, self.launched())) or 'none'})"


def _pin_plugin(folder: Path) -> None:
    """A sitecustomize that loads this ``pytest_gpumem`` (then any sitecustomize it shadows)."""
    package = Path(__file__).resolve().parent.parent  # pytest_gpumem
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
    """The line of a step's output that says what went wrong: pytest's last ``E`` line, else the first
    line under a collection or setup error's header (a marker error has no ``E`` line; pytest's own last line,
    ``ERROR: found no collectors for ...``, says only that it failed), else the last line."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"E\s{2,}\S", line)]
    headers = [i for i, line in enumerate(lines[:-1]) if re.match(r"_+ ERROR (collecting|at setup of) .* _+$", line)]
    under = [lines[headers[0] + 1]] if headers and not lines[headers[0] + 1].startswith("_") else []
    picked = (errors or under or lines or ["(no output)"])[-1]
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
            git(self.repo, "worktree", "add", "--quiet", "--detach", str(self.tree), commit.sha)
        else:
            git(self.tree, "checkout", "--quiet", "--detach", "--force", commit.sha)
            git(self.tree, "clean", "-ffdxq")
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
            records = parse_report(json.loads(report.read_text()))
        except (ValueError, ReportError) as exc:
            return Measurement(problem=f"unreadable report: {exc}")
        names = [r.test for r in records]
        if len(records) != 1:
            return Measurement(problem=f"{len(records)} gpumem tests ran: {', '.join(names) or 'none'}",
                               selected=names)
        record = records[0]
        found = Measurement(record=record, selected=names)
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
            git(self.repo, "worktree", "remove", "--force", str(self.tree), check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        git(self.repo, "worktree", "prune", check=False)


def _split(args: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(options, ["--"] or [], program) of a ``measure`` command."""
    if "--" in args:
        at = list(args).index("--")
        return list(args[:at]), ["--"], list(args[at + 1:])
    return list(args), [], []
