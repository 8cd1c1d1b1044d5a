"""Runs one gpumem test: launch each world size, measure every rank, read what each rank said.

The nproc=1 reference that a ratio needs is launched once and reused by every later test with
the same launch parameters in this session (same test id in body mode; same program, args and
env in script mode).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config.env_names import TRACK_ENV
from ..config.settings import DEFAULT_FAIL_FAST_GRACE_S
from ..config.spec import Spec
from ..results.size import SizeResult, gated_reading
from .floor_cache import FloorCache
from .floors import Floors
from .gpus import GpuPlan, GpuPlanner
from .launched import SizeRun, TestRun
from .launchers import Launcher, LauncherOptions
from .rank_setup import RankSetup
from .size_launch import GpuSetup, SizeLaunch
from .startups import Startups
from .supervise import LaunchResult
from .watch import Watch


class TestDriver:
    """One gpumem test's launches: each world size, the nproc=1 reference reused, the floors, the
    ranks' start-up (a probe, once: ``startups``), a relaunch for peak sites, a simulated world; the
    ranks' files read by ``rank_reading``."""

    __test__ = False  # not a test class, though its name starts with Test (pytest collects by name)

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
        watch: Watch | None = None,
    ) -> None:
        self.size_launch = SizeLaunch(cwd=cwd, setup=setup, gpu_setup=gpu_setup, host_interval_s=host_interval_s,
                                 snapshot_dir=snapshot_dir, launcher_options=launcher_options,
                                 fail_fast_grace=fail_fast_grace, fake_gpus=fake_gpus, watch=watch)
        self._references: dict[tuple, SizeRun] = {}
        # refresh_floors: measure even where the cache has the floor (and rewrite it): floor=on's meaning by default.
        self.floors = Floors(floor, floor_cache, floor == "on" if refresh_floors is None else refresh_floors,
                             self._launch_probe)
        self.startups = startups or Startups("tracked", None, cwd)  # the ranks' start-ups, measured once

    def run(self, test_id: str, spec: Spec) -> TestRun:
        test = self._run(test_id, spec)
        if test.skip_reason is None and not test.problems:
            test = self.floors.with_floors(test)
        newest = next((run.provenance for run in reversed(test.runs) if run.provenance), None)
        return test if newest is None else replace(test, provenance=dict(newest))

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
                chosen, plan = self.size_launch.plan(spec, nproc, test_id)
                if plan.skip_reason is not None:
                    test.skip_reason = plan.skip_reason
                    return test
                run = self._launch(test_id, spec, chosen, nproc, plan)
                if nproc == 1 and not run.problems and run.all_skipped is None:
                    self._references[key] = run
                if nproc not in spec.nproc and run.problems:
                    run.problems.append(unlisted_reference(spec, nproc))
            test.runs.append(run)
            skipped = run.all_skipped
            if skipped is not None:
                test.skip_reason = skipped
                return test
            if run.problems:
                return test  # a broken launch says more than any memory figure
        return test

    def _launch_probe(self, test_id: str, probe: Spec, nproc: int) -> SizeRun:
        chosen, plan = self.size_launch.plan(probe, nproc, f"{test_id} (floor)")
        return self._launch(test_id, probe, chosen, nproc, plan, label="floor")

    def relaunch_for_sites(self, test: TestRun, sizes: set[int]) -> TestRun:
        """``test`` with the GPU peak sites of ``sizes``, from a relaunch with torch's allocator
        history on.

        The history costs little while a job runs, but its first reading imports torch's compiler
        stack (~1 s a rank on an H200 for a job that has not), so by default it is not recorded in
        a passing run: a failing GPU size is relaunched once with it, and the failure names the
        relaunch and its figure beside the sites. Sizes that already have sites are left alone.
        """
        return replace(test, runs=[self._with_sites(test, run) if run.result.world_size in sizes else run
                                   for run in test.runs])

    def _with_sites(self, test: TestRun, run: SizeRun) -> SizeRun:
        result = run.result
        if result.device != "gpu" or result.sites or result.predicted:
            return run
        spec = replace(test.spec, launcher="direct") if result.simulated else test.spec
        processes = self.size_launch.processes(result.world_size, result.simulated)
        chosen, plan = self.size_launch.plan(spec, processes, f"{test.test_id} (peak sites)",
                                             fake=bool(result.fake_gpu))
        if plan.skip_reason is not None:
            return run
        again = self._launch(test.test_id, spec, chosen, result.world_size, plan, history=True,
                             simulated=result.simulated, label="peak sites")
        rank, relaunched = test.readings[result.world_size].rank, gated_reading(again.result, test.spec.rank)
        found = again.result.sites.get(rank) if rank is not None else None
        if again.problems or rank is None or not found:
            why = f": {again.problems[0].splitlines()[0]}" if again.problems else ""
            return replace(run, notes=[*run.notes, f"the relaunch of nproc={result.world_size} for its peak sites "
                                                   f"gave none{why}"])
        mib = relaunched.allocated[1]
        figure = "" if mib is None else f"; its allocator figure {mib:.1f} MiB"
        note = (f"peak sites at nproc={result.world_size} from a relaunch with torch's allocator history on"
                f"{figure} (--gpumem-sites=on records it in every launch)")
        # rank="all" holds each rank to its own baseline: every rank's sites, to name the one that grew.
        found_sites = again.result.sites if relaunched.every else {rank: found}
        return replace(run, result=replace(result, sites={**result.sites, **found_sites},
                                           sites_notes=(*result.sites_notes, note)))

    def simulate(self, test_id: str, spec: Spec, world_size: int, ranks: tuple[int, ...], gpus: int | None,
                 fake: bool = False) -> SizeRun:
        """Ranks ``ranks`` of a world of ``world_size`` that is not launched whole: each a real
        process with a stand-in communicator (``rankside.simulate``), all at once, sharing the
        ``gpus`` GPUs present (None: host memory), or each on a fake GPU (``fake``). Its figures are
        keyed by the ranks they stand for."""
        self.size_launch.simulated_gpus = None if fake else gpus
        direct = replace(spec, launcher="direct")  # a launcher would start the whole world
        chosen, plan = self.size_launch.plan(direct, self.size_launch.processes(world_size, ranks),
                                             f"{test_id} (simulated nproc={world_size})", fake=fake)
        if plan.skip_reason is not None:
            return SizeRun(result=SizeResult(world_size, "gpu", {}, simulated=ranks),
                           launch=LaunchResult(world_size, []), outcomes={}, problems=[plan.skip_reason])
        return self._launch(test_id, direct, chosen, world_size, plan, simulated=ranks)

    def _startup(self, test_id: str, spec: Spec, chosen: Launcher, world: int, plan: GpuPlan,
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
        probe = self.size_launch.launch(test_id, spec, chosen, world, probe_plan, simulated=simulated,
                                        startup="probe", label="start-up probe")
        if len(probe.startups) == (len(simulated) or world):
            self.startups.learn(test_id, launch, world, probe.startups, probe.startup_files)
            return self.startups.env(test_id, launch, world), None
        if probe.launch.results or probe.launch.timed_out:  # a rank said why it never got there, or hung
            return "", probe
        # No figures and no word from the test (e.g. the tracker could not start, a rank died): the
        # test's own launch, tracked whole, shows whatever it is.
        self.startups.failed(test_id, launch, world, probe.problems + probe.notes)
        return "", None

    def _launch(self, test_id: str, spec: Spec, chosen: Launcher, nproc: int, plan: GpuPlan, history: bool = False,
                simulated: tuple[int, ...] = (), label: str = "") -> SizeRun:
        """One launch at world size ``nproc`` by ``chosen``, its ranks' start-up found first (from this
        session, the cache, or a probe launched now)."""
        startup = ""
        # Host-tracked pytest ranks of a whole world: their start-up is measured once (launching.startups).
        setup = self.size_launch.setup
        if plan.error is None and spec.body_mode and setup.env(spec, chosen, plan, history).get(TRACK_ENV) == "1":
            startup, failed = self._startup(test_id, spec, chosen, nproc, plan, simulated)
            if failed is not None:
                plan.release()
                return failed
        run = self.size_launch.launch(test_id, spec, chosen, nproc, plan, history=history, simulated=simulated,
                                      startup=startup, label=label)
        run.notes += self.startups.take_notes()
        return run


def unlisted_reference(spec: Spec, nproc: int) -> str:
    """Why a size nobody listed was launched, and how a job that cannot run there says so."""
    listed = ", ".join(map(str, spec.nproc))
    return (f"nproc={nproc} is not in the marker's nproc=[{listed}]: it was launched as max_ratio's reference; "
            f"a job that cannot run at {nproc} rank takes its ratio against a listed size: "
            f"reference={min(spec.nproc)}")
