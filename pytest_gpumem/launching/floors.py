"""The floor of each figure that shows one, for the parent: from this session, from the floor
cache, or measured by an empty launch of the probe (``rankside/floor_job.py``, run in the ranks)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..config.spec import Spec
from ..rankside.floor_job import FRAMEWORKS
from ..results.size import FloorResult
from .floor_cache import FloorCache, cache_key
from .launched import SizeRun, TestRun

LaunchProbe = Callable[[str, Spec, int], SizeRun]  # (test id, the probe's spec, world size) -> its run


class Floors:
    """A session's floors: measured once per framework, launch and size, then kept (and cached)."""

    def __init__(self, mode: str, cache: FloorCache | None, refresh: bool, launch_probe: LaunchProbe) -> None:
        self.mode = mode  # auto: floors of GPU figures; on: of every figure; off
        self.cache = cache  # None: floors are measured in every session
        self.refresh = refresh  # measure even where the cache has the floor (and rewrite it)
        self.launch_probe = launch_probe
        self._found: dict[tuple, tuple[FloorResult | None, list[str]]] = {}

    def with_floors(self, test: TestRun) -> TestRun:
        """``test`` with the floor of each figure that shows one (floor=auto: GPU figures; on: every
        figure): from this session, from the floor cache, or measured by an empty launch (once per
        framework, launcher, device, env and size). Looked up after the test's launch, which names
        the framework."""
        return replace(test, runs=[self._with_floor(test, run) for run in test.runs])

    def _with_floor(self, test: TestRun, run: SizeRun) -> SizeRun:
        result = run.result
        if result.simulated:  # an empty job under a stand-in communicator measures no communicator
            return run
        if not (self.mode == "on" or (self.mode == "auto" and result.device == "gpu")):
            return run
        framework = next((f for f in FRAMEWORKS if f in run.provenance), None)
        if framework is None:
            return run
        probe = replace(test.spec, script=None, module="pytest_gpumem.rankside.floor_job",
                        args=(framework, result.device), device=result.device, nproc=(result.world_size,))
        key = (framework, probe.launch_key(), result.world_size)
        looked_up = key not in self._found
        if looked_up:
            self._found[key] = self._floor(test.test_id, probe, framework, run)
        floor, found_notes = self._found[key]
        notes = [*run.notes, *(found_notes if looked_up else [])]  # said once, on the run that looked it up
        if floor is None:
            missing = f"the {framework} floor at nproc={result.world_size} could not be measured"
            return replace(run, notes=[*notes, missing])
        return replace(run, result=replace(result, floor=floor), notes=notes)

    def _floor(self, test_id: str, probe: Spec, framework: str, run: SizeRun) -> tuple[FloorResult | None, list[str]]:
        """(the floor, notes): the cached one unless refreshing; otherwise launched, then cached."""
        result, notes = run.result, []
        key = None if self.cache is None else cache_key(
            device=result.device, platform=result.platform, world_size=result.world_size, method=result.methods,
            launch=probe.launch_key(), provenance=run.provenance)
        if self.cache is not None and key is not None and not self.refresh:
            cached, problem = self.cache.get(key)
            notes += [problem] if problem else []
            if cached is not None and cached.framework == framework:
                return FloorResult(framework, cached.ranks, cached=cached.date), notes
        measured = self.launch_probe(test_id, probe, result.world_size)
        ranks = {r: p.mib for r, p in measured.result.peaks.items() if p.mib is not None}
        if measured.problems:
            return None, notes
        if self.cache is not None and key is not None and ranks:
            problem = self.cache.put(key, framework, ranks)
            notes += [problem] if problem else []
        return FloorResult(framework, ranks), notes
