"""A test's record assembled from its run and its verdict: the one place that derives these facts.

From here on nothing is judged again: every output renders the :class:`~.record.TestRecord`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from ..sampling import Peak
from ..sampling.allocations import is_allocation_method
from .explain import imbalance, peak_times
from .growth import Growth
from .record import (
    AllocatedRecord,
    BaselineChange,
    Cause,
    CheckRecord,
    FloorRecord,
    Limits,
    SizeRecord,
    Status,
    TestRecord,
)
from .verdict import SizeResult, Verdict, ratio_figures

if TYPE_CHECKING:
    from ..config.spec import Spec


class Run(Protocol):
    """What the builder reads of a run (``launching.runner.TestRun``, which sits a layer above)."""

    @property
    def test_id(self) -> str: ...
    @property
    def spec(self) -> Spec: ...
    @property
    def results(self) -> list[SizeResult]: ...
    @property
    def provenance(self) -> dict[str, str]: ...


def build(test: Run, verdict: Verdict | None, status: Status, *, cause: Cause | None = None,
          baselines: Mapping[int, float] | None = None, allocated_baselines: Mapping[int, float] | None = None,
          changes: Sequence[BaselineChange] = (), changed: Sequence[str] = (),
          messages: Sequence[str] | None = None, growth: Growth | None = None) -> TestRecord:
    """The record of one test, from its run and its verdict: the one place that derives these facts."""
    spec = test.spec
    checks: dict[int, list[CheckRecord]] = {}
    digits = verdict.digits if verdict is not None else 1  # the failure text's precision, in every sentence
    for check in verdict.checks if verdict is not None else ():
        checks.setdefault(check.world_size, []).append(
            CheckRecord(check.kind, check.ok, check.measured_mib, check.limit_mib, check.text(digits),
                        check.figure, check.advisory))
    sizes = []
    for result in test.results:
        n = result.world_size
        label, gated = result.gated(spec.rank)
        floor = result.floor
        sizes.append(SizeRecord(
            nproc=n,
            device=result.device,
            gated_rank=result.gated_rank(spec.rank),
            gated_label=label,
            gated_mib=gated,
            ranks={r: Peak(p.mib, p.method) for r, p in sorted(result.peaks.items())},
            checks=tuple(checks.get(n, ())),
            ratio=verdict.ratio(n) if verdict is not None else None,
            ratio_figure=_ratio_figure(test.results, result, spec) if verdict is not None else "",
            baseline_mib=(baselines or {}).get(n),
            others_max_mib=result.others_max(spec.rank),
            # Live allocations only: where the ranks were not tracked (GPU figures) VmHWM is in rss_ranks.
            host_ranks={r: p.mib for r, p in sorted(result.host_peaks.items())
                        if p.mib is not None and is_allocation_method(p.method)},
            rss_ranks={r: round(mib, 1) for r, mib in sorted(result.rss_peaks.items())},
            floor=None if floor is None else FloorRecord(floor.framework, floor.describe(result.device, n),
                                                         {r: round(m, 1) for r, m in sorted(floor.ranks.items())},
                                                         floor.cached),
            peak_at_s={r: round(t, 3) for r, t in sorted(peak_times(result).items())},
            imbalance=imbalance(result),
            duration_s=round(result.duration_s, 3),
            start=result.start,
            reused=result.reused,
            nodes=dict(sorted(result.nodes.items())),
            timeline=tuple((round(t, 4), {r: round(v, 2) for r, v in point.items()}) for t, point in result.timeline),
            # Not launched: fitted from the launched sizes (model, its LOO error, the points).
            prediction=result.prediction.as_dict() if result.prediction is not None else None,
            allocated_ranks={r: AllocatedRecord(round(a.mib, 2), None if a.reserved_mib is None
                                                else round(a.reserved_mib, 2))
                             for r, a in sorted(result.allocated.items())},
            allocated_mib=_allocated_reading(result, spec),
            allocated_baseline_mib=(allocated_baselines or {}).get(n),
            sites={r: tuple(site.as_dict() for site in sites) for r, sites in sorted(result.sites.items())},
            live_timeline=tuple((round(t, 4), {r: round(v, 2) for r, v in point.items()})
                                for t, point in result.live_timeline),
            simulated=result.simulated,
            fake_gpu=result.fake_gpu,
            uncounted=result.uncounted,
        ))
    if messages is None:
        messages = [c.text(verdict.digits) for c in verdict.failures] if verdict is not None else []
    return TestRecord(
        test=test.test_id,
        status=status,
        nproc=tuple(spec.nproc),
        launcher=spec.launcher,
        limits=Limits(spec.max_mib, spec.max_ratio, spec.allow_mib, spec.rank, str(spec.tolerance),
                      str(spec.allocated_tolerance), spec.reference),
        sizes=tuple(sizes),
        provenance=dict(test.provenance),
        messages=tuple(messages),
        notes=tuple(verdict.notes) if verdict is not None else (),
        baseline_changes=tuple(changes),
        changed_since_baseline=tuple(changed),
        grown_sites=tuple(growth.grown) if growth is not None else (),
        grown_against=growth.against if growth is not None else "",
        sites_summary=growth.summary() if growth is not None else "",
        cause=cause,
    )


def _ratio_figure(results: Sequence[SizeResult], result: SizeResult, spec: Spec) -> str:
    one = next((r for r in results if r.world_size == spec.reference), None)
    if one is None or result.world_size <= spec.reference:
        return ""
    return ratio_figures(spec, one, result)[2]


def _allocated_reading(result: SizeResult, spec: Spec) -> float | None:
    """The gated rank's allocator figure, as an allocated limit reads it (None: there is none)."""
    _, mib, figure = result.read(spec.rank, "allocated")
    return round(mib, 2) if figure == "allocated" and mib is not None else None
