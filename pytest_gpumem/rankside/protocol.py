"""What a rank and its parent exchange: files in the launch folder, named, written and read here.

Every rank writes ``rank-<r>.<kind>`` files into the launch's folder (a private temp folder, or a
folder every node sees under Slurm); the parent reads them after (or, for ``hello`` and
``result``, during) the launch. JSON files are written whole and renamed into place, so a reader
sees a file complete or not at all, and each is parsed once.

=========  ==========================  ==============================================
kind       written by                  read by
=========  ==========================  ==============================================
hello      the rank, at start          the launcher (the rank's pid, to watch it)
log        the rank (stdout, stderr)   the driver (tail of a failing rank's output)
stack      faulthandler, on SIGUSR1    the launcher, when a launch times out
exit       the rank, last at exit      the driver (peaks, provenance): :class:`ExitReport`
result     the rank's pytest           the launcher (fail fast) and the driver: :class:`RankResult`;
                                       a failure as soon as pytest reports it (before the fixtures'
                                       teardown), any other outcome when the rank's pytest ends
body       the rank's pytest, as the   the launcher: a launch whose rendezvous port was lost is
           test body starts            relaunched only while no rank has started its body
config     the ``gpumem_config`` call  the driver (declared settings, for provenance)
boxing     the nn.Graph audit          the driver (``boxing.read_records``)
eager      the eager global audit      the driver (``conversions.read``)
glog       OneFlow's glog folder, set  the rank's eager audit (its boxing logger's INFO lines)
           unless the job chose one
snapshot   torch's allocator           the driver (moved out before the folder goes)
memray     the allocation tracker      the rank itself (read back at exit, then removed)
task       the srun shim on a node     the srun launcher (node, pid, exit status)
=========  ==========================  ==============================================
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

Kind = Literal["hello", "log", "stack", "exit", "result", "body", "config", "boxing", "eager", "glog", "snapshot",
               "memray", "task"]


def rank_file(workdir: Path, rank: int, kind: Kind) -> Path:
    return workdir / f"rank-{rank}.{kind}"


def write_json_atomic(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(workdir: Path, rank: int, kind: Kind) -> Any:
    """The parsed file, or None when it is absent or unreadable (a rank that died before writing it)."""
    try:
        return json.loads(rank_file(workdir, rank, kind).read_text())
    except (OSError, ValueError):
        return None


def read_tail(workdir: Path, rank: int, kind: Kind) -> str:
    try:
        return rank_file(workdir, rank, kind).read_text(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------- hello


def write_hello(workdir: Path, rank: int) -> None:
    write_json_atomic(rank_file(workdir, rank, "hello"), {"pid": os.getpid()})


def read_hello_pid(workdir: Path, rank: int) -> int | None:
    data = read_json(workdir, rank, "hello")
    return int(data["pid"]) if isinstance(data, dict) and "pid" in data else None


# ----------------------------------------------------------------------------------------- exit


@dataclass(frozen=True)
class ExitReport:
    """What a rank says of itself as it ends: its peaks (host, and GPU when it sampled its own) and
    the provenance of the run (framework versions, env knobs, boxing audit)."""

    pid: int
    maxrss_kib: float | None = None  # VmHWM: information
    alloc_peak_mib: float | None = None  # the gated host figure
    alloc_method: str = ""
    alloc_problem: str | None = None
    gpu_peak_mib: float | None = None  # only when the rank sampled its own GPU
    gpu_method: str | None = None
    gpu_name: str | None = None
    gpu_problems: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    alloc_sites: list[dict[str, Any]] = field(default_factory=list)  # host sites live at the peak
    alloc_timeline: list[list[float]] = field(default_factory=list)  # [epoch s, MiB live], thinned
    sites_problem: str | None = None
    # torch's CUDA allocator (rankside.gpu_allocator): framework, allocated_mib, reserved_mib,
    # devices, and with history: sites, timeline, sites_problem, problems
    gpu_allocator: dict[str, Any] = field(default_factory=dict)
    simulation: list[str] = field(default_factory=list)  # a simulated rank: what its stand-in did (notes)
    uncounted: list[str] = field(default_factory=list)  # a simulated rank: what it did not run (simulate.uncounted)
    alloc_startup: list[float] | None = None  # [live, peak] MiB of the start-up, where this rank measured it
    startup_files: dict[str, str] = field(default_factory=dict)  # rootdir files it imported -> SHA-256


def write_exit(workdir: Path, rank: int, report: ExitReport) -> None:
    write_json_atomic(rank_file(workdir, rank, "exit"), asdict(report))


def read_exit(workdir: Path, rank: int) -> ExitReport | None:
    data = read_json(workdir, rank, "exit")
    if not isinstance(data, dict) or "pid" not in data:
        return None
    known = ExitReport.__dataclass_fields__
    return ExitReport(**{k: v for k, v in data.items() if k in known})


# --------------------------------------------------------------------------------------- result


# A rank's test, as its pytest reported it; "missing": the rank wrote no result (the parent's word).
RankState = Literal["passed", "failed", "skipped", "missing"]


@dataclass(frozen=True)
class RankResult:
    """The outcome of the test in one rank: what its pytest wrote as the ``result`` file, or what the
    parent made of a rank that wrote none (``missing``; without a body, ``passed`` or ``failed`` by
    its exit status)."""

    outcome: RankState
    text: str = ""  # pytest's report of the rank's failure (or the skip reason, or its exit status)
    error: str = ""  # the failure in one line, as pytest's short summary gives it: "RuntimeError: boom"


def write_result(workdir: Path, rank: int, result: RankResult) -> None:
    write_json_atomic(rank_file(workdir, rank, "result"), asdict(result))


def read_result(workdir: Path, rank: int) -> RankResult | None:
    data = read_json(workdir, rank, "result")
    if not isinstance(data, dict) or "outcome" not in data:
        return None
    return RankResult(cast(RankState, str(data["outcome"])), str(data.get("text", "")), str(data.get("error", "")))


# ----------------------------------------------------------------------------------------- body


def write_body_started(workdir: Path, rank: int) -> None:
    rank_file(workdir, rank, "body").touch(mode=0o600)


def body_started(workdir: Path, rank: int) -> bool:
    return rank_file(workdir, rank, "body").exists()


# --------------------------------------------------------------------------------------- config


def update_config(workdir: Path, rank: int, settings: dict[str, object]) -> None:
    path = rank_file(workdir, rank, "config")
    current = read_json(workdir, rank, "config") or {}
    current.update({str(k): v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
                    for k, v in settings.items()})
    write_json_atomic(path, current)


def read_config(workdir: Path, rank: int) -> dict[str, object]:
    data = read_json(workdir, rank, "config")
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------------------------------------- task


def write_task(workdir: Path, rank: int, facts: dict[str, Any]) -> None:
    write_json_atomic(rank_file(workdir, rank, "task"), facts)


def read_task(workdir: Path, rank: int) -> dict[str, Any] | None:
    data = read_json(workdir, rank, "task")
    return data if isinstance(data, dict) else None
