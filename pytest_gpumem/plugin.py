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

from . import settings as settings_mod
from .rank import SNAPSHOT_ENV, WORKDIR_ENV, declare_config, rank_file, start_torch_history, write_json_atomic
from .spec import Spec, SpecError, parse_marker

# Every rank loads this plugin too and needs only RankSide: the parent's machinery (runner, gate,
# NVML, baselines, outputs) is imported where the parent uses it. Measured: ~60 ms less per rank.

gpumem = pytest.mark.gpumem
"""``from pytest_gpumem import gpumem`` is this marker."""

_RECORD_KEY = "gpumem"
_MARKER_DOC = (
    "gpumem(nproc=1, max_mib=None, max_ratio=<ini>, allow_mib=<ini>, rank=0, device='auto', "
    "launcher=<ini>, timeout=<ini>, tolerance=<ini>, env=None, script=None, module=None, args=(), "
    "config=None, nnodes=None): "
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
    try:  # an unwritable output is a usage error now, not a traceback after every launch ran
        resolved.make_output_folders()
    except settings_mod.SettingsError as exc:
        raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
    if resolved.plots is not None:
        from . import plots

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
    return declare_config


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
        from .baseline import BaselineStore
        from .gate import Gate
        from .gpus import GpuPlanner
        from .leases import default_lease_dir
        from .runner import Runner
        from .slurm import SlurmOptions

        self.config = config
        self.settings = resolved
        self.specs: dict[str, Spec] = {}
        self.records: list[dict[str, Any]] = []
        interval = resolved.interval_ms / 1000.0 if resolved.interval_ms else None
        self.gate = Gate(resolved, BaselineStore(resolved.baselines))
        self.is_worker = hasattr(config, "workerinput")
        self.runner = Runner(
            cwd=Path(config.invocation_params.dir),
            rootdir=Path(config.rootpath),
            rank_pytest_args=self.rank_pytest_args,
            gpu_setup=GpuPlanner.lazy(resolved.lease_dir or default_lease_dir(), resolved.lease_wait, interval),
            host_interval_s=interval,
            snapshot_dir=resolved.torch_snapshot,
            slurm_options=SlurmOptions(resolved.slurm_dir, resolved.srun_args, resolved.nnodes or None),
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
        from . import outputs

        outcome = self.gate.evaluate(self.runner.run(item.nodeid, item.spec))
        item.user_properties.append((_RECORD_KEY, json.dumps(outcome.record)))
        item.user_properties.extend(outputs.junit_properties(outcome.record))
        if outcome.skip_reason is not None:
            pytest.skip(outcome.skip_reason)
        if outcome.failure is not None:
            raise GpumemFailed(outcome.failure)
        for text in outcome.warnings:
            warnings.warn(GpumemWarning(text))

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
        from .report import refresh_lines, table

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
        from . import outputs, plots

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
        recording = start_torch_history() if os.environ.get(SNAPSHOT_ENV) else None
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
