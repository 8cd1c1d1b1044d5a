"""Why did it inflate? What changed since the baseline, and when in the run each rank peaked.

In the motivating cases the hard part was the explanation: which framework commit, which flag
(activation checkpointing), which rank. A failing test answers those itself.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..measurement.provenance import CONFIG_PREFIX
from ..measurement.size import SizeResult
from ..oneflow.conversions import PROVENANCE_PREFIX as EAGER_PREFIX
from .verdict import DIGITS, mib

BOXING_PREFIX = "boxing."  # shown on their own, with the tensors involved (boxing.explain)
_AUDITS = (BOXING_PREFIX, EAGER_PREFIX)  # the conversion audits: shown in their own sections
_IGNORED = {"date"}


def _rank(key: str) -> int:
    """Declared config first, then frameworks and versions, then the environment knobs."""
    if key.startswith(CONFIG_PREFIX):
        return 0
    if key.startswith("env."):
        return 2
    return 1


def provenance_diff(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """``config.activation_checkpoint: True -> False`` lines, declared config first."""
    keys = sorted((k for k in (set(old) | set(new)) - _IGNORED if not k.startswith(_AUDITS)),
                  key=lambda k: (_rank(k), k))
    lines = []
    for key in keys:
        before, after = old.get(key), new.get(key)
        if before != after:
            lines.append(f"{key}: {'(unset)' if before is None else before} -> "
                         f"{'(unset)' if after is None else after}")
    return lines


def peak_times(result: SizeResult) -> dict[int, float]:
    """When each rank's gated figure was highest (seconds since the launch started): on the host its
    live heap where it was tracked (resident memory peaks later, and is not what is gated), else the
    sampled figure (on a GPU, NVML's: the device figure)."""
    timeline = result.live_timeline if result.device == "cpu" and result.live_timeline else result.timeline
    best: dict[int, tuple[float, float]] = {}
    for t, point in timeline:
        for rank, value in point.items():
            if rank not in best or value > best[rank][0]:
                best[rank] = (value, t)
    return {rank: t for rank, (_, t) in best.items()}


def imbalance(result: SizeResult) -> float | None:
    """(largest - smallest) / largest rank peak: a rank that holds more than its peers stands out."""
    values = [p.mib for p in result.peaks.values() if p.mib is not None]
    if len(values) < 2 or max(values) <= 0:
        return None
    return (max(values) - min(values)) / max(values)


def timeline_lines(results: Iterable[SizeResult], digits: int = DIGITS) -> list[str]:
    """Per world size: each rank's peak and when it happened, and the imbalance between ranks (the
    peaks at ``digits`` decimals: those of the verdict they are printed under)."""
    lines = []
    for result in results:
        if result.reused or result.predicted:  # a predicted size never ran: no timeline
            continue
        times = peak_times(result)
        cells = []
        for rank, peak in sorted(result.peaks.items()):
            if peak.mib is None:
                cells.append(f"rank {rank} n/a")
                continue
            at = f" at {times[rank]:.2f}s" if rank in times else ""
            cells.append(f"rank {rank} {mib(peak.mib, digits)} MiB{at}")
        spread = imbalance(result)
        tail = f"; imbalance {spread * 100:.1f}%" if spread is not None else ""
        lines.append(f"nproc={result.world_size} ({result.duration_s:.1f} s): " + ", ".join(cells) + tail)
    return lines
