"""The simulated ranks of one world size, run in groups that fit the GPUs present.

A rank of ``rank="all"`` in a simulated world is a process of its own with a stand-in communicator,
so its figure does not depend on the others running beside it. On GPUs, as many ranks run at a time
as there are GPUs (each alone on one), one group after another: eight ranks of a model that takes
60 GiB a rank do not fit on one GPU together, one at a time they do. On host memory or a fake GPU
(no device memory to share) every rank runs at once. The groups' figures are merged
into one run of the world's size; the cost is said in the run's notes.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Any, Mapping

from ..results.size import LINES, PER_RANK, PerRank
from .launched import SizeRun


def ranks_to_simulate(rank: int | str, world: int, simulated: tuple[int, ...], launched: tuple[int, ...],
                      assumed: bool = False) -> tuple[int, ...]:
    """The ranks that run at a simulated world of ``world``: every one for ``rank="all"``; else the
    gated rank alone, but at the smallest world above 1 where none above 1 is launched for real
    (``launched``): there every rank runs, so that a job that crashes or hangs a rank other than the
    gated one fails (rank 0 alone let a rank 1 that raised pass), at the cheapest such world. Not where
    received values are ``assumed`` (``assume=``): the assumption is the gated rank's, and another rank
    fed it crashed where the real job does not (a collapsed router's rank 1: an empty all-to-all input)."""
    above = [n for n in simulated if n > 1]
    every = not assumed and not any(n > 1 for n in launched) and bool(above) and world == min(above)
    return tuple(range(world)) if rank == "all" or every else (int(rank),)


def rank_groups(ranks: tuple[int, ...], gpus: int | None, fake: bool) -> list[tuple[int, ...]]:
    """The launches that run ``ranks``: all at once on host memory or a fake GPU, else ``gpus`` at a time."""
    if gpus is None or fake or len(ranks) <= gpus:
        return [ranks]
    return [ranks[i:i + gpus] for i in range(0, len(ranks), gpus)]


def _union(maps: list[Mapping[int, Any]]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for values in maps:
        out.update(values)
    return dict(sorted(out.items()))


def _merge(f: PerRank, runs: list[SizeRun]) -> Any:
    """One per-rank field of the world from its groups': their ranks together, each line once."""
    values = [getattr(run.result, f.name) for run in runs]
    if f.kind == "curve":  # each group's after the groups run before it: one time axis
        offsets = accumulate([0.0] + [run.result.duration_s for run in runs])
        return tuple((round(t + offset, 4), ranks) for curve, offset in zip(values, offsets) for t, ranks in curve)
    if f.kind in LINES:
        lines = [line for group in values for line in group]
        return tuple(sorted(set(lines)) if f.kind == "sorted lines" else dict.fromkeys(lines))
    return _union(values)


def merged(runs: list[SizeRun], gpus: int) -> SizeRun:
    """One run of the world's size from its groups' runs (each already keyed by the ranks it stood for)."""
    if len(runs) == 1:
        return runs[0]
    first, results = runs[0], [run.result for run in runs]
    ranks = tuple(r for result in results for r in result.simulated)
    seconds = sum(result.duration_s for result in results)
    result = replace(first.result, duration_s=seconds, simulated=ranks, **{f.name: _merge(f, runs) for f in PER_RANK})
    cost = (f"nproc={result.world_size}: its {len(ranks)} simulated ranks ran {gpus} at a time (each alone on one "
            f"of {gpus} GPU(s)), {len(runs)} launches one after another, {seconds:.1f} s in all")
    return SizeRun(
        result=result, launch=first.launch, outcomes=_union([run.outcomes for run in runs]),
        problems=[p for run in runs for p in run.problems], provenance=dict(first.provenance),
        gpu_problems=[p for run in runs for p in run.gpu_problems],
        notes=list(dict.fromkeys(n for run in runs for n in run.notes)) + [cost],
        snapshots=_union([run.snapshots for run in runs]), boxings=list(first.boxings),
        eager=list(first.eager), eager_problem=first.eager_problem, graph_inputs=list(first.graph_inputs),
        startups=_union([run.startups for run in runs]), startup_files=dict(first.startup_files))
