"""World sizes above what can be launched here: launch the ones that fit, simulate or predict the others.

The cap is ``gpumem_max_nproc`` when set (so it can be exercised on CPU), else the GPUs present
when the ranks would use GPUs, else what this host's memory can hold at all (host memory: the
ranks of ``nproc=1000`` on a 24 GiB machine would each need the ~30 MiB an interpreter with pytest
and the plugin holds before the test starts, so they are not started). A size above the cap
runs as a simulated world (``simulate``, :mod:`pytest_gpumem.rankside.simulate`; torch), else is
predicted from the launched sizes (:mod:`pytest_gpumem.results.predict`) when at least two fit,
else is shown as not launched. The sizes that fit are always launched and gated. Used by the
plugin and by ``gpumem measure`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..config.spec import Spec
from ..oneflow.cuda_on_cpu import CUDA_ON_CPU_ENV
from ..results.predict import PredictError, predict
from ..results.size import ALLOCATED, DEVICE, HOST, GatedReading, SizeResult, gated_reading, gated_subject
from .driver import TestDriver
from .launched import SizeRun, TestRun
from .launchers import launcher
from .rank_groups import merged, rank_groups, ranks_to_simulate

# The resident set of one rank before the test body runs: an interpreter with pytest and the plugin's
# rank code imported (30.3 MiB measured, torch venv, Python 3.11); a framework adds to it.
RANK_LEAST_MIB = 30.0


def oneflow_without_torch() -> bool:
    """OneFlow is installed in this interpreter (the ranks') and torch is not: a fake GPU runs torch only."""
    import importlib.util

    return importlib.util.find_spec("oneflow") is not None and importlib.util.find_spec("torch") is None


def oneflow_launcher(spec: Spec) -> bool:
    """The test's launcher runs OneFlow only (a launcher of a plugin's may not say: any framework)."""
    return getattr(launcher(spec.launcher), "framework", None) == "oneflow"


def host_memory_mib() -> float:
    import psutil

    return float(psutil.virtual_memory().total) / 2**20


class Capacity:
    """How many ranks one launch may have, and whether larger sizes are predicted."""

    def __init__(self, max_nproc: int | None = None, predict: bool = True,
                 gpu_count: Callable[[], int] = lambda: 0,
                 host_mib: Callable[[], float] = host_memory_mib,
                 oneflow_only: Callable[[], bool] = oneflow_without_torch) -> None:
        self.max_nproc = max_nproc  # gpumem_max_nproc; None: the GPUs present decide
        self.predict = predict
        self._gpu_count = gpu_count  # asked once, and only when max_nproc is None and GPUs matter
        self._gpus: int | None = None
        self._host_mib = host_mib  # asked only when a size is large enough for it to matter
        self._oneflow_only = oneflow_only  # asked only where a fake GPU would stand in

    def host_cap(self) -> tuple[int, str]:
        """The most ranks this host's memory can hold at all, and why."""
        total = self._host_mib()
        most = max(1, int(total // RANK_LEAST_MIB))
        return most, (f"this host's {total / 1024:.1f} GiB of memory, at the {RANK_LEAST_MIB:g} MiB a rank holds "
                      "before its test starts")

    def gpus(self, spec: Spec) -> int | None:
        """The GPUs the ranks would use (None: host memory)."""
        if spec.device == "cpu":
            return None
        if self._gpus is None:
            self._gpus = int(self._gpu_count())
        return self._gpus or None

    def fake(self, spec: Spec) -> bool:
        """Whether a test's sizes run on a fake GPU: device="gpu" with fake_gpu on, or auto where
        this machine has no GPU."""
        if spec.device != "gpu" or spec.fake_gpu == "off":
            return False
        return spec.fake_gpu == "on" or self.gpus(spec) is None

    def cuda_on_cpu(self, spec: Spec) -> bool:
        """Whether a fake GPU's test is a OneFlow job, known before its launch (OneFlow's launcher, or
        OneFlow without torch here): it runs for real on the CPU instead (``cuda_on_cpu``)."""
        return self.fake(spec) and (oneflow_launcher(spec) or self._oneflow_only())

    def cap(self, spec: Spec) -> tuple[int | None, str]:
        """(largest launchable size or None for no cap, where that number comes from)."""
        if self.max_nproc is not None:
            return self.max_nproc, f"gpumem_max_nproc={self.max_nproc}"
        if spec.device != "cpu":
            if self._gpus is None:
                self._gpus = int(self._gpu_count())
            if self._gpus:
                return self._gpus, f"{self._gpus} GPU(s) on this machine"
        # host memory (auto with no GPU; gpu with none: the planner skips the test, saying why)
        if max(spec.sizes) * RANK_LEAST_MIB <= 1024:  # a GiB fits anywhere: the host is not asked
            return None, ""
        return self.host_cap()


@dataclass(frozen=True)
class Plan:
    """What to launch for real, simulate, predict, or only show as not launched, for one spec."""

    launch: Spec  # the spec with only the sizes launched for real (the original when nothing is capped)
    predicted: tuple[int, ...] = ()
    simulated: tuple[int, ...] = ()
    unlaunched: tuple[int, ...] = ()  # neither launched, simulated nor predicted: shown, never gated
    why: str = ""  # why sizes were not launched for real (the cap and where it comes from)
    gpus: int | None = None  # the GPUs a simulated size's ranks share (None: host memory)
    fake: bool = False  # every size on a fake GPU (rankside.fakegpu), each a simulated world


def cuda_on_cpu(spec: Spec) -> Spec:
    """A OneFlow job written for CUDA where a fake GPU would stand in (OneFlow has no fake tensors): every
    size launched for real on host memory, its ranks reading CUDA as the CPU (``oneflow.cuda_on_cpu``)."""
    return replace(spec, device="cpu", fake_gpu="auto", env=(*spec.env, (CUDA_ON_CPU_ENV, "1")))


def plan(spec: Spec, capacity: Capacity) -> Plan:
    """Every size that fits is launched; the others are simulated (``simulate``), else predicted from
    at least two launched sizes, else shown as not launched. Nothing that fits is skipped."""
    if capacity.cuda_on_cpu(spec):
        return plan(cuda_on_cpu(spec), capacity)
    if capacity.fake(spec):  # nothing launched for real: every size, 1 too, a fake GPU's simulated world
        return Plan(launching(spec, ()), simulated=spec.sizes, fake=True,
                    why="a fake GPU" if spec.fake_gpu == "on" else "a fake GPU (this machine has no GPU)")
    cap, source = capacity.cap(spec)
    gpus = capacity.gpus(spec) if spec.simulate != "off" else None
    if spec.simulate == "on":  # every size above 1, whatever fits
        above = tuple(n for n in spec.sizes if n > 1)
        return Plan(launching(spec, (1,)), simulated=above,
                    why="simulate='on'", gpus=gpus)
    if cap is None or max(spec.sizes) <= cap:
        return Plan(spec)
    above = tuple(n for n in spec.sizes if n > cap)
    within = tuple(n for n in spec.sizes if n <= cap)
    head = f"needs more processes than can be launched here (at most {cap}: {source})"
    launch = launching(spec, within)
    if spec.simulate == "auto" and gpus is not None and cap == gpus:  # too few GPUs (not a cap asked for)
        return Plan(launch, simulated=above, why=head, gpus=gpus)
    if capacity.predict and len(within) >= 2:
        return Plan(launch, predicted=above, why=head)
    off = "prediction is off (--gpumem-no-predict)" if not capacity.predict else (
        "predicting needs at least two launched sizes")
    simulated = "simulate='off', and " if spec.simulate == "off" else ""
    return Plan(launch, unlaunched=above, why=f"{head}; {simulated}{off}")


def launching(spec: Spec, sizes: tuple[int, ...]) -> Spec:
    """``spec`` launching those of ``sizes`` it asks for and no other: the ratio (and the unlisted nproc=1
    it adds) stays only where its reference is among them, else the reference runs simulated."""
    keep = spec.max_ratio is not None and spec.reference in sizes
    return replace(spec, nproc=tuple(n for n in spec.nproc if n in sizes), max_ratio=spec.max_ratio if keep else None)


def _points(launched: list[SizeResult], readings: dict[int, GatedReading],
            figure: str) -> tuple[list[tuple[int, float]], dict[int, float]]:
    """The gated rank's figure at each launched size, and the floor under it where one was measured
    (the allocator figure has none: no context, no communicator)."""
    points, floors = [], {}
    for result in launched:
        _, mib, read = readings[result.world_size].read(figure)
        if mib is None or read != figure:
            return [], {}
        points.append((result.world_size, mib))
        rank = readings[result.world_size].rank
        floor = result.floor.ranks.get(0 if rank is None else rank) if result.floor is not None else None
        if floor is not None and figure != ALLOCATED:
            floors[result.world_size] = floor
    return points, floors


def run(driver: TestDriver, test_id: str, spec: Spec, capacity: Capacity) -> TestRun:
    """Launch what fits, simulate or predict the sizes above the cap, and show what is left."""
    chosen = plan(spec, capacity)
    test = driver.run(test_id, chosen.launch)
    test.spec = spec  # the limits and sizes the user asked for, simulated and predicted ones included
    test.unlaunched = {n: chosen.why for n in chosen.unlaunched}
    if test.skip_reason is not None or test.problems:
        return test
    simulated = chosen.simulated
    if simulated and spec.simulate == "auto" and "oneflow" in test.provenance:  # no stand-in for OneFlow
        simulated = ()
        fallback = plan(replace(spec, simulate="off"), capacity)
        test.unlaunched = {n: fallback.why.replace("simulate='off'", "OneFlow cannot be simulated")
                           for n in fallback.unlaunched}
        chosen = replace(chosen, predicted=fallback.predicted)
    for n in simulated:
        ranks = ranks_to_simulate(spec.rank, n, simulated, chosen.launch.sizes, spec.assume is not None)
        groups: list[SizeRun] = []
        for group in rank_groups(ranks, chosen.gpus, chosen.fake):  # ranks that fit the GPUs together
            groups.append(driver.simulate(test_id, spec, n, group, chosen.gpus, fake=chosen.fake))
            if groups[-1].problems or groups[-1].all_skipped is not None:
                break
        run = merged(groups, chosen.gpus or 0)
        test.runs.append(run)
        if not test.provenance and run.provenance:  # nothing launched for real (a fake GPU): its ranks say
            test.provenance = dict(run.provenance)
        if run.problems or run.all_skipped is not None:
            test.skip_reason = run.all_skipped
            return test
    if chosen.predicted:
        test.predicted, why = _predict(test, spec, chosen.predicted)
        test.unlaunched = {**test.unlaunched, **why}
    return test


def _predict(test: TestRun, spec: Spec, sizes: tuple[int, ...]) -> tuple[list[SizeResult], dict[int, str]]:
    """A predicted :class:`SizeResult` for each of ``sizes``, fitted on the launched ones; or none,
    and why each cannot be predicted (nothing, where the verdict fails on a launched size anyway)."""
    label = gated_subject(spec.rank)
    launched = [r for r in test.results if not r.predicted]
    readings = {r.world_size: gated_reading(r, spec.rank) for r in launched}
    device, platform = launched[-1].device, launched[-1].platform
    main = DEVICE if device == "gpu" else HOST
    try:
        points, floors = _points(launched, readings, main)
        allocated, _ = _points(launched, readings, ALLOCATED) if device == "gpu" else ([], {})
        return [SizeResult(world_size=n, device=device, peaks={}, platform=platform,
                           prediction=predict(points, n, label, floors),
                           allocated_prediction=predict(allocated, n, label) if allocated else None)
                for n in sizes], {}
    except PredictError as exc:
        if all(reading.mib is not None for reading in readings.values()):  # else the verdict fails on it
            return [], {n: f"cannot be predicted: {exc}" for n in sizes}
        return [], {}
