"""Runs one gpumem test: launch each world size, measure every rank, read what each rank said.

The nproc=1 reference that a ratio needs is launched once and reused by every later test with
the same launch parameters in this session (same test id in body mode; same program, args and
env in script mode).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config.spec import Spec
from ..judging.verdict import SizeResult
from ..rankside import protocol
from ..rankside.rank import STARTUP_ENV, TRACK_ENV
from ..sampling import Sampler
from ..sampling.host import HostSampler
from ..sampling.identity import simulated_key
from . import failures
from .floor_cache import FloorCache
from .floors import Floors
from .gpus import GpuPlan, GpuPlanner
from .launch import DEFAULT_FAIL_FAST_GRACE_S, LaunchRequest, LaunchResult
from .launcher import LauncherOptions, launcher
from .rank_reading import Reading, read_size_run
from .rank_setup import RankSetup
from .runs import SizeRun, TestRun
from .startups import Startups
from .workdirs import make_workdir, sweep_orphans

GpuSetup = Callable[[Spec, int, str], GpuPlan]
PORT_ATTEMPTS = 3  # launches of one size whose rendezvous port was lost before any test body started


class Runner:
    """One gpumem test's launches: each world size, the nproc=1 reference reused, the floors, the
    ranks' start-up (a probe, once: ``startups``), a relaunch for peak sites, a simulated world; the
    ranks' files read by ``rank_reading``."""

    def __init__(
        self,
        *,
        cwd: Path,
        setup: RankSetup,
        gpu_setup: GpuSetup = GpuPlanner(None),
        host_interval_s: float | None = None,
        snapshot_dir: Path | None = None,
        floor: str = "auto",
        floor_cache: FloorCache | None = None,
        refresh_floors: bool | None = None,
        launcher_options: LauncherOptions | None = None,
        fail_fast_grace: float = DEFAULT_FAIL_FAST_GRACE_S,
        startups: Startups | None = None,
        fake_gpus: GpuSetup | None = None,
    ) -> None:
        self.cwd = cwd
        self.setup = setup
        self.gpu_setup = gpu_setup
        self.host_interval_s = host_interval_s
        self.snapshot_dir = snapshot_dir
        self.launcher_options = launcher_options or LauncherOptions()
        self._references: dict[tuple, SizeRun] = {}
        self._swept = False
        # refresh_floors: measure even where the cache has the floor (and rewrite it): floor=on's meaning by default.
        self.floors = Floors(floor, floor_cache, floor == "on" if refresh_floors is None else refresh_floors,
                             self._launch_probe)
        self.simulated_gpus: int | None = None  # GPUs a simulated size's ranks share (None: host)
        self.fail_fast_grace = fail_fast_grace  # seconds the other ranks get once one failed
        self.startups = startups or Startups("tracked", None, cwd)  # the ranks' start-ups, measured once
        self.fake_gpus = fake_gpus  # a fake GPU's launches (launching.gpus.FakeGpus); None: none here

    def run(self, test_id: str, spec: Spec) -> TestRun:
        test = self._run(test_id, spec)
        if test.skip_reason is None and not test.problems:
            self.floors.add(test)
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

    def _launch_probe(self, test_id: str, probe: Spec, nproc: int) -> SizeRun:
        return self._launch(test_id, probe, nproc, self._plan(probe, nproc, f"{test_id} (floor)"))

    def _plan(self, spec: Spec, nproc: int, test_id: str, fake: bool = False) -> GpuPlan:
        if fake:
            if self.fake_gpus is None:
                return GpuPlan(skip_reason="a fake GPU was asked for, but this session has none set up")
            return self.fake_gpus(spec, nproc, test_id)
        own = launcher(spec.launcher).plan(spec, nproc)  # e.g. srun: Slurm binds the GPUs
        return own if own is not None else self.gpu_setup(spec, nproc, test_id)

    def _new_workdir(self, spec: Spec) -> Path:
        shared = launcher(spec.launcher).workdir(self.launcher_options)  # e.g. srun: one every node sees
        if shared is not None:
            return shared
        if not self._swept:  # once per session, at the first local launch: nothing paid when unused
            self._swept = True
            sweep_orphans()
        return make_workdir()  # private: mode 0700

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
            plan = self._plan(spec, processes, f"{test.test_id} (peak sites)", fake=bool(result.fake_gpu))
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

    def simulate(self, test_id: str, spec: Spec, world_size: int, ranks: tuple[int, ...], gpus: int | None,
                 fake: bool = False) -> SizeRun:
        """Ranks ``ranks`` of a world of ``world_size`` that is not launched whole: each a real
        process with a stand-in communicator (``rankside.simulate``), all at once, sharing the
        ``gpus`` GPUs present (None: host memory), or each on a fake GPU (``fake``). Its figures are
        keyed by the ranks they stand for."""
        self.simulated_gpus = None if fake else gpus
        direct = replace(spec, launcher="direct")  # a launcher would start the whole world
        plan = self._plan(direct, self._processes(world_size, ranks), f"{test_id} (simulated nproc={world_size})",
                          fake=fake)
        if plan.skip_reason is not None:
            return SizeRun(result=SizeResult(world_size, "gpu", {}, simulated=ranks),
                           launch=LaunchResult(world_size, "direct", []), outcomes={}, problems=[plan.skip_reason])
        return self._launch(test_id, direct, world_size, plan, simulated=ranks)

    def _startup(self, test_id: str, spec: Spec, world: int, plan: GpuPlan,
                 simulated: tuple[int, ...]) -> tuple[str, SizeRun | None]:
        """The ranks' ``GPUMEM_STARTUP`` (their start-up's figures, from this session, the cache or a
        probe launched now; "" tracks them whole), or the probe's run where the probe showed the
        launch cannot get as far as the test's setup (a collection error, a hang at import, a skip):
        the test's own launch would end the same way."""
        launch = spec.launch_key() + ((("simulated",) + simulated,) if simulated else ())
        found = self.startups.env(test_id, launch, world)
        if found != "probe":
            return found, None
        # The launch's own GPUs (held by its plan while the probe runs), no sampler: nothing is gated.
        probe_plan = GpuPlan(env=dict(plan.env), gpu_name=plan.gpu_name, provenance=dict(plan.provenance))
        probe = self._launch(test_id, spec, world, probe_plan, simulated=simulated, startup="probe")
        if len(probe.startups) == (len(simulated) or world):
            self.startups.learn(test_id, launch, world, probe.startups, probe.startup_files)
            return self.startups.env(test_id, launch, world), None
        if probe.launch.results or probe.launch.timed_out:  # a rank said why it never got there, or hung
            return "", probe
        # No figures and no word from the test (e.g. the tracker could not start, a rank died): the
        # test's own launch, tracked whole, shows whatever it is.
        self.startups.failed(test_id, launch, world, probe.problems + probe.notes)
        return "", None

    def _processes(self, world_size: int, simulated: tuple[int, ...]) -> int:
        """GPUs a launch leases: one a rank, or for a simulated world those its ranks share."""
        if not simulated:
            return world_size
        return min(len(simulated), self.simulated_gpus) if self.simulated_gpus else len(simulated)

    def _launch(self, test_id: str, spec: Spec, nproc: int, plan: GpuPlan, history: bool = False,
                simulated: tuple[int, ...] = (), startup: str | None = None) -> SizeRun:
        """One launch at world size ``nproc``: all its ranks, or only the ``simulated`` ones.
        ``startup``: the ranks' ``GPUMEM_STARTUP`` (None: looked up, a probe launched first if need be)."""
        if plan.error is not None:  # e.g. the GPUs stayed busy past the lease wait
            return SizeRun(result=SizeResult(nproc, "gpu", {}), launch=LaunchResult(nproc, spec.launcher, []),
                           outcomes={}, problems=[plan.error])
        if startup is None:
            startup = ""
            # Host-tracked pytest ranks of a whole world: their start-up is measured once (launching.startups).
            if spec.body_mode and self.setup.env(spec, plan, history).get(TRACK_ENV) == "1":
                startup, failed = self._startup(test_id, spec, nproc, plan, simulated)
                if failed is not None:
                    plan.release()
                    return failed
        lost: list[str] = []
        while True:
            try:
                workdir = self._new_workdir(spec)
            except OSError as exc:
                return SizeRun(result=SizeResult(nproc, "cpu", {}), launch=LaunchResult(nproc, spec.launcher, []),
                               outcomes={}, problems=[str(exc)])
            try:  # the folder goes whatever happens, Ctrl-C included
                run = self._launch_in(test_id, spec, nproc, plan, workdir, history, simulated, startup)
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
                   history: bool = False, simulated: tuple[int, ...] = (), startup: str = "") -> SizeRun:
        nproc = len(simulated) or world  # processes
        host = HostSampler(self.host_interval_s) if self.host_interval_s else HostSampler()
        samplers: list[Sampler] = [host] + ([plan.sampler] if plan.sampler is not None else [])
        remote = launcher(spec.launcher).remote

        def on_rank(rank: int, pid: int) -> None:
            if remote:  # the PID is on the rank's own host: its exit report counts
                return
            for sampler in samplers:
                sampler.add_process(rank, pid)

        env = {**self.setup.env(spec, plan, history), STARTUP_ENV: startup}
        refused = self.setup.fork_refusal(spec, plan, env)
        request = LaunchRequest(
            launcher=spec.launcher,
            nproc=nproc,
            rank_argv=self.setup.argv(test_id, spec),
            env=env,
            cwd=self.cwd,
            workdir=workdir,
            timeout=spec.timeout,
            nnodes=spec.nnodes,
            start="exec" if refused else "fork",
            simulated=simulated,
            world_size=world,
            gpus=self._processes(world, simulated),  # the GPUs leased, which LOCAL_RANK indexes
            fail_fast_grace=self.fail_fast_grace,
        )
        started_at = time.time()  # the ranks' own curves are in epoch seconds
        for sampler in samplers:
            sampler.start()
        try:
            launch = launcher(spec.launcher).start(request, on_rank, self.launcher_options).run()
        finally:
            for sampler in samplers:
                sampler.stop()
            plan.release()
        reading = Reading(
            in_rank_gpu=self.setup.in_rank_gpu(spec, plan),
            untracked_host=self.setup.track_host == "auto" and not self.setup.tracks_host(spec, plan),
            context=failures.LaunchContext(marker_env=dict(spec.env), cwd=self.cwd, workdir=workdir,
                                           timeout=spec.timeout, body_mode=spec.body_mode,
                                           fail_fast_grace=self.fail_fast_grace))
        run = read_size_run(spec, nproc, workdir, launch, host, plan, reading, started_at)
        if simulated:
            run = _as_world(run, simulated, world)
        why = self.setup.start_note(refused, launch.start_refusal)
        run.result = replace(run.result, start=launch.start + (f" ({why})" if why else ""))
        if why and self.setup.start == "fork":  # asked for: said in the report (auto falls back quietly)
            run.notes.append(f"ranks exec'd, not forked: {why}")
        run.notes = plan.notes + run.notes + [f"GPU sampler: {p}" for p in run.gpu_problems]
        run.notes += self.startups.take_notes()
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

    def curve(points: tuple[tuple[float, Mapping[int, float]], ...]) -> tuple[tuple[float, Mapping[int, float]], ...]:
        return tuple((t, keyed(values)) for t, values in points)

    result = run.result
    run.result = replace(
        result, world_size=world, simulated=ranks, platform=simulated_key(result.platform),
        peaks=keyed(result.peaks), host_peaks=keyed(result.host_peaks),
        rss_peaks=keyed(result.rss_peaks), allocated=keyed(result.allocated), sites=keyed(result.sites),
        nodes=keyed(result.nodes), timeline=curve(result.timeline), live_timeline=curve(result.live_timeline))
    run.outcomes = {ranks[slot]: o for slot, o in run.outcomes.items() if slot < len(ranks)}
    return run  # its problems name the ranks its processes stood for already (failures.who)
