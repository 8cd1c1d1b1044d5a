"""Runs one gpumem test: launch each world size, measure every rank, read what each rank said.

The nproc=1 reference that a ratio needs is launched once and reused by every later test with
the same launch parameters in this session (same test id in body mode; same program, args and
env in script mode).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config.spec import Spec
from ..judging.explain import config_provenance
from ..judging.verdict import FloorResult, SizeResult
from ..oneflow.boxing import read_records
from ..rankside import protocol
from ..rankside.rank import (
    GPU_IN_RANK_ENV,
    GPU_INTERVAL_ENV,
    HISTORY_ENV,
    PYTHON_ALLOCATIONS_ENV,
    ROOTDIR_ENV,
    SITES_ENV,
    SNAPSHOT_ENV,
    TRACK_ENV,
)
from ..sampling import AllocatedPeak, Peak, Sampler
from ..sampling.allocations import is_allocation_method
from ..sampling.host import HostSampler
from ..sampling.identity import platform_key, simulated_key
from ..sampling.sites import Site, from_dicts
from . import failures, slurm
from .floor import FRAMEWORKS
from .floor_cache import FloorCache, cache_key
from .gpus import GpuPlan, GpuPlanner
from .launch import DEFAULT_FAIL_FAST_GRACE_S, Launch, LaunchRequest, LaunchResult, describe_returncode
from .workdirs import make_workdir, sweep_orphans


@dataclass
class SizeRun:
    """One launch at one world size and everything learnt from it."""

    result: SizeResult
    launch: LaunchResult
    outcomes: dict[int, protocol.RankResult]
    problems: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    gpu_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    snapshots: dict[int, Path] = field(default_factory=dict)  # rank -> torch allocator snapshot
    boxings: list[dict] = field(default_factory=list)  # rank 0's nn.Graph SBP conversions

    @property
    def all_skipped(self) -> str | None:
        texts = {o.text for o in self.outcomes.values() if o.outcome == "skipped"}
        if self.outcomes and all(o.outcome == "skipped" for o in self.outcomes.values()):
            return "; ".join(sorted(texts))
        return None


@dataclass
class TestRun:
    test_id: str
    spec: Spec
    runs: list[SizeRun] = field(default_factory=list)
    skip_reason: str | None = None
    provenance: dict[str, str] = field(default_factory=dict)  # rank 0's view, newest launch
    predicted: list[SizeResult] = field(default_factory=list)  # sizes above the launch cap (scaling.py)
    unlaunched: dict[int, str] = field(default_factory=dict)  # sizes neither run nor predicted -> why

    @property
    def problems(self) -> list[str]:
        return [p for run in self.runs for p in run.problems]

    @property
    def results(self) -> list[SizeResult]:
        """Launched sizes, then the predicted ones (``result.predicted``)."""
        return [run.result for run in self.runs] + self.predicted


GpuSetup = Callable[[Spec, int, str], GpuPlan]
PORT_ATTEMPTS = 3  # launches of one size whose rendezvous port was lost before any test body started


class Runner:
    def __init__(
        self,
        *,
        cwd: Path,
        rootdir: Path,
        rank_pytest_args: Callable[[str], list[str]],
        gpu_setup: GpuSetup = GpuPlanner(None),
        host_interval_s: float | None = None,
        snapshot_dir: Path | None = None,
        floor: str = "auto",
        floor_cache: FloorCache | None = None,
        refresh_floors: bool | None = None,
        track_host: str = "auto",
        sites: str = "auto",
        gpu_history: bool = False,
        python_allocations: str = "objects",
        gpu_sampler: str = "parent",
        rank_env: Mapping[str, str] | None = None,
        slurm_options: slurm.SlurmOptions | None = None,
        start: str = "auto",
        start_refusal: str | None = None,
        fail_fast_grace: float = DEFAULT_FAIL_FAST_GRACE_S,
    ) -> None:
        self.cwd = cwd
        self.rootdir = rootdir
        self.rank_pytest_args = rank_pytest_args
        self.gpu_setup = gpu_setup
        self.host_interval_s = host_interval_s
        self.snapshot_dir = snapshot_dir
        self.rank_env = dict(rank_env or {})  # the session's rank-side switches; a marker's env wins
        self.slurm_options = slurm_options or slurm.SlurmOptions()
        self._references: dict[tuple, SizeRun] = {}
        self._swept = False
        self.floor = floor  # auto: floors of GPU figures; on: of every figure; off
        self.floor_cache = floor_cache  # None: floors are measured in every session
        # Measure even where the cache has the floor (and rewrite it): floor=on's meaning by default.
        self.refresh_floors = floor == "on" if refresh_floors is None else refresh_floors
        self.track_host = track_host  # auto | on | off: memray in each rank (see _tracks_host)
        self.sites = sites  # auto | on | off: peak sites (auto: GPU ones from a relaunch, see relaunch_for_sites)
        self.gpu_history = gpu_history or sites == "on"  # record torch's allocator history in every launch
        self.python_allocations = python_allocations  # objects | arenas: how the tracker counts Python's
        self.gpu_sampler = gpu_sampler  # "parent": NVML watched from pytest; "rank": each rank's own thread
        self._floors: dict[tuple, tuple[FloorResult | None, list[str]]] = {}
        self.simulated_gpus: int | None = None  # GPUs a simulated size's ranks share (None: host)
        self.start = start  # auto | fork | exec: how a direct launch starts its ranks (see _fork_refusal)
        self.start_refusal = start_refusal  # the session's reason never to fork (pytest's settings)
        self.fail_fast_grace = fail_fast_grace  # seconds the other ranks get once one failed

    def run(self, test_id: str, spec: Spec) -> TestRun:
        test = self._run(test_id, spec)
        if test.skip_reason is None and not test.problems:
            self._add_floors(test)
        for run in reversed(test.runs):
            if run.provenance:
                test.provenance = dict(run.provenance)
                break
        return test

    def _run(self, test_id: str, spec: Spec) -> TestRun:
        test = TestRun(test_id, spec)
        for nproc in spec.sizes:
            key = (test_id if spec.body_mode else None, spec.launch_key())
            reused = self._references.get(key) if nproc == 1 else None
            if reused is not None:
                run = SizeRun(
                    result=replace(reused.result, reused=True),
                    launch=reused.launch,
                    outcomes=reused.outcomes,
                    provenance=reused.provenance,
                )
            else:
                plan = self._plan(spec, nproc, test_id)
                if plan.skip_reason is not None:
                    test.skip_reason = plan.skip_reason
                    return test
                run = self._launch(test_id, spec, nproc, plan)
                if nproc == 1 and not run.problems and run.all_skipped is None:
                    self._references[key] = run
            test.runs.append(run)
            skipped = run.all_skipped
            if skipped is not None:
                test.skip_reason = skipped
                return test
            if run.problems:
                return test  # a broken launch says more than any memory figure
        return test

    def _add_floors(self, test: TestRun) -> None:
        """The floor of each figure that shows one (floor=auto: GPU figures; on: every figure): from
        this session, from the floor cache, or measured by an empty launch (once per framework,
        launcher, device, env and size). Looked up after the test's launch, which names the framework."""
        for run in test.runs:
            result = run.result
            if result.simulated:  # an empty job under a stand-in communicator measures no communicator
                continue
            if not (self.floor == "on" or (self.floor == "auto" and result.device == "gpu")):
                continue
            framework = next((f for f in FRAMEWORKS if f in run.provenance), None)
            if framework is None:
                continue
            probe = replace(test.spec, script=None, module="pytest_gpumem.launching.floor",
                            args=(framework, result.device), device=result.device, nproc=(result.world_size,))
            key = (framework, probe.launch_key(), result.world_size)
            if key not in self._floors:
                self._floors[key] = self._floor(test.test_id, probe, framework, run)
                run.notes.extend(self._floors[key][1])  # said once, on the run that looked it up
            floor = self._floors[key][0]
            if floor is None:
                run.notes.append(f"the {framework} floor at nproc={result.world_size} could not be measured")
                continue
            run.result = replace(result, floor=floor)

    def _floor(self, test_id: str, probe: Spec, framework: str, run: SizeRun) -> tuple[FloorResult | None, list[str]]:
        """(the floor, notes): the cached one unless refreshing; otherwise launched, then cached."""
        result, notes = run.result, []
        key = None if self.floor_cache is None else cache_key(
            device=result.device, platform=result.platform, world_size=result.world_size, method=result.methods,
            launch=probe.launch_key(), provenance=run.provenance)
        if self.floor_cache is not None and key is not None and not self.refresh_floors:
            cached, problem = self.floor_cache.get(key)
            notes += [problem] if problem else []
            if cached is not None and cached.framework == framework:
                return FloorResult(framework, cached.ranks, cached=cached.date), notes
        plan = self._plan(probe, result.world_size, f"{test_id} (floor)")
        measured = self._launch(test_id, probe, result.world_size, plan)
        ranks = {r: p.mib for r, p in measured.result.peaks.items() if p.mib is not None}
        if measured.problems:
            return None, notes
        if self.floor_cache is not None and key is not None and ranks:
            problem = self.floor_cache.put(key, framework, ranks)
            notes += [problem] if problem else []
        return FloorResult(framework, ranks), notes

    def _plan(self, spec: Spec, nproc: int, test_id: str) -> GpuPlan:
        if spec.launcher == "srun":  # Slurm binds the GPUs; the local leases are for local launches
            return slurm.plan(spec, nproc)
        return self.gpu_setup(spec, nproc, test_id)

    def _new_workdir(self, spec: Spec) -> Path:
        if spec.launcher == "srun":  # on a file system that every node sees
            return slurm.make_workdir(self.slurm_options)
        if not self._swept:  # once per session, at the first local launch: nothing paid when unused
            self._swept = True
            sweep_orphans()
        return make_workdir()  # private: mode 0700

    def _rank_argv(self, test_id: str, spec: Spec) -> tuple[str, ...]:
        if spec.script is not None:
            script = Path(spec.script)
            if not script.is_absolute():
                script = self.rootdir / script
            return ("script", str(script), *spec.args)
        if spec.module is not None:
            return ("module", spec.module, *spec.args)
        return ("pytest", *self.rank_pytest_args(test_id))

    def _tracks_host(self, spec: Spec, plan: GpuPlan) -> bool:
        """Whether the ranks track their host allocations (memray, the gated host figure).

        Decided before the launch: where GPUs are leased and the spec's device is not "cpu", the
        figure will be GPU memory, and the tracker (1.1-2x a launch's time: it hooks every Python
        call and every allocation) would measure a figure that is not gated. Those ranks keep NVML,
        and their VmHWM as information. ``track_host=on`` tracks everywhere, ``off`` nowhere; a
        marker's env (GPUMEM_TRACK_ALLOCATIONS) wins over both.
        """
        if self.track_host in ("on", "off"):
            return self.track_host == "on"
        return not (plan.sampler is not None and spec.device != "cpu")

    _EXEC_ASKED = "--gpumem-start=exec"
    _NOT_GPU = "not a GPU launch (auto forks those only)"
    _QUIET = (None, _EXEC_ASKED, _NOT_GPU)  # reasons the record does not repeat under start=auto

    def _fork_refusal(self, spec: Spec, plan: GpuPlan, env: Mapping[str, str]) -> str | None:
        """Why this launch's ranks are exec'd rather than forked from pytest (None: forked).

        auto forks GPU launches only: their figure is GPU memory, which a fork leaves as it is.
        What the process itself may forbid (CUDA or OneFlow in pytest, other threads) is checked
        by the launch, at the fork (``forking.refusal``).
        """
        if self.start == "exec":
            return self._EXEC_ASKED
        if self.start == "auto" and (plan.sampler is None or spec.device == "cpu"):
            return self._NOT_GPU
        if spec.launcher != "direct":
            return f"launcher={spec.launcher!r} starts the ranks itself"
        if not spec.body_mode:
            return "script= and module= run in a fresh interpreter"
        if env.get(TRACK_ENV) != "0":
            return "host allocations are tracked (the tracker must see the frameworks' imports)"
        if self._in_rank_gpu(spec, plan):
            return "each rank samples its own GPU (--gpumem-gpu-sampler=rank)"
        return self.start_refusal

    def _in_rank_gpu(self, spec: Spec, plan: GpuPlan) -> bool:
        return spec.launcher == "srun" or (plan.sampler is not None and self.gpu_sampler == "rank")

    def relaunch_for_sites(self, test: TestRun, sizes: set[int]) -> None:
        """Launch ``sizes`` again with torch's allocator history on and take their GPU peak sites.

        The history costs little while a job runs, but its first reading imports torch's compiler
        stack (~1 s a rank on an H200 for a job that has not), so by default it is not recorded in
        a passing run: a failing GPU size is relaunched once with it, and the failure names the
        relaunch and its figure beside the sites. Sizes that already have sites are left alone.
        """
        for run in test.runs:
            result = run.result
            if result.world_size not in sizes or result.device != "gpu" or result.sites or result.predicted:
                continue
            spec = replace(test.spec, launcher="direct") if result.simulated else test.spec
            processes = self._processes(result.world_size, result.simulated)
            plan = self._plan(spec, processes, f"{test.test_id} (peak sites)")
            if plan.skip_reason is not None:
                continue
            again = self._launch(test.test_id, spec, result.world_size, plan, history=True,
                                 simulated=result.simulated)
            rank = result.gated_rank(test.spec.rank)
            found = again.result.sites.get(rank) if rank is not None else None
            if again.problems or rank is None or not found:
                run.notes.append(f"the relaunch of nproc={result.world_size} for its peak sites gave none"
                                 + (f": {again.problems[0].splitlines()[0]}" if again.problems else ""))
                continue
            mib = again.result.read(test.spec.rank, "allocated")[1]
            figure = "" if mib is None else f"; its allocator figure {mib:.1f} MiB"
            run.result = replace(result, sites={**result.sites, rank: found}, sites_notes=result.sites_notes + (
                f"peak sites at nproc={result.world_size} from a relaunch with torch's allocator history on"
                f"{figure} (--gpumem-sites=on records it in every launch)",))

    def simulate(self, test_id: str, spec: Spec, world_size: int, ranks: tuple[int, ...], gpus: int | None) -> SizeRun:
        """Ranks ``ranks`` of a world of ``world_size`` that is not launched whole: each a real
        process with a stand-in communicator (``rankside.simulate``), all at once, sharing the
        ``gpus`` GPUs present (None: host memory). Its figures are keyed by the ranks they stand for."""
        self.simulated_gpus = gpus
        direct = replace(spec, launcher="direct")  # a launcher would start the whole world
        plan = self._plan(direct, self._processes(world_size, ranks), f"{test_id} (simulated nproc={world_size})")
        if plan.skip_reason is not None:
            return SizeRun(result=SizeResult(world_size, "gpu", {}, simulated=ranks),
                           launch=LaunchResult(world_size, "direct", []), outcomes={}, problems=[plan.skip_reason])
        return self._launch(test_id, direct, world_size, plan, simulated=ranks)

    def _processes(self, world_size: int, simulated: tuple[int, ...]) -> int:
        """GPUs a launch leases: one a rank, or for a simulated world those its ranks share."""
        if not simulated:
            return world_size
        return min(len(simulated), self.simulated_gpus) if self.simulated_gpus else len(simulated)

    def _launch(self, test_id: str, spec: Spec, nproc: int, plan: GpuPlan, history: bool = False,
                simulated: tuple[int, ...] = ()) -> SizeRun:
        """One launch at world size ``nproc``: all its ranks, or only the ``simulated`` ones."""
        if plan.error is not None:  # e.g. the GPUs stayed busy past the lease wait
            return SizeRun(result=SizeResult(nproc, "gpu", {}), launch=LaunchResult(nproc, spec.launcher, []),
                           outcomes={}, problems=[plan.error])
        lost: list[str] = []
        while True:
            try:
                workdir = self._new_workdir(spec)
            except OSError as exc:
                return SizeRun(result=SizeResult(nproc, "cpu", {}), launch=LaunchResult(nproc, spec.launcher, []),
                               outcomes={}, problems=[str(exc)])
            try:  # the folder goes whatever happens, Ctrl-C included
                run = self._launch_in(test_id, spec, nproc, plan, workdir, history, simulated)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            if run.launch.port_lost is None or len(lost) + 1 >= PORT_ATTEMPTS:
                break
            # Another program took the rendezvous port before any rank's test body started: the same
            # launch again on another port, with fresh samplers (the GPUs were released with it).
            lost.append(f"rendezvous port {run.launch.port} was taken by another program before any rank's "
                        f"test body started ({run.launch.port_lost}): relaunched on another port")
            plan = self._plan(spec, self._processes(nproc, simulated), test_id)
            if plan.skip_reason is not None or plan.error is not None:
                break
        run.notes = lost + run.notes
        return run

    def _launch_in(self, test_id: str, spec: Spec, world: int, plan: GpuPlan, workdir: Path,
                   history: bool = False, simulated: tuple[int, ...] = ()) -> SizeRun:
        nproc = len(simulated) or world  # processes
        host = HostSampler(self.host_interval_s) if self.host_interval_s else HostSampler()
        samplers: list[Sampler] = [host] + ([plan.sampler] if plan.sampler is not None else [])

        def on_rank(rank: int, pid: int) -> None:
            if spec.launcher == "srun":  # the PID is on the rank's own host: its exit report counts
                return
            for sampler in samplers:
                sampler.add_process(rank, pid)

        # Rank-side measurements: sites (named from the rootdir), torch's allocator history for GPU sites.
        side_env = {ROOTDIR_ENV: str(self.rootdir), SITES_ENV: "0" if self.sites == "off" else "1",
                    HISTORY_ENV: "1" if history or self.gpu_history else "0",
                    PYTHON_ALLOCATIONS_ENV: self.python_allocations}
        if self.snapshot_dir is not None:
            side_env[SNAPSHOT_ENV] = "1"
        if self._in_rank_gpu(spec, plan):  # ranks elsewhere (srun) or asked for: each samples its own GPU
            side_env[GPU_IN_RANK_ENV] = "1"
            if plan.sampler is not None:
                side_env[GPU_INTERVAL_ENV] = str(plan.sampler.interval_s)
        track = {TRACK_ENV: "1" if self._tracks_host(spec, plan) else "0"}  # a marker's env wins
        env = {**self.rank_env, **track, **nccl_defaults(plan.sampler is not None), **dict(spec.env), **plan.env,
               **side_env}
        refused = self._fork_refusal(spec, plan, env)
        request = LaunchRequest(
            launcher=spec.launcher,
            nproc=nproc,
            rank_argv=self._rank_argv(test_id, spec),
            env=env,
            cwd=self.cwd,
            workdir=workdir,
            timeout=spec.timeout,
            nnodes=spec.nnodes,
            start="exec" if refused else "fork",
            simulated=simulated,
            world_size=world,
            gpus=self.simulated_gpus or 1,
            fail_fast_grace=self.fail_fast_grace,
        )
        started_at = time.time()  # the ranks' own curves are in epoch seconds
        for sampler in samplers:
            sampler.start()
        try:
            launch = self._launcher(request, on_rank).run()
        finally:
            for sampler in samplers:
                sampler.stop()
            plan.release()
        run = self._read(spec, nproc, workdir, launch, host, plan, started_at)
        if simulated:
            run = _as_world(run, simulated, world)
        why = launch.start_refusal or (refused if refused not in self._QUIET or self.start == "fork" else None)
        run.result = replace(run.result, start=launch.start + (f" ({why})" if why else ""))
        if why and self.start == "fork":  # asked for: said in the report (auto falls back quietly; the record says)
            run.notes.append(f"ranks exec'd, not forked: {why}")
        run.notes = plan.notes + run.notes + [f"GPU sampler: {p}" for p in run.gpu_problems]
        if launch.port_note:
            run.notes.append(launch.port_note)
        run.snapshots = self._keep_snapshots(test_id, nproc, workdir)
        return run

    def _launcher(self, request: LaunchRequest, on_rank: Callable[[int, int], None]) -> Launch:
        if request.launcher == "srun":
            return slurm.SrunLaunch(request, on_rank, self.slurm_options)
        return Launch(request, on_rank)

    def _keep_snapshots(self, test_id: str, nproc: int, workdir: Path) -> dict[int, Path]:
        """Move each rank's torch allocator snapshot out of the launch folder before it goes."""
        if self.snapshot_dir is None:
            return {}
        kept = {}
        stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in test_id)
        for rank in range(nproc):
            source = protocol.rank_file(workdir, rank, "snapshot")
            if source.exists():
                self.snapshot_dir.mkdir(parents=True, exist_ok=True)
                target = self.snapshot_dir / f"{stem}-nproc{nproc}-rank{rank}.pickle"
                shutil.move(str(source), target)
                kept[rank] = target
        return kept

    def _read(self, spec: Spec, nproc: int, workdir: Path, launch: LaunchResult,
              host: HostSampler, plan: GpuPlan, started_at: float = 0.0) -> SizeRun:
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
        if self._in_rank_gpu(spec, plan):  # each rank's own figure, from its report
            gpu_peaks = {rank: Peak(mib, method) for rank, (mib, method, _) in in_rank_gpu.items()}
            gpu_name = gpu_name or next((name for _, _, name in in_rank_gpu.values() if name), None)
        use_gpu = spec.device == "gpu" or (
            spec.device == "auto" and any(p.mib is not None for p in gpu_peaks.values())
        )
        peaks = gpu_peaks if use_gpu else host_peaks
        if use_gpu:
            provenance.update(plan.provenance)
        elif self.track_host == "auto" and not self._tracks_host(spec, plan) and any(
                not is_allocation_method(p.method) for p in host_peaks.values()):
            notes.append("no rank was seen on its GPU, so the host figure is gated, but host allocations were not "
                         "tracked (GPUs were leased: a GPU figure was expected); it is the resident high-water "
                         'mark. device="cpu" or --gpumem-track-host=on gates the peak of live allocations')
        timeline = gpu.timeline() if use_gpu and gpu is not None else host.timeline()
        allocated, sites, live, site_notes = _rank_figures(reports, use_gpu, started_at)
        result = SizeResult(
            world_size=nproc,
            device="gpu" if use_gpu else "cpu",
            platform=platform_key("gpu", gpu_name or "unknown") if use_gpu else platform_key("cpu"),
            peaks={rank: peaks.get(rank, Peak(None, "not available")) for rank in range(nproc)},
            host_peaks=host_peaks,
            rss_peaks=host.rss_peaks(),
            timeline=tuple(timeline),
            duration_s=launch.duration_s,
            nodes=dict(launch.nodes),
            allocated=allocated,
            sites=sites,
            live_timeline=live,
            sites_notes=tuple(site_notes),
        )
        outcomes = self._outcomes(spec, nproc, launch, exited)
        run = SizeRun(result=result, launch=launch, outcomes=outcomes, provenance=provenance, notes=notes,
                      gpu_problems=list(getattr(gpu, "problems", []) or []),
                      boxings=[b for rec in read_records(protocol.rank_file(workdir, 0, "boxing"))
                               for b in rec.get("boxings", [])])
        run.problems = self._problems(spec, run, workdir)
        return run

    def _outcomes(self, spec: Spec, nproc: int, launch: LaunchResult,
                  exited: set[int]) -> dict[int, protocol.RankResult]:
        outcomes: dict[int, protocol.RankResult] = {}
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
                outcomes[rank] = protocol.RankResult("failed", _exit_text(launch, rank))
                continue
            outcomes[rank] = protocol.RankResult("missing", _exit_text(launch, rank))
        return outcomes

    def _problems(self, spec: Spec, run: SizeRun, workdir: Path) -> list[str]:
        return failures.problems(run.launch, run.outcomes, failures.LaunchContext(
            marker_env=dict(spec.env), cwd=self.cwd, workdir=workdir, timeout=spec.timeout,
            body_mode=spec.body_mode, fail_fast_grace=self.fail_fast_grace))


def _rank_figures(reports: dict[int, protocol.ExitReport], use_gpu: bool, started_at: float) -> tuple[
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
                                            str(found.get("framework", "torch")))
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
        for t, mib in curve:
            points.setdefault(round(float(t) - started_at, 4), {})[rank] = float(mib)
    return allocated, sites, tuple(sorted(points.items())), notes


# ProcessGroupNCCL keeps each collective's tensors until its watchdog thread sees the collective done,
# on the thread's own period: a tensor the job frees in between stays counted by the allocator for a
# while, so an unchanged DDP job's max_memory_allocated read 1601.28 or 1857.33 MiB between runs
# (benchmarks/gpu/ddp_nccl_spread.py). A blocking wait hands them back at the wait: the figure holds.
NCCL_DEFAULTS = {"TORCH_NCCL_BLOCKING_WAIT": "1"}


def nccl_defaults(gpu: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The GPU ranks' NCCL settings that make the allocator figure reproducible, unless the session
    sets them itself (a marker's env wins over both)."""
    return {k: v for k, v in NCCL_DEFAULTS.items() if gpu and k not in environ}


def _as_world(run: SizeRun, ranks: tuple[int, ...], world: int) -> SizeRun:
    """A simulated launch's figures, keyed by the ranks its processes stood for, at the world's size."""
    def keyed(values: Mapping[int, Any]) -> dict[int, Any]:
        return {ranks[slot]: value for slot, value in values.items() if slot < len(ranks)}

    def curve(points: tuple[tuple[float, Mapping[int, float]], ...]) -> tuple[tuple[float, Mapping[int, float]], ...]:
        return tuple((t, keyed(values)) for t, values in points)

    result = run.result
    run.result = replace(
        result, world_size=world, simulated=ranks, platform=simulated_key(result.platform),
        peaks=keyed(result.peaks), host_peaks=keyed(result.host_peaks),
        rss_peaks=keyed(result.rss_peaks), allocated=keyed(result.allocated), sites=keyed(result.sites),
        nodes=keyed(result.nodes), timeline=curve(result.timeline), live_timeline=curve(result.live_timeline))
    run.outcomes = {ranks[slot]: o for slot, o in run.outcomes.items() if slot < len(ranks)}
    who = ", ".join(f"process {slot} = rank {rank}" for slot, rank in enumerate(ranks))
    run.problems = [f"{p}\n(a simulated world of {world}: {who})" for p in run.problems]
    return run


def _exit_text(launch: LaunchResult, rank: int) -> str:
    if launch.launcher == "srun" and rank in launch.returncodes:  # the task shim saw the rank end
        return describe_returncode(launch.returncodes[rank])
    if launch.launcher == "direct":
        return describe_returncode(launch.returncodes.get(rank))
    return f"{launch.launcher} launcher {describe_returncode(launch.launcher_returncode)}"
