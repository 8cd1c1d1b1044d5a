"""One launch of one world size: its folder, its samplers, the request to its launcher, the ranks'
files read back, their snapshots kept; a relaunch on another port where the rendezvous port was
lost before any test body started. :class:`~.driver.TestDriver` decides what to launch; this runs it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config.env_names import STARTUP_ENV, TRACK_ENV
from ..config.settings import DEFAULT_FAIL_FAST_GRACE_S
from ..config.spec import Spec
from ..rankside import protocol
from ..results.size import LINES, PER_RANK, SizeResult
from ..sampling import Sampler
from ..sampling.host import HostSampler
from ..sampling.identity import simulated_key
from . import failures
from .gpus import GpuPlan
from .launched import SizeRun
from .launchers import Launcher, LauncherOptions, launcher
from .missing_figures import tracking_asked
from .rank_reading import Reading, read_size_run
from .rank_setup import RankSetup
from .supervise import LaunchRequest, LaunchResult
from .watch import Follower, Watch, what
from .workdirs import make_workdir, sweep_orphans

GpuSetup = Callable[[Spec, int, str], GpuPlan]
PORT_ATTEMPTS = 3  # launches of one size whose rendezvous port was lost before any test body started


class SizeLaunch:
    """What every launch of a session shares: where the ranks run, their setup, the GPUs' source,
    the launcher's options, the fail-fast grace, the snapshot folder."""

    def __init__(self, *, cwd: Path, setup: RankSetup, gpu_setup: GpuSetup, host_interval_s: float | None = None,
                 snapshot_dir: Path | None = None, launcher_options: LauncherOptions | None = None,
                 fail_fast_grace: float = DEFAULT_FAIL_FAST_GRACE_S, fake_gpus: GpuSetup | None = None,
                 watch: Watch | None = None) -> None:
        self.cwd = cwd
        self.watch = watch or Watch()  # where the launches' progress and rank 0's output go
        self.setup = setup
        self.gpu_setup = gpu_setup
        self.host_interval_s = host_interval_s
        self.snapshot_dir = snapshot_dir
        self.launcher_options = launcher_options or LauncherOptions()
        self.fail_fast_grace = fail_fast_grace  # seconds the other ranks get once one failed
        self.fake_gpus = fake_gpus  # a fake GPU's launches (launching.gpus.FakeGpus); None: none here
        self.simulated_gpus: int | None = None  # GPUs a simulated size's ranks share (None: host)
        self._swept = False

    def plan(self, spec: Spec, nproc: int, test_id: str, fake: bool = False) -> tuple[Launcher, GpuPlan]:
        """Where a size starts: its launcher (the marker's name looked up here, once, and the object
        handed down) and its GPUs."""
        chosen = launcher(spec.launcher)
        return chosen, self._gpus(spec, chosen, nproc, test_id, fake)

    def _gpus(self, spec: Spec, chosen: Launcher, nproc: int, test_id: str, fake: bool = False) -> GpuPlan:
        """The launch's GPUs: the launcher's own, leased here, or a fake GPU's."""
        if fake:
            if self.fake_gpus is None:
                return GpuPlan(skip_reason="a fake GPU was asked for, but this session has none set up")
            return self.fake_gpus(spec, nproc, test_id)
        own = chosen.plan(spec, nproc)  # e.g. srun: Slurm binds the GPUs
        return own if own is not None else self.gpu_setup(spec, nproc, test_id)

    def _new_workdir(self, chosen: Launcher) -> Path:
        shared = chosen.workdir(self.launcher_options)  # e.g. srun: one every node sees
        if shared is not None:
            return shared
        if not self._swept:  # once per session, at the first local launch: nothing paid when unused
            self._swept = True
            sweep_orphans()
        return make_workdir()  # private: mode 0700

    def processes(self, world_size: int, simulated: tuple[int, ...]) -> int:
        """GPUs a launch leases: one a rank, or for a simulated world those its ranks share."""
        if not simulated:
            return world_size
        return min(len(simulated), self.simulated_gpus) if self.simulated_gpus else len(simulated)

    def launch(self, test_id: str, spec: Spec, chosen: Launcher, nproc: int, plan: GpuPlan, *, history: bool = False,
               simulated: tuple[int, ...] = (), startup: str = "", label: str = "") -> SizeRun:
        """One launch at world size ``nproc`` by ``chosen`` (``plan``'s launcher): all its ranks, or only
        the ``simulated`` ones, each given ``startup`` as its ``GPUMEM_STARTUP``; relaunched on another
        port where the rendezvous port was lost before any test body started. ``label`` names a launch
        that is not the test's own measurement in its progress line ("floor", "start-up probe", "peak sites")."""
        if plan.error is not None:  # e.g. the GPUs stayed busy past the lease wait
            return SizeRun(result=SizeResult(nproc, "gpu", {}), launch=LaunchResult(nproc, []),
                           outcomes={}, problems=[plan.error])
        lost: list[str] = []
        while True:
            try:
                workdir = self._new_workdir(chosen)
            except OSError as exc:
                return SizeRun(result=SizeResult(nproc, "cpu", {}), launch=LaunchResult(nproc, []),
                               outcomes={}, problems=[str(exc)])
            try:  # the folder goes whatever happens, Ctrl-C included
                run = self._watched(test_id, label, spec, chosen, nproc, plan, workdir, history, simulated, startup)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            if run.launch.port_lost is None or len(lost) + 1 >= PORT_ATTEMPTS:
                break
            # Another program took the rendezvous port before any rank's test body started: the same
            # launch again on another port, with fresh samplers (the GPUs were released with it).
            lost.append(f"rendezvous port {run.launch.port} was taken by another program before any rank's "
                        f"test body started ({run.launch.port_lost}): relaunched on another port")
            plan = self._gpus(spec, chosen, self.processes(nproc, simulated), test_id)
            if plan.skip_reason is not None or plan.error is not None:
                break
        run.notes = lost + run.notes
        return run

    def _watched(self, test_id: str, label: str, spec: Spec, chosen: Launcher, world: int, plan: GpuPlan,
                 workdir: Path, history: bool, simulated: tuple[int, ...], startup: str) -> SizeRun:
        """``_launch_in``, said as it starts and ends (``Watch.progress``), and for the test's own
        launch (no ``label``) rank 0's output followed while it runs (``Watch.echo``)."""
        said = f"gpumem: {test_id}{f' {label}' if label else ''} {what(world, simulated, plan.fake_gpu)}"
        progress, echo = self.watch.progress, None if label else self.watch.echo
        running = self.watch.running
        if progress is not None:
            progress(f"{said}: launching")
        elif running is not None:
            running(f"gpumem {label + ' ' if label else ''}{what(world, simulated, plan.fake_gpu)}")
        started = time.perf_counter()
        try:
            if echo is None:
                run = self._launch_in(test_id, spec, chosen, world, plan, workdir, history, simulated, startup)
            else:
                rank = simulated[0] if simulated else 0
                with Follower(protocol.rank_file(workdir, 0, "log"), echo, f"[rank {rank}] "):
                    run = self._launch_in(test_id, spec, chosen, world, plan, workdir, history, simulated, startup)
        finally:  # erased whatever ends the launch, Ctrl-C included
            if running is not None:
                running("")
        if progress is not None:
            failed = run.problems or any(o.outcome == "failed" for o in run.outcomes.values())
            how = "ended" if startup == "probe" else "failed" if failed else "done"  # a probe ends at its setup
            progress(f"{said}: {how} in {time.perf_counter() - started:.1f} s")
        return run

    def _launch_in(self, test_id: str, spec: Spec, chosen: Launcher, world: int, plan: GpuPlan, workdir: Path,
                   history: bool, simulated: tuple[int, ...], startup: str) -> SizeRun:
        nproc = len(simulated) or world  # processes
        host = HostSampler(self.host_interval_s) if self.host_interval_s else HostSampler()
        samplers: list[Sampler] = [host] + ([plan.sampler] if plan.sampler is not None else [])
        remote = chosen.remote

        def on_rank(rank: int, pid: int) -> None:
            if remote:  # the PID is on the rank's own host: its exit report counts
                return
            for sampler in samplers:
                sampler.add_process(rank, pid)

        env = {**self.setup.env(spec, chosen, plan, history), STARTUP_ENV: startup}
        refused = self.setup.fork_refusal(spec, chosen, plan, env)
        request = LaunchRequest(
            nproc=nproc,
            rank_argv=self.setup.argv(test_id, spec),
            env=env,
            cwd=self.cwd,
            workdir=workdir,
            timeout=spec.timeout,
            nnodes=spec.nnodes,
            start="exec" if refused else "serve" if plan.fake_gpu else "fork",
            simulated=simulated,
            world_size=world,
            gpus=self.processes(world, simulated),  # the GPUs leased, which LOCAL_RANK indexes
            fail_fast_grace=self.fail_fast_grace,
        )
        started_at = time.time()  # the ranks' own curves are in epoch seconds
        for sampler in samplers:
            sampler.start()
        try:
            launch = chosen.start(request, on_rank, self.launcher_options).run()
        finally:
            for sampler in samplers:
                sampler.stop()
            plan.release()
        reading = Reading(
            in_rank_gpu=self.setup.in_rank_gpu(chosen, plan),
            untracked_host=self.setup.track_host == "auto" and not self.setup.tracks_host(spec, plan),
            tracked_host=tracking_asked(env, TRACK_ENV),
            context=failures.LaunchContext(launcher=chosen, marker_env=dict(spec.env), cwd=self.cwd, workdir=workdir,
                                           timeout=spec.timeout, body_mode=spec.body_mode,
                                           fail_fast_grace=self.fail_fast_grace,
                                           without_gpu=spec.device == "auto" and plan.gpu_name is None))
        run = read_size_run(spec, nproc, workdir, launch, host, plan, reading, started_at)
        if simulated:
            run = _as_world(run, simulated, world)
        why = self.setup.start_note(refused, launch.start_refusal)
        run.result = replace(run.result, start=launch.start + (f" ({why})" if why else ""))
        if why and self.setup.start == "fork":  # asked for: said in the report (auto falls back quietly)
            run.notes.append(f"ranks exec'd, not forked: {why}")
        run.notes = plan.notes + run.notes + [f"GPU sampler: {p}" for p in run.gpu_problems]
        if launch.port_note:
            run.notes.append(launch.port_note)
        run.snapshots = self._keep_snapshots(test_id, nproc, workdir)
        return run

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




def _as_world(run: SizeRun, ranks: tuple[int, ...], world: int) -> SizeRun:
    """A simulated launch's figures, keyed by the ranks its processes stood for, at the world's size."""
    def keyed(values: Mapping[int, Any]) -> dict[int, Any]:
        return {ranks[slot]: value for slot, value in values.items() if slot < len(ranks)}

    result = run.result
    figures: dict[str, Any] = {f.name: tuple((t, keyed(v)) for t, v in getattr(result, f.name)) if f.kind == "curve"
                               else keyed(getattr(result, f.name)) for f in PER_RANK if f.kind not in LINES}
    # its problems name the ranks its processes stood for already (failures.who)
    return replace(run, outcomes=keyed(run.outcomes), result=replace(
        result, world_size=world, simulated=ranks, platform=simulated_key(result.platform), **figures))
