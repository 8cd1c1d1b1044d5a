"""What went wrong in a launch, in the order it happened: the text of a failed gpumem test.

The first rank that failed comes first (its exception, its exit status or signal, or its stack when
it hung), then the other ranks that failed on their own, in the order they did; ranks the plugin
itself ended (fail fast) come last, labelled as such, never as failures of their own, with where
each was when it was stopped. The first
line is what pytest's short summary shows: it names the rank and its error.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..config.settings import DEFAULT_FAIL_FAST_GRACE_S
from ..rankside import protocol
from ..rankside.protocol import RankResult
from .framework_errors import framework_message
from .launchers import Launcher
from .supervise import LaunchResult

_LAUNCHER_LOG_LINES = 40
_NOT_IMPORTABLE = "No module named 'pytest_gpumem"
# What torch says when a job asks for CUDA where there is none: a CPU build's missing bindings
# (torch._C._cuda_setDevice, _cuda_getDeviceCount, ...), a CUDA build without a driver or a device.
_NO_CUDA = ("module 'torch._C' has no attribute '_cuda_", "Torch not compiled with CUDA enabled",
            "Found no NVIDIA driver", "No CUDA GPUs are available")
CUDA_HINT = ('hint: this job uses CUDA and this machine has no GPU: mark it device="gpu" and it runs on a '
             "fake GPU (every CUDA tensor fake, the allocator's figure gated; docs/fake-gpu.md)")


def who(launch: LaunchResult, rank: int) -> str:
    """``rank 2 of 4``, and ``(node n2)`` where the ranks ran on several nodes; in a simulated world
    the rank a process stood for: ``rank 5 of 8 (simulated)``, not its place in the launch."""
    if launch.simulated and rank < len(launch.simulated):
        return f"rank {launch.simulated[rank]} of {launch.world_size} (simulated)"
    node = launch.nodes.get(rank)
    return f"rank {rank} of {launch.nproc}" + (f" (node {node})" if node else "")


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True)
class LaunchContext:
    """What the failure text needs besides the launch: the launcher that started it, the marker's env (a
    PYTHONPATH there is the user's), the ranks' folder, their interpreter, the launch's folder, its timeout."""

    launcher: Launcher
    marker_env: Mapping[str, str]
    cwd: Path
    workdir: Path
    timeout: float
    body_mode: bool
    python: str = sys.executable
    fail_fast_grace: float = DEFAULT_FAIL_FAST_GRACE_S
    without_gpu: bool = False  # device="auto" on a machine with no GPU: a CUDA error gets CUDA_HINT


def problems(launch: LaunchResult, outcomes: Mapping[int, RankResult], ctx: LaunchContext) -> list[str]:
    """Every problem of one launch, the first failure first (see the module's docstring)."""
    failures: list[tuple[float, int, str]] = []
    stopped: list[int] = []
    shown_launcher_log = False
    for rank, outcome in sorted(outcomes.items()):
        if outcome.outcome not in ("failed", "missing"):
            continue
        alive_at_end = rank in launch.stopped and outcome.outcome == "missing"
        if alive_at_end and launch.end == "fail-fast":
            stopped.append(rank)
            continue
        if alive_at_end and launch.timed_out:
            failures.append((launch.duration_s, rank, _hung(launch, rank, ctx)))
            continue
        when = min(launch.failed_at.get(rank, math.inf), launch.ended_at.get(rank, math.inf))
        text, used_launcher_log = _failed(launch, rank, outcome, ctx, shown_launcher_log)
        shown_launcher_log |= used_launcher_log
        if rank in launch.stopped and launch.end == "fail-fast":  # it failed, then did not end by itself
            text += (f"\n{who(launch, rank)} was still running {ctx.fail_fast_grace:g} s after the first failure: "
                     f"stopped by pytest-gpumem ({_how_stopped(launch, rank)})" + _stack(launch, rank, "when stopped"))
        failures.append((when, rank, text))
    failures.sort(key=lambda item: (item[0], item[1]))
    found = [text for _, _, text in failures]
    if launch.timed_out and not any(rank in launch.stopped for _, rank, _ in failures):
        found.insert(0, _timed_out(launch, ctx))
    if stopped:
        first = f"rank {failures[0][1]}" if failures else "another rank"
        found.extend(f"{who(launch, rank)}: stopped by pytest-gpumem after {first} failed "
                     f"({_how_stopped(launch, rank)})" + _stack(launch, rank, "when stopped") for rank in stopped)
    if launch.leftovers:
        found.append(f"processes of the launch still alive after SIGKILL: {launch.leftovers}")
    found.extend(launch.problems)
    if found and not ctx.launcher.per_rank and not shown_launcher_log:
        log = _tail(ctx.workdir / "launcher.log", 15)
        if log:
            found.append(f"{ctx.launcher.name} launcher output (last lines):\n{log}")
    return found


def _stack(launch: LaunchResult, rank: int, when: str) -> str:
    stack = launch.stacks.get(rank, "").rstrip()
    return f"\n--- rank {rank} Python stack {when} ---\n{stack}" if stack else ""


def _how_stopped(launch: LaunchResult, rank: int) -> str:
    if launch.returncodes.get(rank) == -signal.SIGKILL:
        return "SIGTERM, then SIGKILL 3 s later"
    return "SIGTERM"


def _timed_out(launch: LaunchResult, ctx: LaunchContext) -> str:
    """A timeout no rank is to blame for by name: none had announced itself, or every one had
    reported its result and still ran (stuck on its way out)."""
    running = sorted(launch.stopped)
    text = (f"launch timed out after {ctx.timeout:g} s at nproc={launch.nproc} (launcher {ctx.launcher.name}); "
            + (f"ranks still running after their result: {running}" if running
               else "no rank had started the plugin's rank code"))
    for rank, stack in sorted(launch.stacks.items()):
        text += f"\n--- rank {rank} Python stack when the timeout hit ---\n{stack.rstrip()}"
    return text


def _hung(launch: LaunchResult, rank: int, ctx: LaunchContext) -> str:
    text = (f"{who(launch, rank)} hung: no result when the launch timed out after {ctx.timeout:g} s "
            f"at nproc={launch.nproc} (launcher {ctx.launcher.name})")
    stack = launch.stacks.get(rank)
    if stack:
        text += f"\n--- rank {rank} Python stack when the timeout hit ---\n{stack.rstrip()}"
    return text


def _failed(launch: LaunchResult, rank: int, outcome: RankResult, ctx: LaunchContext,
            launcher_shown: bool = False) -> tuple[str, bool]:
    """The text of one rank that failed or ended without a result; and whether it shows the
    launcher's output (shown once: with the first rank that left no log of its own)."""
    cause = _framework_cause(launch, rank, ctx.workdir)  # the C++ check that aborted it, first
    if outcome.outcome == "failed" and ctx.body_mode:  # the text is the rank's pytest report
        error = (f" {cause};" if cause else "") + (f" {outcome.error}" if outcome.error else "")
        hint = f"\n{CUDA_HINT}" if ctx.without_gpu and _needs_cuda(outcome.text) else ""
        return f"{who(launch, rank)} failed:{error}{hint}\n{outcome.text.rstrip()}", False
    head = (f"{who(launch, rank)} failed ({outcome.text})" if outcome.outcome == "failed"
            else f"{who(launch, rank)} ended without a result ({outcome.text})") + (f": {cause}" if cause else "")
    started = rank in launch.pids  # it announced itself: the plugin's rank code ran
    if not started:
        head += " before the plugin's rank code started"
    tail = launch.rank_log(ctx.workdir, rank)
    from_launcher = False
    if not tail and not ctx.launcher.per_rank:  # the rank never opened its own log
        if launcher_shown:
            return head + "; it left no log of its own (the launcher's output is above)", False
        tail = _tail(ctx.workdir / "launcher.log", _LAUNCHER_LOG_LINES)
        from_launcher = bool(tail)
    if tail:
        head += ("; last lines of the launcher's output (the rank left no log of its own):\n" if from_launcher
                 else "; last lines of its output:\n") + tail
    hint = import_hint(tail, launch.pythonpath, ctx) if not started else ""
    if ctx.without_gpu and _needs_cuda(tail):
        hint = CUDA_HINT
    return head + (f"\n{hint}" if hint else ""), from_launcher


def _framework_cause(launch: LaunchResult, rank: int, workdir: Path) -> str:
    """The C++ check that aborted a rank, from its output or, where glog writes to files (OneFlow
    in a rank: the launch's folder), from its FATAL file, named by the rank's pid."""
    texts = [protocol.read_tail(workdir, rank, "log")]
    pid = launch.pids.get(rank)
    if pid is not None:
        texts += [_tail(path, 200) for path in sorted(workdir.rglob(f"*.log.FATAL.*.{pid}"))]
    return framework_message("\n".join(texts))


def _needs_cuda(output: str) -> bool:
    return any(text in output for text in _NO_CUDA)


def import_hint(output: str, pythonpath: str | None, ctx: LaunchContext) -> str:
    """One sentence when a rank's output shows it could not import the plugin: with which
    PYTHONPATH, set by whom, and what to do."""
    if _NOT_IMPORTABLE not in output:
        return ""
    given = ctx.marker_env.get("PYTHONPATH")
    relative = [e for e in (given or "").split(os.pathsep) if not os.path.isabs(e)] if given is not None else []
    if given is not None:
        where = (f"PYTHONPATH={given!r}, which the marker's env= sets in place of the session's"
                 + (f" (its relative entries {', '.join(map(repr, relative))} are read from the ranks' "
                    f"folder {ctx.cwd})" if relative else ""))
    elif pythonpath:
        where = f"PYTHONPATH={pythonpath!r} (the session's, relative entries made absolute)"
    else:
        where = "no PYTHONPATH"
    return (f"hint: the rank could not import pytest_gpumem with {where}: install the plugin into "
            f"{ctx.python}, which runs the ranks, or put the folder that holds pytest_gpumem on that "
            f"PYTHONPATH as an absolute path")
