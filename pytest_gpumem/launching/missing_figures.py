"""A rank whose gated host figure, its peak of live allocations, is missing though the rank did not die.

The resident high-water mark stands in only for a rank that died before it reported (killed,
crashed, stopped by the plugin): its launch has failed anyway, and the figure is labelled. A rank
that ended well and still has no allocation peak (no exit report, or a report without its peak)
is a fault of the measurement, and its size errors, naming the rank and why: gating its ``VmHWM``,
which counts the libraries' mapped pages and what the allocator keeps, would turn a healthy job red
(issue 64: 538 MiB of VmHWM against a 266 MiB limit, where its live allocations were 209 MiB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..rankside import protocol
from ..sampling import Peak
from ..sampling.allocations import is_allocation_method
from .failures import who
from .supervise import LaunchResult, describe_returncode

_LOG_LINES = 12


def tracking_asked(env: Mapping[str, str], track_env: str) -> bool:
    """Whether the ranks were asked to track their host allocations: as the rank decides it
    (``rankside.rank.switched_off``), from the environment the launch hands them."""
    return env.get(track_env, "").strip().lower() not in ("0", "false", "no", "off")


def died(launch: LaunchResult, outcome: protocol.RankResult | None, rank: int) -> bool:
    """Whether the rank died before it could report: its test failed or left no result, it was
    stopped by the plugin, its own exit status says so, or its launcher's (which ends the others
    when one rank fails: OneFlow's and torchrun's)."""
    if outcome is None or outcome.outcome in ("failed", "missing"):
        return True
    if launch.end != "done" or rank in launch.stopped:
        return True
    return launch.returncodes.get(rank, 0) != 0 or launch.launcher_returncode not in (None, 0)


def missing_host_figures(nproc: int, workdir: Path, launch: LaunchResult, outcomes: Mapping[int, protocol.RankResult],
                         reports: Mapping[int, protocol.ExitReport], host_peaks: Mapping[int, Peak]) -> list[str]:
    """One problem per rank that did not die and has no allocation peak, saying why it has none."""
    problems = []
    for rank in range(nproc):
        peak = host_peaks.get(rank)
        if peak is not None and is_allocation_method(peak.method):
            continue
        if died(launch, outcomes.get(rank), rank):
            continue
        report = reports.get(rank)
        if report is None:
            why = ("its test ended and its launch exited 0, but it wrote no exit report: something ended the "
                   "process inside its exit handlers (os._exit in an atexit handler, a framework's shutdown) or "
                   "an exit handler failed")
        elif report.alloc_problem:
            why = report.alloc_problem
        else:
            why = "its exit report has none: the tracker never ran in it"
        shown = f" ({peak.mib:.1f} MiB)" if peak is not None and peak.mib is not None else ""
        text = (f"{who(launch, rank)}: its host figure, the peak of live allocations, is missing ({why}); the "
                f"size is not gated on its resident high-water mark{shown}, which counts other memory "
                "(docs/measurement.md)")
        log = "\n".join(launch.rank_log(workdir, rank).splitlines()[-_LOG_LINES:])
        problems.append(text + (f"; last lines of its output:\n{log}" if log.strip() else ""))
    return problems


def died_after_passing(nproc: int, workdir: Path, launch: LaunchResult, outcomes: Mapping[int, protocol.RankResult],
                       host_peaks: Mapping[int, Peak]) -> list[str]:
    """A note per rank whose test passed but whose process died before its exit report: its figure is
    its VmHWM, and the user would otherwise read "no rank died" (issue 64: OneFlow aborted a rank at exit)."""
    notes = []
    for rank in range(nproc):
        peak, outcome = host_peaks.get(rank), outcomes.get(rank)
        if peak is None or is_allocation_method(peak.method) or outcome is None or outcome.outcome != "passed":
            continue
        if not died(launch, outcome, rank):
            continue
        code = launch.returncodes.get(rank)
        how = (describe_returncode(code) if code not in (None, 0) else "stopped by the plugin" if rank in launch.stopped
               else f"its launcher exited {launch.launcher_returncode}" if launch.launcher_returncode not in (None, 0)
               else f"the launch ended by {launch.end}")
        log = "\n".join(launch.rank_log(workdir, rank).splitlines()[-_LOG_LINES:])
        notes.append(f"{who(launch, rank)}: its test passed, but the rank ended ({how}) before its exit report: its "
                     "host figure is its resident high-water mark (VmHWM), not its peak of live allocations"
                     + (f"; last lines of its output:\n{log}" if log.strip() else ""))
    return notes
