"""Why did it inflate? What changed since the baseline, and when in the run each rank peaked.

In the motivating cases the hard part was the explanation: which framework commit, which flag
(activation checkpointing), which rank. A failing test answers those itself.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..launching.launched import TestRun
from ..oneflow.conversions import PROVENANCE_PREFIX as EAGER_PREFIX
from ..results.provenance import CONFIG_PREFIX
from ..results.size import SizeResult
from . import audit
from .baseline import Entry
from .growth import Growth, sites_size
from .verdict import DIGITS, Verdict, mib

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


def higher_rank(verdict: Verdict, rank: int | str) -> list[str]:
    """Where a rank other than the gated one peaked higher at a failing size: by how much, and the
    argument that gates it (the gated rank alone may hide the largest figure)."""
    if rank == "all":
        return []
    lines = []
    for result in verdict.results:
        if result.world_size not in {c.world_size for c in verdict.failures} or result.predicted:
            continue
        gated = result.peaks.get(int(rank))
        others = [(p.mib, r) for r, p in result.peaks.items() if r != int(rank) and p.mib is not None]
        if gated is None or gated.mib is None or not others:
            continue
        top, top_rank = max(others)
        if top - gated.mib >= max(1.0, 0.01 * gated.mib):  # above the noise of equal ranks
            above = mib(top - gated.mib, verdict.digits)
            lines.append(f"  rank {top_rank} peaked {above} MiB above the gated rank {rank} at "
                         f"nproc={result.world_size} ({mib(top, verdict.digits)} MiB): "
                         f'gate it with rank={top_rank} or rank="all"')
    return lines


def explain_failure(test: TestRun, verdict: Verdict, changed: list[str], stored: dict[int, Entry],
                    grown: Growth | None = None) -> str:
    """The failed limits; the peak sites that grew (the line that holds the memory); the verdict;
    what differs from the baseline's provenance (the machine first); when each rank peaked; the
    new nn.Graph boxing; where the torch snapshots are."""
    sites: list[str] = []
    if grown is not None and (grown.grown or grown.summary()):
        size = sites_size(verdict, {r.world_size: r for r in test.results if not r.predicted})
        if grown.of:  # rank="all": the rank that grew most over its own baseline
            sites.append(f"  peak sites of {grown.of} at nproc={size} that grew since its baseline:")
        elif test.spec.rank == "all":  # the largest rank, which may not be the reference's
            label = next((c.rank_label for c in verdict.failures if c.world_size == size), "the largest rank")
            sites.append(f"  peak sites of {label} at nproc={size} that grew since {grown.against}:")
        else:
            sites.append(f"  peak sites that grew since {grown.against} (rank {test.spec.rank}, nproc={size}):")
        sites.extend(f"    {line}" for line in grown.lines())
    changed = changed or (hardware_change(next(iter(stored.values())), test.provenance) if stored else [])
    lead: list[str] = []  # what changed, right under the headline: often the whole answer
    if changed:
        lead.append(f"  changed since the baseline: {changed[0]}")
        lead.extend(f"    {line}" for line in changed[1:])
        if any(line.startswith(("nvidia_driver", "cuda_driver", "torch_cuda")) for line in changed):
            lead.append("    (the CUDA context, part of every rank's device figure, changes size with the driver: "
                        "compare the floor; if the job's own part did not move, refresh the baseline here)")
    failing = {check.world_size for check in verdict.failures}
    lines = [verdict.render(lead + audit.eager_section(test, failing, stored) + higher_rank(verdict, test.spec.rank)
                            + sites)]
    lines.append("  per-rank peaks over the run:")
    lines.extend(f"    {line}" for line in timeline_lines(verdict.results, verdict.digits))
    lines.extend(audit.graph_section(test, verdict, stored))
    snapshots = [f"    nproc={run.launch.nproc} rank {rank}: {path}" for run in test.runs
                 if run.launch.nproc in failing for rank, path in sorted(run.snapshots.items())]
    if snapshots:
        lines.append("  torch memory snapshots (pytorch.org/memory_viz):")
        lines.extend(snapshots)
    if any(check.kind == "baseline" for check in verdict.failures):
        lines.append(f"  if the growth is intended: `gpumem refresh {test.test_id}` records the new figure; "
                     "commit the baseline file with the change")
    return "\n".join(lines)


_MACHINE_KEYS = ("cpu_model", "nvidia_driver", "cuda_driver", "torch_cuda")  # read first when a figure moved


def hardware_change(entry: Entry, provenance: dict[str, str]) -> list[str]:
    """``cpu_model AMD EPYC -> Intel Xeon`` lines for the machine facts that differ from the
    baseline's: listed first, since a figure compared across machines moves with them."""
    old = entry.provenance
    return [f"{key}: {old[key]} -> {provenance.get(key, '(unknown)')}" for key in _MACHINE_KEYS
            if key in old and old[key] != provenance.get(key)] + [
        f"{key}: {old[key]} -> {provenance.get(key, '(unknown)')}" for key in sorted(old)
        if key.startswith("cpu_") and key not in _MACHINE_KEYS and old[key] != provenance.get(key)]
