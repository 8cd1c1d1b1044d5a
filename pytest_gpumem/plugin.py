"""pytest glue only: options, ini keys, the marker, collection, the item that launches, the table.

In the pytest session a user starts, a marked test becomes a :class:`GpumemItem` whose run
launches the ranks. Inside each rank (``GPUMEM_WORKDIR`` set by ``pytest_gpumem.rank``) the same
test runs as an ordinary test, body, fixtures and parameters included, and its outcome is written
for the parent to read.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from . import boxing, outputs, plots
from . import settings as settings_mod
from .baseline import BaselineError, BaselineStore, Entry, host_provenance
from .explain import config_provenance, provenance_diff, timeline_lines
from .gpus import GpuPlanner
from .leases import default_lease_dir
from .rank import SNAPSHOT_ENV, WORKDIR_ENV, rank_file, write_json_atomic
from .report import record, refresh_lines, table
from .runner import Runner, TestRun
from .spec import Spec, SpecError, parse_marker
from .verdict import BaselineRef, Verdict, judge

gpumem = pytest.mark.gpumem
"""``from pytest_gpumem import gpumem`` is this marker."""

_RECORD_KEY = "gpumem"
_MARKER_DOC = (
    "gpumem(nproc=1, max_mib=None, max_ratio=<ini>, allow_mib=<ini>, rank=0, device='auto', "
    "launcher=<ini>, timeout=<ini>, tolerance=<ini>, env=None, script=None, module=None, args=()): "
    "run the test as a real nproc-rank launch and gate the rank's peak memory (pytest --gpumem)"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "distributed peak-memory gates (pytest-gpumem)")
    group.addoption("--gpumem", action="store_true", default=False,
                    help="run gpumem tests as real multi-process launches (skipped otherwise)")
    group.addoption("--gpumem-refresh", action="store_true", default=False,
                    help="rewrite the stored baselines of the gpumem tests that run")
    for opt in settings_mod.OPTIONS:
        group.addoption(opt.flag, dest=f"gpumem_{opt.name}", default=None, help=opt.help)
        parser.addini(opt.ini, help=f"{opt.help} (default: {opt.default})", default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_DOC)
    if os.environ.get(WORKDIR_ENV):
        config.pluginmanager.register(RankSide(config, Path(os.environ[WORKDIR_ENV])), "gpumem-rank")
        return
    try:
        resolved = settings_mod.resolve(
            cli={o.name: config.getoption(f"gpumem_{o.name}") for o in settings_mod.OPTIONS},
            env=os.environ,
            ini={o.name: config.getini(o.ini) for o in settings_mod.OPTIONS},
            rootdir=Path(config.rootpath),
            enabled=bool(config.getoption("gpumem") or config.getoption("gpumem_refresh")),
            refresh=bool(config.getoption("gpumem_refresh")),
        )
    except settings_mod.SettingsError as exc:
        raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
    for opt in ("report", "markdown", "benchmark_json", "plots"):
        path = getattr(resolved, opt)
        folder = path if opt == "plots" else (path.parent if path is not None else None)
        try:  # an unwritable output is a usage error now, not a traceback after every launch ran
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise pytest.UsageError(
                f"pytest-gpumem: gpumem_{opt} {str(path)!r}: cannot create {str(folder)!r} "
                f"({exc.strerror or exc}); expected a writable path") from None
    if resolved.plots is not None:
        try:  # say so before the launches, not after them
            plots.check_available()
        except plots.PlotsUnavailable as exc:
            raise pytest.UsageError(f"pytest-gpumem: --gpumem-plots: {exc}") from None
    config.pluginmanager.register(ParentSide(config, resolved), "gpumem-parent")


@pytest.fixture
def gpumem_config(request: pytest.FixtureRequest):
    """Record the settings that move memory (``gpumem_config({"activation_checkpoint": True})``).

    Inside a rank they are stored with the baseline and, when they differ from it, listed first
    in the failure report. Outside a launch the call does nothing.
    """
    workdir = os.environ.get(WORKDIR_ENV)

    def declare(settings: dict[str, Any]) -> None:
        if not workdir:
            return
        path = rank_file(Path(workdir), int(os.environ.get("RANK", "0")), "config")
        current = json.loads(path.read_text()) if path.exists() else {}
        current.update({str(k): v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                        for k, v in settings.items()})
        write_json_atomic(path, current)

    return declare


class GpumemFailed(Exception):
    """A gpumem test failed: the message is the whole, self-contained explanation."""


class GpumemWarning(UserWarning):
    """Something a reviewer should see that does not fail the test (e.g. a missing baseline)."""


class GpumemItem(pytest.Item):
    """Stands in for a marked test in the user's session: running it launches the ranks."""

    def __init__(self, *, spec: Spec, original: pytest.Item, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.original = original
        self.own_markers = list(original.own_markers)
        self.keywords.update(original.keywords)

    def runtest(self) -> None:
        self.config.pluginmanager.get_plugin("gpumem-parent").run_item(self)

    def reportinfo(self):
        return self.original.reportinfo()

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GpumemFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


def _spec_for(item: pytest.Item, defaults) -> Spec | None:
    marker = item.get_closest_marker("gpumem")
    if marker is None:
        return None
    try:
        return parse_marker(marker.args, marker.kwargs, defaults)
    except SpecError as exc:
        raise pytest.Collector.CollectError(f"{item.nodeid}: invalid gpumem marker: {exc}") from None


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Validate marker arguments as the test is collected, so a typo is a collection error."""
    result = yield
    parent = collector.config.pluginmanager.get_plugin("gpumem-parent")
    items = result if isinstance(result, list) else [result]
    for item in items:
        if isinstance(item, pytest.Item) and parent is not None:
            spec = _spec_for(item, parent.settings.defaults())
            if spec is not None:
                parent.specs[item.nodeid] = spec
    return result


class ParentSide:
    """The user's session: skips without --gpumem, launches with it, prints the table."""

    def __init__(self, config: pytest.Config, resolved: settings_mod.Settings) -> None:
        self.config = config
        self.settings = resolved
        self.specs: dict[str, Spec] = {}
        self.records: list[dict[str, Any]] = []
        interval = resolved.interval_ms / 1000.0 if resolved.interval_ms else None
        self.store = BaselineStore(resolved.baselines)
        self.is_worker = hasattr(config, "workerinput")
        self.runner = Runner(
            cwd=Path(config.invocation_params.dir),
            rootdir=Path(config.rootpath),
            rank_pytest_args=self.rank_pytest_args,
            gpu_setup=GpuPlanner.lazy(resolved.lease_dir or default_lease_dir(), resolved.lease_wait, interval),
            host_interval_s=interval,
            snapshot_dir=resolved.torch_snapshot,
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items: list[pytest.Item]) -> None:
        for index, item in enumerate(items):
            spec = self.specs.get(item.nodeid)
            if spec is None:
                continue
            if not self.settings.enabled:
                sizes = ", ".join(map(str, spec.sizes))
                item.add_marker(pytest.mark.skip(
                    reason=f"gpumem test (launches nproc {sizes}): run with pytest --gpumem"))
                continue
            items[index] = GpumemItem.from_parent(item.parent, name=item.name, spec=spec, original=item)

    def rank_pytest_args(self, test_id: str) -> list[str]:
        """The rank's own pytest: same rootdir and ini, just this test, no xfail/randomness games."""
        config = self.config
        path, _, rest = test_id.partition("::")
        args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--runxfail",
                "--rootdir", str(config.rootpath)]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        if config.pluginmanager.hasplugin("xdist"):
            args += ["-n", "0"]  # the ini's addopts may ask for workers: not inside a rank
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            args += ["-p", "pytest_gpumem.plugin"]
        target = str(Path(config.rootpath) / path) + ("::" + rest if rest else "")
        return [*args, target]

    def run_item(self, item: GpumemItem) -> None:
        spec, test_id = item.spec, item.nodeid
        test = self.runner.run(test_id, spec)
        test.provenance.update({**config_provenance(dict(spec.config)), "launcher": spec.launcher})
        problems = list(test.problems)
        notes = [note for run in test.runs for note in run.notes]
        stored: dict[int, Entry] = {}
        changes: dict[int, tuple[Entry | None, Entry]] = {}
        verdict: Verdict | None = None
        if test.skip_reason is None and not problems and not self.settings.refresh:
            try:
                stored = self._baselines(test, notes, problems)
            except BaselineError as exc:
                problems.append(f"baseline file unusable (left untouched): {exc}")
        if test.skip_reason is None and not problems:
            refs = {n: BaselineRef(e.gated_mib, spec.tolerance) for n, e in stored.items()}
            verdict = judge(spec, test.results, refs, tuple(notes))
            if self.settings.refresh:
                try:
                    changes = self._refresh(test, verdict)
                except BaselineError as exc:
                    problems.append(f"baseline not refreshed (file left untouched): {exc}")
        changed = provenance_diff(next(iter(stored.values())).provenance, test.provenance) if stored else []
        status = _status(test, verdict, problems)
        rec = record(test, verdict, status, {n: e.gated_mib for n, e in stored.items()})
        rec["baseline_changes"] = [[n, old.gated_mib if old else None, new.gated_mib]
                                   for n, (old, new) in sorted(changes.items())]
        rec["changed_since_baseline"] = changed
        if problems:
            rec["messages"] = problems
        item.user_properties.append((_RECORD_KEY, json.dumps(rec)))
        item.user_properties.extend(outputs.junit_properties(rec))
        if test.skip_reason is not None:
            pytest.skip(test.skip_reason)
        if problems:
            raise GpumemFailed("\n".join(problems))
        assert verdict is not None
        if not verdict.passed:
            raise GpumemFailed(_explained(verdict, changed) + _boxing(test, verdict, stored)
                               + _snapshots(test, verdict))
        for note in verdict.notes:  # a pass worth a reviewer's look: improvements, foreign GPU users
            warnings.warn(GpumemWarning(note))

    def _baselines(self, test: TestRun, notes: list[str], problems: list[str]) -> dict[int, Entry]:
        """Stored entries for this platform; missing ones warn, or fail in CI (configurable)."""
        stored: dict[int, Entry] = {}
        missing: list[int] = []
        platform = ""
        for result in test.results:
            if result.world_size not in test.spec.nproc:
                continue
            platform = result.platform
            entry = self.store.lookup(test.test_id, platform, result.world_size)
            if entry is None:
                missing.append(result.world_size)
            else:
                stored[result.world_size] = entry
        if not missing:
            return stored
        elsewhere = [p for p in self.store.platforms(test.test_id) if p != platform]
        if elsewhere:
            notes.append(f"baselines exist only for other platforms ({', '.join(elsewhere)}); "
                         f"not compared on {platform}")
        sizes = ", ".join(map(str, missing))
        text = (f"no baseline stored for {test.test_id} on {platform} at nproc={sizes} "
                f"in {self.store.file_for(test.test_id)}: record it with "
                f"`gpumem refresh {test.test_id}` and commit the file")
        mode = self.settings.fail_on_missing_baseline
        if mode:
            problems.append(text + " (missing baselines fail when CI is set; gpumem_missing_baseline=warn to relax)")
        elif mode is False:
            warnings.warn(GpumemWarning(text))
        return stored

    def _refresh(self, test: TestRun, verdict: Verdict) -> dict[int, tuple[Entry | None, Entry]]:
        spec = test.spec
        # The ranks' own view (their env knobs, the frameworks they imported), not pytest's.
        provenance = {**host_provenance(os.environ), **test.provenance}
        entries: dict[int, Entry] = {}
        platform = ""
        for result in test.results:
            label, gated = result.gated(spec.rank)
            if result.world_size not in spec.nproc or gated is None:
                continue
            platform = result.platform
            gated_rank = spec.rank if spec.rank != "all" else int(label.split()[1])
            entries[result.world_size] = Entry(
                gated_mib=gated,
                ranks={r: p.mib for r, p in result.peaks.items() if p.mib is not None},
                rank=spec.rank,
                device=result.device,
                method=result.peaks[gated_rank].method,
                provenance=provenance,
            )
        return self.store.update(test.test_id, platform, entries) if entries else {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        """The whole record travels on the call report (to the xdist controller), not into junit.xml."""
        report = yield
        if call.when == "teardown":
            report.user_properties = [p for p in report.user_properties if p[0] != _RECORD_KEY]
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == _RECORD_KEY:
                rec = json.loads(value)
                if hasattr(report, "wasxfail"):
                    rec["status"] = "XFAIL" if report.skipped else "XPASS"
                self.records.append(rec)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.records or self.is_worker:
            return
        records = sorted(self.records, key=lambda r: r["test"])
        terminalreporter.section("gpumem: peak memory per rank")
        for line in table(records):
            terminalreporter.write_line(line)
        caught = [(r["test"], r["status"], m) for r in records for m in r["messages"]]
        if caught:
            terminalreporter.section("gpumem: limits exceeded")
            for test, status, message in caught:
                terminalreporter.write_line(f"{status} {test}: {message}")
        lines = refresh_lines(records)
        if lines:
            terminalreporter.section(f"gpumem: baselines refreshed in {self.settings.baselines}")
            for line in lines:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The controller writes each output once, covering every xdist worker."""
        if self.is_worker:
            return
        s, records = self.settings, sorted(self.records, key=lambda r: r["test"])
        if s.report is not None:
            _write(s.report, json.dumps({"schema": 1, "tests": records}, indent=2) + "\n")
        if s.benchmark_json is not None:
            _write(s.benchmark_json, json.dumps(outputs.benchmark_json(records), indent=2) + "\n")
        if not records:
            return
        text = outputs.markdown(records)
        if s.markdown is not None:
            _write(s.markdown, text)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            with open(summary, "a") as handle:
                handle.write(text + "\n")
        if s.plots is not None:
            plots.plot_all(records, s.plots)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _explained(verdict: Verdict, changed: list[str]) -> str:
    """The verdict, then what differs from the baseline's provenance, then when each rank peaked."""
    lines = [verdict.render()]
    if changed:
        lines.append("  changed since the baseline (declared config first):")
        lines.extend(f"    {line}" for line in changed)
    lines.append("  per-rank peaks over the run:")
    lines.extend(f"    {line}" for line in timeline_lines(verdict.results))
    return "\n".join(lines)


def _boxing(test: TestRun, verdict: Verdict, stored: dict[int, Entry]) -> str:
    """OneFlow nn.Graph SBP conversions at the first failing size, against its baseline's."""
    failing = {check.world_size for check in verdict.failures}
    # The largest failing size: one rank has no conversions to show.
    run = next((r for r in sorted(test.runs, key=lambda r: -r.launch.nproc)
                if r.launch.nproc in failing and r.boxings), None)
    if run is None:
        return ""
    size = run.launch.nproc
    entry = stored.get(size)
    old = boxing.from_provenance(entry.provenance) if entry else None
    heading = (f"nn.Graph boxing (SBP conversions) at nproc={size} against the baseline:" if old is not None
               else f"nn.Graph boxing (SBP conversions) at nproc={size} (no audited baseline to compare):")
    lines = boxing.explain(old or {}, run.boxings)
    return "\n  " + heading + "".join(f"\n    {line}" for line in lines) if lines else ""


def _snapshots(test: TestRun, verdict: Verdict) -> str:
    """Where the failing size's torch allocator snapshots are (open them at pytorch.org/memory_viz)."""
    failing = {check.world_size for check in verdict.failures}
    paths = [f"    nproc={run.launch.nproc} rank {rank}: {path}" for run in test.runs
             if run.launch.nproc in failing for rank, path in sorted(run.snapshots.items())]
    return "\n  torch memory snapshots (pytorch.org/memory_viz):\n" + "\n".join(paths) if paths else ""


def _status(test: TestRun, verdict: Verdict | None, problems: list[str]) -> str:
    if test.skip_reason is not None:
        return "skip"
    if problems:
        return "ERROR"
    return "pass" if verdict is not None and verdict.passed else "FAIL"


def _start_torch_history():
    """torch, when it is installed and has a GPU; the history must start before the body allocates."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return torch


class RankSide:
    """Inside a rank: run the test normally and write its outcome for the parent."""

    def __init__(self, config: pytest.Config, workdir: Path) -> None:
        self.workdir = workdir
        self.rank = int(os.environ.get("RANK", "0"))
        self.outcome: dict[str, str] | None = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._set("failed", f"collection error in the rank:\n{report.longreprtext}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self._set("failed", f"[{report.when}] {report.longreprtext}")
        elif report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._set("skipped", reason)
        elif report.passed and report.when == "call" and self.outcome is None:
            self.outcome = {"outcome": "passed", "text": ""}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        """With --gpumem-torch-snapshot: the CUDA allocator's history of this rank, dumped after the body."""
        recording = _start_torch_history() if os.environ.get(SNAPSHOT_ENV) else None
        try:
            return (yield)
        finally:
            if recording is not None:
                recording.cuda.memory._dump_snapshot(str(rank_file(self.workdir, self.rank, "snapshot")))
                recording.cuda.memory._record_memory_history(enabled=None)

    def _set(self, outcome: str, text: str) -> None:
        if self.outcome is None or self.outcome["outcome"] != "failed":
            self.outcome = {"outcome": outcome, "text": text}

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        outcome = self.outcome or {
            "outcome": "failed",
            "text": f"the rank's pytest ran no test (exit status {int(exitstatus)}): "
                    "was the test id collected the same way inside the rank?",
        }
        write_json_atomic(rank_file(self.workdir, self.rank, "result"), outcome)
