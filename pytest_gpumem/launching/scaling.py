"""World sizes above what can be launched here: launch the ones that fit, predict the others.

The cap is ``gpumem_max_nproc`` when set (so it can be exercised on CPU), else the GPUs present
when the ranks would use GPUs, else none (host memory: every size launches, as before). A size
above the cap is predicted from the launched sizes (:mod:`pytest_gpumem.judging.predict`) when at least
two distinct sizes fit under the cap; otherwise, or with ``--gpumem-no-predict``, the test is
skipped as before, with the reason. Used by the plugin and by ``gpumem measure`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..config.spec import Spec
from ..judging.predict import PredictError, predict
from ..judging.verdict import ALLOCATED, DEVICE, HOST, SizeResult
from .runner import Runner, TestRun


class Capacity:
    """How many ranks one launch may have, and whether larger sizes are predicted."""

    def __init__(self, max_nproc: int | None = None, predict: bool = True,
                 gpu_count: Callable[[], int] = lambda: 0) -> None:
        self.max_nproc = max_nproc  # gpumem_max_nproc; None: the GPUs present decide
        self.predict = predict
        self._gpu_count = gpu_count  # asked once, and only when max_nproc is None and GPUs matter
        self._gpus: int | None = None

    def cap(self, spec: Spec) -> tuple[int | None, str]:
        """(largest launchable size or None for no cap, where that number comes from)."""
        if self.max_nproc is not None:
            return self.max_nproc, f"gpumem_max_nproc={self.max_nproc}"
        if spec.device == "cpu":
            return None, ""
        if self._gpus is None:
            self._gpus = int(self._gpu_count())
        if self._gpus == 0:  # auto: host memory, no cap; gpu: the planner skips, saying so, as before
            return None, ""
        return self._gpus, f"{self._gpus} GPU(s) on this machine"


@dataclass(frozen=True)
class Plan:
    """What to launch and what to predict for one spec."""

    launch: Spec  # the spec with only launchable sizes (the original when nothing is capped)
    predicted: tuple[int, ...] = ()
    skip_reason: str | None = None


def plan(spec: Spec, capacity: Capacity) -> Plan:
    cap, source = capacity.cap(spec)
    if cap is None or max(spec.sizes) <= cap:
        return Plan(spec)
    above = tuple(n for n in spec.nproc if n > cap)
    within = tuple(n for n in spec.sizes if n <= cap)
    sizes = ", ".join(map(str, above))
    head = f"nproc={sizes} needs more processes than can be launched here (at most {cap}: {source})"
    if not capacity.predict:
        return Plan(spec, skip_reason=f"{head}; prediction is off (--gpumem-no-predict)")
    if len(within) < 2:
        have = ", ".join(map(str, within)) or "none"
        return Plan(spec, skip_reason=f"{head}; predicting needs at least two launched sizes, and only "
                                      f"nproc {have} fits: add smaller sizes to nproc (e.g. 1, 2)")
    return Plan(replace(spec, nproc=tuple(n for n in spec.nproc if n <= cap)), above)


def _points(test: TestRun, spec: Spec, figure: str) -> tuple[list[tuple[int, float]], dict[int, float]]:
    """The gated rank's figure at each launched size, and the floor under it where one was measured
    (the allocator figure has none: no context, no communicator)."""
    points, floors = [], {}
    for result in test.results:
        if result.predicted:
            continue
        _, mib, read = result.read(spec.rank, figure)
        if mib is None or read != figure:
            return [], {}
        points.append((result.world_size, mib))
        rank = result.gated_rank(spec.rank)
        floor = result.floor.ranks.get(0 if rank is None else rank) if result.floor is not None else None
        if floor is not None and figure != ALLOCATED:
            floors[result.world_size] = floor
    return points, floors


def run(runner: Runner, test_id: str, spec: Spec, capacity: Capacity) -> TestRun:
    """Launch what fits, then add a predicted :class:`SizeResult` for each size above the cap."""
    chosen = plan(spec, capacity)
    if chosen.skip_reason is not None:
        return TestRun(test_id, spec, skip_reason=chosen.skip_reason)
    test = runner.run(test_id, chosen.launch)
    test.spec = spec  # the limits and sizes the user asked for, predicted ones included
    if not chosen.predicted or test.skip_reason is not None or test.problems:
        return test
    label = "largest rank" if spec.rank == "all" else f"rank {spec.rank}"
    launched = [r for r in test.results if not r.predicted]
    device, platform = launched[-1].device, launched[-1].platform
    main = DEVICE if device == "gpu" else HOST
    try:
        for n in chosen.predicted:
            points, floors = _points(test, spec, main)
            prediction = predict(points, n, label, floors)
            allocated, _ = _points(test, spec, ALLOCATED) if device == "gpu" else ([], {})
            test.predicted.append(SizeResult(
                world_size=n, device=device, peaks={}, platform=platform, prediction=prediction,
                allocated_prediction=predict(allocated, n, label) if allocated else None))
    except PredictError as exc:
        test.predicted.clear()
        if all(r.gated(spec.rank)[1] is not None for r in launched):  # else the verdict fails on it
            test.skip_reason = f"nproc={', '.join(map(str, chosen.predicted))} cannot be predicted: {exc}"
    return test
