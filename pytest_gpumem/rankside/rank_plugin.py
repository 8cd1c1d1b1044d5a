"""The pytest plugin inside a rank: the test runs as an ordinary test, and its outcome is written
for the parent to read (``rankside.protocol``).

``plugin.py`` registers it when ``GPUMEM_WORKDIR`` is set (the rank's pytest). Its hooks are marked
with pluggy's own marker for the ``pytest`` project, which is what ``pytest.hookimpl`` is, so this
module stays plain Python like the rest of the rank side.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pluggy

from ..config.env_names import SNAPSHOT_ENV
from . import protocol
from .protocol import RankResult, RankState
from .rank import allocator, file_rank, startup_ended

hookimpl = pluggy.HookimplMarker("pytest")


def crash_line(report: Any) -> str:
    """The failure in one line, as pytest's short summary shows it (``RuntimeError: boom``)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "") or "") or report.longreprtext
    return next((line.strip() for line in message.splitlines() if line.strip()), "")


OUTPUT_LINES = 20  # of a failed rank's own output, quoted in its failure text


def own_output(report: Any) -> str:
    """The last lines the test printed before it failed (its captured stdout and stderr): what a
    user would otherwise write to a file to read."""
    lines = [line for text in (report.capstdout, report.capstderr) for line in text.splitlines()]
    if not lines:
        return ""
    shown = lines[-OUTPUT_LINES:]
    more = f"last {len(shown)} of {len(lines)} lines" if len(lines) > len(shown) else "all of it"
    return f"\n--- the rank's own output ({more}) ---\n" + "\n".join(shown)


class RankSide:
    """Inside a rank: run the test normally and write its outcome for the parent."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.rank = file_rank()
        self.outcome: RankResult | None = None

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._set("failed", f"collection error in the rank:\n{report.longreprtext}",
                      f"collection error: {crash_line(report)}")

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            where = "" if report.when == "call" else f"in {report.when}: "
            self._set("failed", f"[{report.when}] {report.longreprtext}{own_output(report)}",
                      where + crash_line(report))
        elif report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._set("skipped", reason)
        elif report.passed and report.when == "call" and self.outcome is None:
            self.outcome = RankResult("passed")

    @hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: Any) -> None:
        """The rank's start-up ends here: its host capture splits (or begins), before any fixture."""
        startup_ended()

    @hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: Any) -> Generator[None, None, None]:
        """The body's own GPU allocator figures: peaks reset where it starts, read where it ends
        (with --gpumem-torch-snapshot, the allocator's history is dumped there too)."""
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
        if self.outcome is None or self.outcome.outcome != "failed":
            self.outcome = RankResult(outcome, text, error)
            if outcome == "failed":
                # Said at once, before the fixtures' teardown: a teardown that waits in a collective
                # for peers that never come (dist.barrier() after a failed body) would otherwise hold
                # the failure back until the launch's timeout. The first failure is final; the
                # launch ends the ranks after its fail-fast grace (docs/reliability.md).
                protocol.write_result(self.workdir, self.rank, self.outcome)

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        if self.outcome is not None and self.outcome.outcome == "failed":
            return  # written when it happened (_set)
        outcome = self.outcome or RankResult(
            "failed", f"the rank's pytest ran no test (exit status {int(exitstatus)}): "
                      "was the test id collected the same way inside the rank?")
        protocol.write_result(self.workdir, self.rank, outcome)
