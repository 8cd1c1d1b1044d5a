"""pytest glue only: options, ini keys, the marker, collection, the item that launches, the table.

In the pytest session a user starts, a marked test becomes a :class:`GpumemItem` whose run
launches the ranks. Inside each rank (``GPUMEM_WORKDIR`` set by ``pytest_gpumem.rankside.rank``) the same
test runs as an ordinary test, body, fixtures and parameters included, and its outcome is written
for the parent to read.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator

import pytest

from .config import settings as settings_mod
from .config.spec import LAUNCHER_ENTRY_POINTS, LAUNCHERS, Spec, SpecError, marker_signature, parse_marker
from .rankside.rank import SNAPSHOT_ENV, WORKDIR_ENV, allocator, declare_config, file_rank, startup_ended

if TYPE_CHECKING:
    from .gate import Gate, Outcome
    from .judging.record import TestRecord
    from .launching.runner import Runner
    from .launching.scaling import Capacity
    from .rankside import protocol
    from .rankside.protocol import RankState

# Nothing paid when unused: every pytest session where the plugin is installed imports this module,
# and every rank loads it too (needing only RankSide). The parent's machinery (runner, gate, NVML,
# leases, baselines, psutil, filelock) is imported at the first gpumem test that runs, the outputs
# only when there is something to write. `make bench` measures the cost (benchmarks/startup.py).

gpumem = pytest.mark.gpumem
"""``from pytest_gpumem import gpumem`` is this marker."""

_RECORD_KEY = "gpumem"
_MARKER_DOC = (
    f"{marker_signature()}: run the test as a real nproc-rank launch and gate the rank's peak memory "
    "(pytest --gpumem); an argument in [brackets] defaults to that ini setting"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "distributed peak-memory gates (pytest-gpumem)")
    group.addoption("--gpumem", action="store_true", default=False,
                    help="run gpumem tests as real multi-process launches (skipped otherwise)")
    group.addoption("--gpumem-refresh", action="store_true", default=False,
                    help="rewrite the stored baselines of the gpumem tests that run")
    for opt in settings_mod.OPTIONS:
        flag_only = {"action": "store_const", "const": opt.const} if opt.const is not None else {}
        group.addoption(opt.flag, dest=f"gpumem_{opt.name}", default=None, help=opt.help, **flag_only)
        parser.addini(opt.ini, help=f"{opt.help} (default: {opt.default_text})", default=None)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def _launchers(config: pytest.Config, resolved: settings_mod.Settings) -> tuple[str, ...]:
    """The launcher names this session accepts: the built-in ones, the installed packages' entry
    points, and those the conftests and plugins give (``pytest_gpumem_launchers``), registered
    until the session ends."""
    import importlib.metadata

    names = set(LAUNCHERS) | {p.name for p in importlib.metadata.entry_points(group=LAUNCHER_ENTRY_POINTS)}
    given = [made for found in config.hook.pytest_gpumem_launchers() for made in (found or [])]
    if given:  # the registry (and every launcher module) is imported only where one is added
        from .launching import launcher

        for made in given:
            try:
                launcher.add(made, "pytest_gpumem_launchers")
            except ValueError as exc:
                raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
            names.add(made.name)
            config.add_cleanup(functools.partial(launcher.withdraw, made.name))
    if resolved.launcher not in names:
        raise pytest.UsageError(f"pytest-gpumem: gpumem_launcher={resolved.launcher!r} is not registered: "
                                f"expected one of {', '.join(sorted(names))}")
    return tuple(sorted(names))


def unsupported_platform(platform: str | None = None) -> str | None:
    """Why gpumem tests cannot run here, or None on Linux (ranks read /proc and use prctl)."""
    platform = sys.platform if platform is None else platform
    if platform.startswith("linux"):
        return None
    return f"pytest-gpumem runs on Linux only (it reads /proc and uses prctl); this is {platform}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_DOC)
    if os.environ.get(WORKDIR_ENV):
        config.pluginmanager.register(RankSide(Path(os.environ[WORKDIR_ENV])), "gpumem-rank")
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
    _check_rootdir(config)
    try:  # an unwritable output is a usage error now, not a traceback after every launch ran
        resolved.make_output_folders()
    except settings_mod.SettingsError as exc:
        raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
    if resolved.enabled and resolved.fake_gpu != "off":  # a model nobody measured: say so before any launch
        from .rankside.fakegpu.models import CALIBRATION_FILE, CalibrationError, model

        try:
            model(resolved.fake_gpu_model, resolved.baselines / CALIBRATION_FILE)
        except CalibrationError as exc:
            raise pytest.UsageError(f"pytest-gpumem: gpumem_fake_gpu_model: {exc}") from None
    if resolved.plots is not None:
        from .presentation import plots

        try:  # say so before the launches, not after them
            plots.check_available()
        except plots.PlotsUnavailable as exc:
            raise pytest.UsageError(f"pytest-gpumem: --gpumem-plots: {exc}") from None
    config.pluginmanager.register(ParentSide(config, resolved, _launchers(config, resolved)), "gpumem-parent")


def _check_rootdir(config: pytest.Config) -> None:
    """Stop a run whose rootdir (and so whose baselines folder) came from one of our option values.

    pytest picks the rootdir from the command line's paths before plugins declare their options,
    so in ``--gpumem-plots /tmp/x`` the folder counts as a path: without an ini file the rootdir
    moves to ``/tmp`` and baselines would be read from and written to ``/tmp/baselines``.
    """
    if config.inipath is not None or config.getoption("rootdir", None):
        return
    args = list(config.invocation_params.args)
    flags = {o.flag for o in settings_mod.OPTIONS}
    for flag, value in zip(args, args[1:]):
        if flag in flags and Path(config.invocation_params.dir, value).exists():
            raise pytest.UsageError(
                f"pytest-gpumem: {flag} {value}: pytest took {value!r} for a test path when it chose the "
                f"rootdir ({config.rootpath}), where the baselines folder is found. Write {flag}={value}, "
                "or pass --rootdir, or give the project an ini file (pytest.ini, or [tool.pytest.ini_options] "
                "in pyproject.toml)")


@pytest.fixture
def gpumem_config(request: pytest.FixtureRequest) -> Callable[[dict[str, Any]], None]:
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

    def __init__(self, *, spec: Spec, original: pytest.Item, side: ParentSide, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.original = original
        self.side = side
        self.own_markers = list(original.own_markers)
        self.keywords.update(original.keywords)

    def runtest(self) -> None:
        self.side.run_item(self)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.original.reportinfo()

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> Any:
        if isinstance(excinfo.value, GpumemFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Generator[None, Any, Any]:
    """Validate marker arguments as the test is collected, so a typo is a collection error.

    Every bad marker of a module is named: they are gathered here and raised together when the
    module's collection report is made.
    """
    result = yield
    parent = collector.config.pluginmanager.get_plugin("gpumem-parent")
    items = result if isinstance(result, list) else [result]
    for item in items:
        if not isinstance(item, pytest.Item) or parent is None:
            continue
        marker = item.get_closest_marker("gpumem")
        if marker is None:
            continue
        try:
            parent.specs[item.nodeid] = parse_marker(marker.args, marker.kwargs, parent.defaults)
        except SpecError as exc:
            parent.bad_markers.setdefault(collector.nodeid, []).append(
                f"{item.nodeid}: invalid gpumem marker: {exc}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    parent = collector.config.pluginmanager.get_plugin("gpumem-parent")
    bad = parent.bad_markers.pop(collector.nodeid, None) if parent is not None else None
    if parent is not None and bad:
        # The module's report fails, so pytest will not collect the classes in it: look inside them
        # now, so that their bad markers are named in the same report.
        for child in report.result or []:
            if isinstance(child, pytest.Class):
                try:
                    child.collect()
                except Exception:  # noqa: BLE001 - the class's own error surfaces once the markers are fixed
                    pass
                bad.extend(parent.bad_markers.pop(child.nodeid, []))
        report.outcome = "failed"
        report.longrepr = "\n".join(bad)
        report.result = []
    return report


class ParentSide:
    """The user's session: skips without --gpumem, launches with it, prints the table."""

    def __init__(self, config: pytest.Config, resolved: settings_mod.Settings,
                 launchers: tuple[str, ...] = ()) -> None:
        self.config = config
        self.settings = resolved
        self.defaults = resolved.defaults(launchers or LAUNCHERS)  # what a marker leaves out, resolved once
        self.specs: dict[str, Spec] = {}
        self.bad_markers: dict[str, list[str]] = {}  # collector node id -> messages
        self.records: list[TestRecord] = []
        self._built: dict[str, TestRecord] = {}  # node id -> its record, until its call report is logged
        self.plots_written: list[Path] = []
        self.is_worker = hasattr(config, "workerinput")
        self._machinery: tuple[Gate, Runner] | None = None
        self._capacity: Capacity | None = None

    def machinery(self) -> tuple[Gate, Runner]:
        """The gate and the runner, built at the first gpumem test that runs (see the module top)."""
        if self._machinery is None:
            from . import session

            built = session.Session.from_settings(
                self.settings, rootdir=Path(self.config.rootpath), cwd=Path(self.config.invocation_params.dir),
                rank_pytest_args=self.rank_pytest_args, start_refusal=self._fork_refusal())
            self._machinery = (built.gate, built.runner)
        return self._machinery

    def _fork_refusal(self) -> str | None:
        """What in this pytest session forbids forking ranks from it (launching.forking)."""
        try:
            timeout = float(self.config.getini("faulthandler_timeout") or 0)
        except (ValueError, TypeError):
            timeout = 0.0
        if timeout > 0:  # its watchdog thread is armed during the test: a child re-arming it would hang
            return "faulthandler_timeout is set (its watchdog cannot be re-armed in a forked rank)"
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for index, item in enumerate(items):
            spec = self.specs.get(item.nodeid)
            if spec is None:
                continue
            unsupported = unsupported_platform()
            if unsupported is not None:
                item.add_marker(pytest.mark.skip(reason=f"gpumem test: {unsupported}"))
                continue
            if not self.settings.enabled:
                sizes = ", ".join(map(str, spec.sizes))
                item.add_marker(pytest.mark.skip(
                    reason=f"gpumem test (launches nproc {sizes}): run with pytest --gpumem"))
                continue
            assert item.parent is not None  # a test item always has its module or class
            items[index] = GpumemItem.from_parent(item.parent, name=item.name, spec=spec, original=item, side=self)

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
        from .launching import scaling

        gate, runner = self.machinery()
        outcome = gate.before_launch(item.nodeid, item.spec)  # a broken baseline file fails before 30 s of launches
        if outcome is not None:
            self._finish(item, outcome)
            return
        if self._capacity is None:  # GPUs are counted at the first test whose sizes may pass them
            from .sampling.nvml import visible_gpus

            self._capacity = scaling.Capacity(self.settings.max_nproc, self.settings.predict,
                                              lambda: len(visible_gpus()))
        outcome = gate.evaluate(scaling.run(runner, item.nodeid, item.spec, self._capacity),
                                relaunch=runner.relaunch_for_sites if self.settings.sites == "auto" else None)
        self._finish(item, outcome)

    def _finish(self, item: GpumemItem, outcome: Outcome) -> None:
        """The outcome as pytest's: the record on the report, then skip, fail or warnings."""
        from .presentation import outputs

        if self.is_worker:  # the record travels to the xdist controller as JSON; here it is kept as it is
            item.user_properties.append((_RECORD_KEY, json.dumps(outcome.record.to_json())))
        else:
            self._built[item.nodeid] = outcome.record
        item.user_properties.extend(outputs.junit_properties(outcome.record))
        if outcome.skip_reason is not None:
            pytest.skip(outcome.skip_reason)
        if outcome.failure is not None:
            raise GpumemFailed(outcome.failure)
        for text in outcome.warnings:
            item.warn(GpumemWarning(text))  # reported at the test's own file and line

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """The whole record travels on the call report (to the xdist controller), not into junit.xml."""
        report = yield
        if call.when == "teardown":
            report.user_properties = [p for p in report.user_properties if p[0] != _RECORD_KEY]
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        rec = self._built.pop(report.nodeid, None)  # built in this process: no JSON round trip
        if rec is None:
            sent = [value for key, value in report.user_properties if key == _RECORD_KEY]  # from an xdist worker
            if not sent:
                return
            from .judging.record_reader import read_record

            rec = read_record(json.loads(str(sent[0])), report.nodeid)
        if hasattr(report, "wasxfail"):
            rec = rec.with_status("xfailed" if report.skipped else "xpassed")
        elif report.failed and rec.status == "passed":  # xfail(strict=True) passed: pytest fails it
            rec = rec.with_status("failed", "xpass-strict")
        self.records.append(rec)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.records or self.is_worker:
            return
        from .presentation.report import message_sections, refresh_lines, table
        records = sorted(self.records, key=lambda r: r.test)
        terminalreporter.section("gpumem: peak memory per rank")
        for line in table(records):
            terminalreporter.write_line(line)
        for title, lines in message_sections(records):
            terminalreporter.section(f"gpumem: {title}")
            for line in lines:
                terminalreporter.write_line(line)
        lines = refresh_lines(records)
        if lines:
            terminalreporter.section(f"gpumem: baselines refreshed in {self.settings.baselines}")
            for line in lines:
                terminalreporter.write_line(line)
        if self.plots_written:  # pytest's own sessionfinish hook runs this summary after ours wrote them
            count = len(self.plots_written)
            terminalreporter.write_line(f"gpumem: {count} plot{'s' if count > 1 else ''} written to "
                                        f"{self.settings.plots}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The controller writes each output once, covering every xdist worker."""
        s, records = self.settings, sorted(self.records, key=lambda r: r.test)
        if self.is_worker or not (records or s.report is not None or s.benchmark_json is not None):
            return
        from .judging.record import report_document
        from .presentation import outputs

        if s.report is not None:
            _write(s.report, json.dumps(report_document(records), indent=2) + "\n")
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
            from .presentation import plots

            self.plots_written = plots.plot_all(records, s.plots)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _crash_line(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The failure in one line, as pytest's short summary shows it (``RuntimeError: boom``)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "") or "") or report.longreprtext
    return next((line.strip() for line in message.splitlines() if line.strip()), "")


class RankSide:
    """Inside a rank: run the test normally and write its outcome for the parent."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.rank = file_rank()
        self.outcome: protocol.RankResult | None = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._set("failed", f"collection error in the rank:\n{report.longreprtext}",
                      f"collection error: {_crash_line(report)}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            where = "" if report.when == "call" else f"in {report.when}: "
            self._set("failed", f"[{report.when}] {report.longreprtext}", where + _crash_line(report))
        elif report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._set("skipped", reason)
        elif report.passed and report.when == "call" and self.outcome is None:
            from .rankside import protocol

            self.outcome = protocol.RankResult("passed")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """The rank's start-up ends here: its host capture splits (or begins), before any fixture."""
        startup_ended()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """The body's own GPU allocator figures: peaks reset where it starts, read where it ends
        (with --gpumem-torch-snapshot, the allocator's history is dumped there too)."""
        from .rankside import protocol

        protocol.write_body_started(self.workdir, self.rank)  # from here on a relaunch would run user code twice
        watch = allocator()
        if watch is not None:
            watch.body_started()
        try:
            return (yield)
        finally:
            if watch is not None:
                dump = protocol.rank_file(self.workdir, self.rank, "snapshot") if os.environ.get(SNAPSHOT_ENV) else None
                watch.body_ended(dump)

    def _set(self, outcome: RankState, text: str, error: str = "") -> None:
        from .rankside import protocol

        if self.outcome is None or self.outcome.outcome != "failed":
            self.outcome = protocol.RankResult(outcome, text, error)
            if outcome == "failed":
                # Said at once, before the fixtures' teardown: a teardown that waits in a collective
                # for peers that never come (dist.barrier() after a failed body) would otherwise hold
                # the failure back until the launch's timeout. The first failure is final; the
                # launch ends the ranks after its fail-fast grace (docs/reliability.md).
                protocol.write_result(self.workdir, self.rank, self.outcome)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from .rankside import protocol  # the rank's files: loaded inside a rank only

        if self.outcome is not None and self.outcome.outcome == "failed":
            return  # written when it happened (_set)
        outcome = self.outcome or protocol.RankResult(
            "failed", f"the rank's pytest ran no test (exit status {int(exitstatus)}): "
                      "was the test id collected the same way inside the rank?")
        protocol.write_result(self.workdir, self.rank, outcome)
