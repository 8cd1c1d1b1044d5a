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
from typing import Any, Mapping

from .runs import SizeRun


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


def _curve(runs: list[SizeRun], attr: str) -> tuple[tuple[float, Mapping[int, float]], ...]:
    """Each group's curve, shifted by the groups run before it: one time axis, one group after another."""
    points: list[tuple[float, Mapping[int, float]]] = []
    offset = 0.0
    for run in runs:
        points.extend((round(t + offset, 4), values) for t, values in getattr(run.result, attr))
        offset += run.result.duration_s
    return tuple(points)


def merged(runs: list[SizeRun], gpus: int) -> SizeRun:
    """One run of the world's size from its groups' runs (each already keyed by the ranks it stood for)."""
    if len(runs) == 1:
        return runs[0]
    first, results = runs[0], [run.result for run in runs]
    ranks = tuple(r for result in results for r in result.simulated)
    seconds = sum(result.duration_s for result in results)
    result = replace(
        first.result,
        peaks=_union([r.peaks for r in results]), host_peaks=_union([r.host_peaks for r in results]),
        rss_peaks=_union([r.rss_peaks for r in results]), allocated=_union([r.allocated for r in results]),
        sites=_union([r.sites for r in results]), nodes=_union([r.nodes for r in results]),
        timeline=_curve(runs, "timeline"), live_timeline=_curve(runs, "live_timeline"), duration_s=seconds,
        simulated=ranks, uncounted=tuple(sorted({u for r in results for u in r.uncounted})),
        supplied=tuple(dict.fromkeys(s for r in results for s in r.supplied)),
        sites_notes=tuple(dict.fromkeys(n for r in results for n in r.sites_notes)))
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
