"""pytest glue only: options, ini keys, the marker, collection, and the hooks that hand a test to
the session (``session.py``) and its outcome back to pytest.

In the pytest session a user starts, a marked test becomes a :class:`GpumemItem` whose run
launches the ranks. Inside each rank (``GPUMEM_WORKDIR`` set by ``pytest_gpumem.rankside.rank``) the same
test runs as an ordinary test, body, fixtures and parameters included, under the rank's own plugin
(``rankside.rank_plugin``), which writes its outcome for the parent to read.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator

import pytest

from .config import settings as settings_mod
from .config.env_names import WORKDIR_ENV
from .config.spec import LAUNCHERS, Spec, SpecError, launcher_entry_points, marker_signature, parse_marker
from .rankside.rank import declare_config

if TYPE_CHECKING:
    from .judging.gate import Outcome
    from .judging.record import TestRecord
    from .launching.watch import Watch
    from .session import Session

# Nothing paid when unused: every pytest session where the plugin is installed imports this module,
# and every rank loads it too (needing only rankside.rank_plugin). The parent's machinery (driver, gate, NVML,
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
    """The launcher names this session accepts: the entry points (the package's own and the installed
    packages'), and those the conftests and plugins give (``pytest_gpumem_launchers``), registered
    until the session ends."""
    names = {p.name for p in launcher_entry_points()}
    given = [made for found in config.hook.pytest_gpumem_launchers() for made in (found or [])]
    if given:  # the registry (and every launcher module) is imported only where one is added
        from .launching import launchers

        for made in given:
            try:
                launchers.add(made, "pytest_gpumem_launchers")
            except ValueError as exc:
                raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
            names.add(made.name)
            config.add_cleanup(functools.partial(launchers.withdraw, made.name))
    if resolved.launcher not in names:
        raise pytest.UsageError(f"pytest-gpumem: gpumem_launcher={resolved.launcher!r} is not registered: "
                                f"expected one of {', '.join(sorted(names))}")
    return tuple(sorted(names))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_DOC)
    if os.environ.get(WORKDIR_ENV):
        from .rankside.rank_plugin import RankSide

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
    if config.inipath is None and not config.getoption("rootdir", None):
        conflict = settings_mod.rootdir_conflict(list(config.invocation_params.args), config.invocation_params.dir,
                                                 Path(config.rootpath))
        if conflict is not None:
            raise pytest.UsageError(f"pytest-gpumem: {conflict}")
    try:  # an unwritable output is a usage error now, not a traceback after every launch ran
        resolved.make_output_folders()
    except settings_mod.SettingsError as exc:
        raise pytest.UsageError(f"pytest-gpumem: {exc}") from None
    from .session import preflight

    unusable = preflight(resolved)  # a model nobody measured, plots without matplotlib: before any launch
    if unusable is not None:
        raise pytest.UsageError(f"pytest-gpumem: {unusable}")
    config.pluginmanager.register(ParentSide(config, resolved, _launchers(config, resolved)), "gpumem-parent")


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
    """Validate marker arguments as the test is collected, before anything launches.

    A bad marker is that test's error, raised at its setup (``pytest_runtest_setup``): the module's
    other tests are collected and run, with --gpumem or without.
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
            parent.bad_markers[item.nodeid] = f"{item.nodeid}: invalid gpumem marker: {exc}"
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    parent = item.config.pluginmanager.get_plugin("gpumem-parent")
    bad = parent.bad_markers.get(item.nodeid) if parent is not None else None
    if bad is not None:
        pytest.fail(bad, pytrace=False)


class ParentSide:
    """The user's session: skips without --gpumem, launches with it, prints the table."""

    def __init__(self, config: pytest.Config, resolved: settings_mod.Settings,
                 launchers: tuple[str, ...] = ()) -> None:
        self.config = config
        self.settings = resolved
        self.defaults = resolved.defaults(launchers or LAUNCHERS)  # what a marker leaves out, resolved once
        self.specs: dict[str, Spec] = {}
        self.bad_markers: dict[str, str] = {}  # test node id -> its marker's error, raised at its setup
        self.records: list[TestRecord] = []
        self._built: dict[str, TestRecord] = {}  # node id -> its record, until its call report is logged
        self.plots_written: list[Path] = []
        self.is_worker = hasattr(config, "workerinput")
        self._session: Session | None = None

    def machinery(self) -> Session:
        """The machinery, built at the first gpumem test that runs (``session.py``). A method, not a
        property: pytest 8.0 reads every attribute of a registered plugin while it looks for fixtures."""
        if self._session is None:
            from .launching.forking import pytest_refusal
            from .launching.rank_setup import pytest_argv
            from .session import Session

            config = self.config
            live = config.getoption("capture") == "no" and not self.is_worker  # -s: rank 0's output as it comes
            argv = functools.partial(pytest_argv, rootdir=Path(config.rootpath), inipath=config.inipath,
                                     xdist=config.pluginmanager.hasplugin("xdist"),
                                     load_plugin=bool(os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")), tee=live)
            self._session = Session.from_settings(
                self.settings, rootdir=Path(config.rootpath), cwd=Path(config.invocation_params.dir),
                rank_pytest_args=argv, start_refusal=pytest_refusal(config.getini("faulthandler_timeout")),
                watch=self._watch(live))
        return self._session

    def _watch(self, live: bool) -> Watch:
        """-v: a line as each launch starts and ends; else, on a terminal, the size running now on
        the test's line; -s: rank 0's output as it is written."""
        from .launching.watch import RunningLine, Watch

        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None or self.is_worker:  # an xdist worker's terminal is not the user's
            return Watch()
        capture = self.config.pluginmanager.get_plugin("capturemanager")

        def uncaptured(write: Callable[[str], None]) -> Callable[[str], None]:
            """Written past pytest's capture of the test's output, as its live logging is."""
            def say(text: str) -> None:
                if capture is None:
                    write(text)
                    return
                with capture.global_and_fixture_disabled():
                    write(text)
            return say

        verbose = self.config.get_verbosity() >= 1
        running = None
        tty = terminal.isatty() if callable(terminal.isatty) else terminal.isatty  # a bool in older pytest (8.0)
        if not verbose and not live and tty:
            running = uncaptured(RunningLine(functools.partial(terminal.write, flush=True)))
        return Watch(progress=uncaptured(terminal.write_line) if verbose else None, running=running,
                     echo=terminal.write_line if live else None)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for index, item in enumerate(items):
            spec = self.specs.get(item.nodeid)
            if spec is None:
                continue
            unsupported = settings_mod.unsupported_platform()
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

    def run_item(self, item: GpumemItem) -> None:
        self._finish(item, self.machinery().run(item.nodeid, item.spec))

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
        from .presentation.report import summary

        for title, lines in summary(self.records, self.settings.baselines, self.plots_written, self.settings.plots):
            if title is not None:
                terminalreporter.section(f"gpumem: {title}")
            for line in lines:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The controller writes each output once, covering every xdist worker (pytest's own
        sessionfinish hook runs the terminal summary after this)."""
        s = self.settings
        if self.is_worker or not (self.records or s.report is not None or s.benchmark_json is not None):
            return
        from .presentation.outputs import write_session_outputs

        self.plots_written = write_session_outputs(s, sorted(self.records, key=lambda r: r.test),
                                                   os.environ.get("GITHUB_STEP_SUMMARY"))
