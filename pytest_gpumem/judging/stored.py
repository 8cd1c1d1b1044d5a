"""The stored baselines one run is judged against: which entries compare with it (same platform,
same metric), at which tolerance, what to say of the missing ones; and a refresh that writes the
run's figures as the new entries. The gate asks; the store (``baseline.py``) reads and writes the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..config.settings import Settings
from ..config.spec import Tolerance
from ..launching.launched import TestRun
from ..results.size import ALLOCATED
from ..sampling.allocations import is_allocation_method
from ..sampling.identity import FAKE_KEY, SIMULATED_KEY, host_provenance
from . import growth
from .baseline import BaselineError, BaselineStore, Entry


@dataclass(frozen=True)
class Findings:
    """What one step of the gate found, as a value: failures, warnings and notes, which the gate
    gathers (no step fills a list it is handed)."""

    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __add__(self, other: Findings) -> Findings:
        return Findings(self.problems + other.problems, self.warnings + other.warnings, self.notes + other.notes)


class StoredBaselines:
    def __init__(self, settings: Settings, store: BaselineStore) -> None:
        self.settings = settings
        self.store = store

    def next_step(self, test_id: str) -> str:
        """What to do about a baseline file that cannot be used (it is never overwritten)."""
        file = self.store.file_for(test_id)
        if self.settings.refresh:
            return f"; fix what it names, or move {file} aside to record it anew, then refresh again"
        return f"; fix what it names, or restore it from version control (git checkout -- {file})"

    def comparable(self, test: TestRun) -> tuple[dict[int, Entry], Findings]:
        """Stored entries comparable with this run (same GPU model; host: same architecture), and
        what to say of the missing ones (or ones of another metric): a warning, or a failure in CI."""
        stored: dict[int, Entry] = {}
        missing: list[int] = []
        other_metric: list[str] = []
        platform = ""
        for result in test.results:
            if result.world_size not in test.spec.nproc or result.predicted:
                continue
            platform = result.platform
            entry = self.store.lookup(test.test_id, platform, result.world_size)
            measured = test.readings[result.world_size].method
            if entry is None:
                missing.append(result.world_size)
                continue
            if metric(entry.method) != metric(measured):  # never compared: the numbers mean different things
                other_metric.append(f"nproc={result.world_size} holds {entry.method!r}, this run measured "
                                    f"{measured!r}")
                continue
            stored[result.world_size] = entry
        where = f"{test.test_id} on {platform} in {self.store.file_for(test.test_id)}"
        refresh = f"`gpumem refresh {test.test_id}` and commit the file"
        found = Findings()
        if other_metric:
            found += self._unmatched(f"baseline of {where} was measured another way ({'; '.join(other_metric)}): "
                                     f"not compared; record it again with {refresh}", always_say=True)
        if missing:
            elsewhere = [p for p in self.store.platforms(test.test_id) if p != platform]
            if elsewhere:
                found += Findings(notes=(f"baselines exist only for other platforms ({', '.join(elsewhere)}); "
                                         f"not compared on {platform}",))
            found += self._unmatched(f"no baseline stored for {test.test_id} on {platform} at "
                                     f"nproc={', '.join(map(str, missing))} in {self.store.file_for(test.test_id)}: "
                                     f"record it with {refresh}")
        return stored, found

    def tolerance(self, test: TestRun, world_size: int, entry: Entry) -> tuple[Tolerance, str | None]:
        """The tolerance this size's baseline comparison uses, and a note where the reader should
        know why: the test's own, or for ``auto`` the exact one where the compared figure reads the
        same on every rerun (a host figure of live allocations, against a baseline from the same CPU
        model), else the moving one."""
        tolerance = test.spec.tolerance
        if not tolerance.auto:
            return tolerance, None
        result = next((r for r in test.results if r.world_size == world_size and not r.predicted), None)
        if result is None or result.device != "cpu" or entry.device != "cpu":
            return tolerance.resolve(exact=False), None  # a GPU's device figure moves between launches
        if not is_allocation_method(test.readings[world_size].method):
            return tolerance.resolve(exact=False), None  # a resident set wanders with the page cache
        here, there = test.provenance.get("cpu_model"), entry.provenance.get("cpu_model")
        if not (here and there):
            return tolerance.resolve(exact=False), None  # a CPU model unrecorded: it may be another one
        if here != there:
            loose = tolerance.resolve(exact=False)
            return loose, (f"the baseline was recorded on another CPU model ({there}; this run: {here}): compared "
                           f"at tolerance {loose}, the width MKL's code paths need between CPU models; "
                           f"`gpumem refresh` on this machine compares at {tolerance.resolve(exact=True)}")
        return tolerance.resolve(exact=True), None

    def fake_gpu_difference(self, test: TestRun) -> list[str]:
        """On a real GPU, where the same test has a fake GPU's baseline of this model (the CPU gate's):
        how far the fake figure was from this run's allocator figure, size by size."""
        parts: list[str] = []
        fake_platform = ""
        for result in test.results:
            if result.device != "gpu" or result.fake_gpu or result.predicted or not result.platform:
                continue
            fake_platform = result.platform.removesuffix(SIMULATED_KEY) + FAKE_KEY
            try:
                found = self.store.lookup(test.test_id, fake_platform, result.world_size)
            except BaselineError:
                return []  # the file's problem is reported where it is judged
            _, real, _ = test.readings[result.world_size].allocated
            if found is None or found.allocated_mib is None or real is None:
                continue
            fake = found.allocated_mib
            parts.append(f"nproc={result.world_size} {fake:.2f} vs {real:.2f} MiB "
                         f"({fake - real:+.2f}, {100 * (fake - real) / real:+.2f}%)" if real else
                         f"nproc={result.world_size} {fake:.2f} vs {real:.2f} MiB")
        if not parts:
            return []
        return [f"fake GPU vs this GPU: the {fake_platform} baseline's allocator figure vs this run's, "
                + "; ".join(parts)]

    def _unmatched(self, text: str, always_say: bool = False) -> Findings:
        """A size with no comparable baseline: a failure in CI (configurable), a warning otherwise."""
        mode = self.settings.fail_on_missing_baseline
        if mode:
            return Findings(problems=(text + " (fails when CI is set; gpumem_missing_baseline=warn to relax)",))
        return Findings(warnings=(text,)) if mode is False or always_say else Findings()

    def refresh(self, test: TestRun) -> dict[int, tuple[Entry | None, Entry]]:
        spec = test.spec
        # The ranks' own view (their env knobs, the frameworks they imported), not pytest's.
        provenance = {**host_provenance(os.environ), **test.provenance}
        by_platform: dict[str, dict[int, Entry]] = {}  # a simulated size is filed apart from real ones
        for result in test.results:
            reading = test.readings[result.world_size]
            gated, rank = reading.mib, reading.rank
            if result.world_size not in spec.nproc or gated is None or result.predicted:
                continue  # a predicted figure is never stored as a measurement
            entries = by_platform.setdefault(result.platform, {})
            _, allocated, figure = reading.allocated
            reserved = result.allocated.get(rank) if rank is not None else None
            sites = growth.stored_sites(result.sites.get(rank, ())) if rank is not None else []
            every = reading.every  # each rank is judged against its own figure: keep them all
            entries[result.world_size] = Entry(
                gated_mib=gated,
                ranks={r: p.mib for r, p in result.peaks.items() if p.mib is not None},
                rank=spec.rank,
                device=result.device,
                method=reading.method,
                provenance=provenance,
                allocated_mib=allocated if figure == ALLOCATED else None,
                reserved_mib=reserved.reserved_mib if reserved is not None else None,
                sites=tuple(sites),
                allocated_ranks={r: a.mib for r, a in result.allocated.items()} if every else {},
                rank_sites={r: tuple(growth.stored_sites(found)) for r, found in result.sites.items()
                            if r != rank and found} if every else {},
            )
        changes: dict[int, tuple[Entry | None, Entry]] = {}
        for platform, entries in by_platform.items():
            changes.update(self.store.update(test.test_id, platform, entries, merge=_steady_sites))
        return changes



def _steady_sites(old: Entry, new: Entry) -> Entry:
    """A refresh of an unchanged test rewrites no stored site (sizes within noise keep their value)."""
    def steady(rank: int, sites: tuple[dict, ...]) -> tuple[dict, ...]:
        before = old.sites_of(rank)
        return tuple(growth.steady(before, sites)) if before else sites

    gated = new.gated_rank
    return replace(new, sites=new.sites if gated is None else steady(gated, new.sites),
                   rank_sites={r: steady(r, sites) for r, sites in new.rank_sites.items()})


def metric(method: str) -> str:
    """What a figure measures: baselines are compared only within one metric."""
    if is_allocation_method(method):
        return "host live allocations"
    if method.startswith(("high-water mark", "rss")):
        return "host resident memory"
    return "gpu memory"  # per-pid, accounting and device figures are all what nvidia-smi shows
