"""Shared helpers for the plugin's tests: a tag on every launch, and a process-table scan."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import psutil
import pytest

TAG_ENV = "GPUMEM_SELFTEST_TAG"
# The caches each test gets (_own_floor_cache): kept by a test that clears the GPUMEM_* environment.
OWN_CACHES = ("GPUMEM_FLOOR_CACHE", "GPUMEM_STARTUP_CACHE")
# What a real gloo job at nproc=2 may hold above its usual peak, by thread timing: gloo's transient
# buffers caught at the peak. FSDP2 read 0, 1.5-2.0 or 3.7-3.9 MiB above its simulated rank (15 reruns:
# benchmarks/results/simulate_fsdp2_spread.txt); DDP's job in test_figures_travel read +3.17 MiB once on
# a loaded CI machine (travel_spread.txt). Used by the tests that compare two real gloo runs' figures.
GLOO_TRANSIENT_MIB = 4.0

# A suite started in the background by a non-interactive shell (`make test &`) gets SIGINT ignored,
# and every process it starts inherits that: the Ctrl-C tests' pytest would ignore their Ctrl-C. A
# handler, unlike SIG_IGN, is reset at exec, so the children start as a terminal's would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _hang_up(signum: int, frame: object) -> None:
    """SIGHUP's default, ended by the signal itself: as a handler, it is reset at exec."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# Likewise a suite started under nohup gets SIGHUP ignored: the SIGHUP test's pytest would ignore it.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, _hang_up)


def processes_tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag``: any survivor of a launch."""
    marker = f"{TAG_ENV}={tag}".encode()
    found = []
    for proc in psutil.process_iter():
        try:
            if marker in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


@pytest.fixture
def launch_tag(monkeypatch: pytest.MonkeyPatch):
    """Tags every process the test launches; afterwards none of them may be alive."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)
    yield tag
    assert processes_tagged(tag) == [], "processes of the launch outlived the test"


@pytest.fixture(autouse=True)
def _own_floor_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """Each test its own floor cache: none is read from, or written to, the user's ~/.cache.

    The ranks' start-up figures are shared by the whole session, as a user's are by their sessions:
    an entry is used only for the same test, launch, size, versions and unchanged files."""
    monkeypatch.setenv("GPUMEM_FLOOR_CACHE", str(tmp_path_factory.mktemp("floor-cache") / "floors.json"))
    monkeypatch.setenv("GPUMEM_STARTUP_CACHE", str(tmp_path_factory.getbasetemp() / "startups.json"))


@pytest.fixture(autouse=True)
def _not_in_ci(monkeypatch: pytest.MonkeyPatch):
    """The plugin fails missing baselines when CI is set; tests that want that set it themselves."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """GPUMEM_FORBID_SKIPS=1 (make test-slurm): a skipped test fails the run, since a skip there
    means the cluster, or a framework, was not there."""
    if not os.environ.get("GPUMEM_FORBID_SKIPS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reporter.write_line(f"GPUMEM_FORBID_SKIPS: {len(skipped)} test(s) skipped: "
                            + ", ".join(r.nodeid for r in skipped), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
