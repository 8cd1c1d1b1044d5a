"""A test's record assembled from its run and its verdict: the one place that derives these facts.

From here on nothing is judged again: every output renders the :class:`~.record.TestRecord`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from ..results.size import GatedReading
from .explain import imbalance, peak_times
from .growth import Growth
from .record import BaselineChange, Cause, SizeRecord, Status, TestRecord
from .verdict import Check, Verdict, ratio_figures

if TYPE_CHECKING:
    from ..config.spec import Spec
    from ..launching.launched import TestRun


def build(test: TestRun, verdict: Verdict | None, status: Status, *, cause: Cause | None = None,
          baselines: Mapping[int, float] | None = None, allocated_baselines: Mapping[int, float] | None = None,
          changes: Sequence[BaselineChange] = (), changed: Sequence[str] = (),
          messages: Sequence[str] | None = None, growth: Growth | None = None,
          conversions: Sequence[str] = ()) -> TestRecord:
    """The record of one test, from its run and its verdict: the one place that derives these facts."""
    spec = test.spec
    checks: dict[int, list[Check]] = {}
    for check in verdict.checks if verdict is not None else ():
        checks.setdefault(check.world_size, []).append(check)
    sizes = []
    readings = verdict.readings if verdict is not None else test.readings
    for result in test.results:
        n = result.world_size
        reading = readings[n]
        sizes.append(SizeRecord(
            measured=result,
            gated_rank=reading.rank,
            gated_label=reading.label,
            gated_mib=reading.mib,
            checks=tuple(checks.get(n, ())),
            ratio=verdict.ratio(n) if verdict is not None else None,
            ratio_figure=_ratio_figure(readings, n, spec) if verdict is not None else "",
            baseline_mib=(baselines or {}).get(n),
            others_max_mib=reading.others_mib,
            peak_at_s={r: round(t, 3) for r, t in sorted(peak_times(result).items())},
            imbalance=imbalance(result),
            allocated_mib=_allocated_reading(reading),
            allocated_baseline_mib=(allocated_baselines or {}).get(n),
        ))
    if messages is None:
        messages = ([c.text(verdict.digits) for c in sorted(verdict.failures, key=lambda c: c is not verdict.worst)]
                    if verdict is not None else [])  # the headline's check first
    return TestRecord(
        test=test.test_id,
        status=status,
        spec=spec,
        sizes=tuple(sizes),
        provenance=dict(test.provenance),
        messages=tuple(messages),
        notes=tuple(verdict.notes) if verdict is not None else (),
        baseline_changes=tuple(changes),
        changed_since_baseline=tuple(changed),
        grown_sites=tuple(growth.grown) if growth is not None else (),
        grown_against=growth.against if growth is not None else "",
        sites_summary=growth.summary() if growth is not None else "",
        conversions=tuple(conversions),
        cause=cause,
    )


def _ratio_figure(readings: Mapping[int, GatedReading], world_size: int, spec: Spec) -> str:
    one = readings.get(spec.reference)
    return ratio_figures(spec, one, readings[world_size])[2] if one and world_size > spec.reference else ""


def _allocated_reading(reading: GatedReading) -> float | None:
    """The gated rank's allocator figure, as an allocated limit reads it (None: there is none)."""
    _, mib, figure = reading.allocated
    return round(mib, 2) if figure == "allocated" and mib is not None else None
