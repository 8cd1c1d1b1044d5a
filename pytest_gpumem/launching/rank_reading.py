"""What a launch's ranks left behind, read once after the launch: their exit reports and results,
the samplers' figures, each rank's outcome, and the failure text.

Every file is named and parsed by ``rankside.protocol``; this module decides what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.spec import Spec
from ..oneflow import conversions
from ..oneflow.boxing import read_records
from ..oneflow.cuda_on_cpu import PROVENANCE_KEY as CUDA_ON_CPU_KEY
from ..rankside import protocol
from ..results.provenance import config_provenance
from ..results.size import SizeResult
from ..sampling import AllocatedPeak, DeviceEstimate, Peak
from ..sampling.allocations import is_allocation_method
from ..sampling.host import HostSampler
from ..sampling.identity import platform_key
from ..sampling.sites import Site, from_dicts
from . import failures
from .gpus import GpuPlan
from .launched import SizeRun
from .launchers import Launcher
from .missing_figures import died_after_passing, missing_host_figures
from .rank_setup import nccl_defaults_note
from .supervise import LaunchResult


@dataclass(frozen=True)
class Reading:
    """What was decided before the launch that reading it needs."""

    in_rank_gpu: bool  # each rank sampled its own GPU: its figure is in its exit report
    untracked_host: bool  # track_host=auto left host allocations untracked: a GPU figure was expected
    context: failures.LaunchContext  # what the failure text needs besides the launch
    tracked_host: bool = False  # the ranks were asked to track host allocations: a host figure must be theirs


def read_size_run(spec: Spec, nproc: int, workdir: Path, launch: LaunchResult, host: HostSampler, plan: GpuPlan,
                  reading: Reading, started_at: float = 0.0) -> SizeRun:
    """The launch's size run: each rank's exit report and result, the samplers' figures, and what
    went wrong, read once after the launch."""
    gpu = plan.sampler
    provenance: dict[str, str] = {}
    notes: list[str] = []
    in_rank_gpu: dict[int, tuple[float | None, str, str | None]] = {}
    exited: set[int] = set()
    reports: dict[int, protocol.ExitReport] = {}
    for rank in range(nproc):
        report = protocol.read_exit(workdir, rank)
        if report is None:
            continue
        reports[rank] = report
        exited.add(rank)
        host.report_exit(rank, report.maxrss_kib, report.alloc_peak_mib, report.alloc_method)
        if report.gpu_method is not None:
            in_rank_gpu[rank] = (report.gpu_peak_mib, report.gpu_method, report.gpu_name)
            notes.extend(f"rank {rank} GPU sampler: {p}" for p in report.gpu_problems)
        if report.alloc_problem:
            notes.append(f"rank {rank}: {report.alloc_problem}; its host figure is resident memory")
        notes.extend(f"simulated world: {note}" for note in report.simulation if
                     f"simulated world: {note}" not in notes)
        if rank == 0:
            provenance = dict(report.provenance)
    # settings the test declared through the gpumem_config fixture
    provenance.update(config_provenance(protocol.read_config(workdir, 0)))
    host_peaks = host.peaks()
    gpu_peaks: dict[int, Peak] = gpu.peaks() if gpu is not None else {}
    gpu_name = plan.gpu_name
    if reading.in_rank_gpu:  # each rank's own figure, from its report
        gpu_peaks = {rank: Peak(mib, method) for rank, (mib, method, _) in in_rank_gpu.items()}
        gpu_name = gpu_name or next((name for _, _, name in in_rank_gpu.values() if name), None)
    use_gpu = spec.device == "gpu" or (
        spec.device == "auto" and any(p.mib is not None for p in gpu_peaks.values())
    )
    allocated, sites, live, site_notes = rank_figures(reports, use_gpu, started_at)
    if plan.fake_gpu:  # no device: the allocator figure stands for it (a lower bound of nvidia-smi's)
        gpu_peaks = {rank: Peak(a.mib, f"fake GPU {plan.fake_gpu}: the allocator figure")
                     for rank, a in allocated.items()}
    peaks = gpu_peaks if use_gpu else host_peaks
    missing = Peak(None, f"fake GPU {plan.fake_gpu}: the rank reported no allocator figure (it made no CUDA "
                         "tensor, or ended before its report)" if plan.fake_gpu and use_gpu else "not available")
    if use_gpu:
        provenance.update(plan.provenance)
        nccl_note = None if plan.fake_gpu else nccl_defaults_note(provenance, dict(spec.env))
        if nccl_note is not None:
            notes.append(nccl_note)
    elif reading.untracked_host and any(
            not is_allocation_method(p.method) for p in host_peaks.values()):
        notes.append("no rank was seen on its GPU, so the host figure is gated, but host allocations were not "
                     "tracked (GPUs were leased: a GPU figure was expected); it is the resident high-water "
                     'mark. device="cpu" or --gpumem-track-host=on gates the peak of live allocations')
    timeline = gpu.timeline() if use_gpu and gpu is not None else host.timeline()
    result = SizeResult(
        world_size=nproc,
        device="gpu" if use_gpu else "cpu",
        platform=platform_key("gpu", gpu_name or "unknown") if use_gpu else platform_key("cpu"),
        peaks={rank: peaks.get(rank, missing) for rank in range(nproc)},
        host_peaks=host_peaks,
        rss_peaks=host.rss_peaks(),
        timeline=tuple(timeline),
        duration_s=launch.duration_s,
        nodes=dict(launch.nodes),
        allocated=allocated,
        sites=sites,
        live_timeline=live,
        sites_notes=tuple(site_notes),
        fake_gpu=plan.fake_gpu or "",
        uncounted=tuple(dict.fromkeys(part for report in reports.values() for part in report.uncounted)),
        cuda_on_cpu=provenance.get(CUDA_ON_CPU_KEY, ""),
        supplied=tuple(dict.fromkeys(line for report in reports.values()
                                     for line in (report.gpu_allocator or {}).get("fake_gpu", {}).get("supplied", []))),
    )
    outcomes = rank_outcomes(spec, nproc, launch, exited, reading.context.launcher)
    graphs = read_records(protocol.rank_file(workdir, 0, "boxing"))
    run = SizeRun(result=result, launch=launch, outcomes=outcomes, provenance=provenance, notes=notes,
                  gpu_problems=list(getattr(gpu, "problems", []) or []),
                  boxings=[b for rec in graphs for b in rec.get("boxings", [])],
                  graph_inputs=[i for rec in graphs for i in rec.get("inputs", [])])
    run.eager, run.eager_problem = conversions.read(protocol.rank_file(workdir, 0, "eager"))
    run.startups = {rank: (float(r.alloc_startup[0]), float(r.alloc_startup[1])) for rank, r in reports.items()
                    if isinstance(r.alloc_startup, list) and len(r.alloc_startup) == 2}
    for report in reports.values():
        run.startup_files.update(report.startup_files)
    run.problems = failures.problems(run.launch, run.outcomes, reading.context)
    if reading.tracked_host and not use_gpu:  # never gated on VmHWM for a rank that ended well
        run.problems += missing_host_figures(nproc, workdir, launch, run.outcomes, reports, host_peaks)
        run.notes += died_after_passing(nproc, workdir, launch, run.outcomes, host_peaks)
    return run


def rank_outcomes(spec: Spec, nproc: int, launch: LaunchResult, exited: set[int],
                  chosen: Launcher) -> dict[int, protocol.RankResult]:
    """Each rank's result: the one it wrote (a test body), else what its exit says as ``chosen``, the
    launcher that started it, tells it (``exited``: it wrote its exit report); ``missing`` where neither tells."""
    outcomes: dict[int, protocol.RankResult] = {}
    exit_text = chosen.exit_text
    for rank in range(nproc):
        code = launch.returncodes.get(rank)
        reported = launch.results.get(rank)  # read by the launch, once
        if spec.body_mode:
            if reported is not None:
                outcomes[rank] = reported
                continue
        elif rank in exited and code in (None, 0) and launch.launcher_returncode in (None, 0):
            outcomes[rank] = protocol.RankResult("passed")
            continue
        elif rank in exited and (code or launch.launcher_returncode):
            outcomes[rank] = protocol.RankResult("failed", exit_text(launch, rank))
            continue
        outcomes[rank] = protocol.RankResult("missing", exit_text(launch, rank))
    return outcomes


def device_estimate(raw: Any) -> DeviceEstimate | None:
    """A fake GPU's predicted device figure as its rank reported it (``rankside.fakegpu.device``)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("parts_mib"), dict):
        return None
    parts = tuple((str(k), float(v)) for k, v in raw["parts_mib"].items() if isinstance(v, (int, float)))
    return DeviceEstimate(parts, str(raw.get("gpu", "")), float(raw.get("capacity_mib") or 0.0))


def rank_figures(reports: dict[int, protocol.ExitReport], use_gpu: bool, started_at: float) -> tuple[
        dict[int, AllocatedPeak], dict[int, tuple[Site, ...]], tuple[tuple[float, dict[int, float]], ...], list[str]]:
    """What each rank measured of itself: its allocator figure (GPU), the sites live at the peak of
    the gated figure, and that figure's live curve (seconds since the launch started)."""
    allocated: dict[int, AllocatedPeak] = {}
    sites: dict[int, tuple[Site, ...]] = {}
    curves: dict[int, list[list[float]]] = {}
    notes: list[str] = []
    for rank, report in sorted(reports.items()):
        found = report.gpu_allocator or {}
        if use_gpu and isinstance(found.get("allocated_mib"), (int, float)):
            reserved = found.get("reserved_mib")
            allocated[rank] = AllocatedPeak(float(found["allocated_mib"]),
                                            float(reserved) if isinstance(reserved, (int, float)) else None,
                                            str(found.get("framework", "torch")),
                                            device_estimate((found.get("fake_gpu") or {}).get("device")))
        raw_sites, curve, problem = ((found.get("sites") or [], found.get("timeline") or [], found.get("sites_problem"))
                                     if use_gpu else (report.alloc_sites, report.alloc_timeline, report.sites_problem))
        if raw_sites:
            sites[rank] = tuple(from_dicts(raw_sites))
        if curve:
            curves[rank] = curve
        if problem and rank == 0:
            notes.append(f"rank {rank} peak sites: {problem}")
    points: dict[float, dict[int, float]] = {}
    for rank, curve in curves.items():
        for t, mib in curve:  # points within 0.1 ms are one: the highest, so a curve reaches its peak
            at = points.setdefault(round(float(t) - started_at, 4), {})
            at[rank] = max(at.get(rank, float(mib)), float(mib))
    return allocated, sites, tuple(sorted(points.items())), notes
