"""The ``max_ratio`` a healthy run suggests, printed by ``gpumem refresh``.

A job whose memory stays flat with N (data parallel) takes one cap; a job whose memory shrinks with N
(FSDP, ZeRO) takes a cap per size, since the cap its healthy 2 needs lets a regressed 8 through.
"""

from __future__ import annotations

import math

from ..config.spec import Ratio
from .record import TestRecord

# Added to each healthy ratio: the allocator and live-allocation figures read the same to 0.01 MiB
# across reruns (benchmarks/results/shrinking_ratio.txt: the ratio's spread over 20 reruns), so the
# headroom is for small, deliberate changes; a regression that keeps unsharded state moves 8's ratio
# by 0.03 or more on the smallest job measured.
HEADROOM = 0.02
FLAT_FROM = 0.9  # every ratio at least this: the job does not shrink, one cap fits every size


def measured_ratios(record: TestRecord) -> dict[int, float]:
    """The ratio at each listed size measured above the reference."""
    return {s.nproc: s.ratio for s in record.sizes
            if s.ratio is not None and not s.predicted and s.nproc in record.nproc}


def suggested_ratio(record: TestRecord) -> Ratio | None:
    """The caps that pass this run with ``HEADROOM``; None without a ratio above the reference."""
    ratios = measured_ratios(record)
    if not ratios:
        return None
    caps = {n: math.ceil(round((r + HEADROOM) * 100, 6)) / 100 for n, r in sorted(ratios.items())}
    if min(ratios.values()) >= FLAT_FROM:
        return Ratio(flat=max(caps.values()))
    return Ratio(sizes=tuple(caps.items()))

