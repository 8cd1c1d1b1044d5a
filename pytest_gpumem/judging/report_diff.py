"""``gpumem diff`` judged: two reports' records compared size by size, by the baseline gate's rule.

What is a regression is decided here; ``presentation.outputs`` only renders the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, get_args

from ..config.spec import Tolerance, parse_tolerance
from ..sampling.allocations import is_allocation_method
from .growth import Growth, site_growth
from .record import SizeRecord, TestRecord
from .verdict import against_reference


def delta(new: float | None, old: float | None) -> tuple[float, float | None] | None:
    """(new - old in MiB, in percent of old); the percentage is None when old is 0."""
    if not _finite(new) or not _finite(old):
        return None
    assert new is not None and old is not None
    return new - old, ((new - old) / old * 100.0 if old else None)


def _finite(value: float | None) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Order of a diff's rows: what fails the gate first.
DiffKind = Literal["regression", "unmeasured", "device changed", "predicted on one side", "improved", "unchanged",
                   "added", "removed"]
KINDS: tuple[DiffKind, ...] = get_args(DiffKind)


@dataclass(frozen=True)
class DiffRow:
    """One test at one world size, old report vs new."""

    test: str
    nproc: int
    old_mib: float | None
    new_mib: float | None
    kind: DiffKind
    allowance_mib: float | None = None
    tolerance: str = ""
    device: str = ""
    growth: Growth | None = None  # a regression's peak sites that grew, largest first, as a failure names them
    figure: str = ""  # "allocated": the GPU allocator's figure, compared at its own tolerance

    @property
    def change(self) -> tuple[float, float | None] | None:
        return delta(self.new_mib, self.old_mib)


@dataclass(frozen=True)
class ReportDiff:
    rows: tuple[DiffRow, ...]

    @property
    def regressions(self) -> list[DiffRow]:
        return [row for row in self.rows if row.kind == "regression"]

    def count(self, kind: DiffKind) -> int:
        return sum(1 for row in self.rows if row.kind == kind)

    def summary(self) -> str:
        """``1 regression, 3 unchanged, 1 added``; only the kinds present."""
        parts = [f"{n} {kind}" + ("s" if kind == "regression" and n != 1 else "")
                 for kind in KINDS if (n := self.count(kind))]
        return ", ".join(parts) or "nothing to compare"


def _by_size(records: Iterable[TestRecord]) -> dict[tuple[str, int], tuple[TestRecord, SizeRecord]]:
    return {(rec.test, size.nproc): (rec, size) for rec in records for size in rec.sizes}


def _tolerance_of(old: tuple[TestRecord, SizeRecord], new: tuple[TestRecord, SizeRecord],
                  override: Tolerance | None) -> Tolerance:
    """``--tolerance``, else the new report's; ``auto`` is exact where the gate's would be: host
    figures of live allocations, both reports from the same CPU model."""
    if override is not None:
        return override
    (old_rec, old_size), (new_rec, new_size) = old, new
    tolerance = new_rec.spec.tolerance
    cpu = new_rec.provenance.get("cpu_model")
    exact = (new_size.device == "cpu" and bool(cpu) and cpu == old_rec.provenance.get("cpu_model")
             and all(_live(size) for size in (old_size, new_size)))
    return tolerance.resolve(exact)


def _live(size: SizeRecord) -> bool:
    peak = size.measured.peaks.get(size.gated_rank) if size.gated_rank is not None else None
    return peak is not None and is_allocation_method(peak.method)


def _diff_row(key: tuple[str, int], old: tuple[TestRecord, SizeRecord] | None,
              new: tuple[TestRecord, SizeRecord] | None, override: Tolerance | None) -> DiffRow:
    test, nproc = key
    if old is None:
        assert new is not None
        return DiffRow(test, nproc, None, new[1].gated_mib, "added", device=new[1].device)
    if new is None:
        return DiffRow(test, nproc, old[1].gated_mib, None, "removed", device=old[1].device)
    (_, old_size), (_, new_size) = old, new
    old_mib, new_mib, device = old_size.gated_mib, new_size.gated_mib, new_size.device
    if old_size.device != new_size.device:
        return DiffRow(test, nproc, old_mib, new_mib, "device changed", device=f"{old_size.device} -> {device}")
    if old_size.predicted != new_size.predicted:  # a fit is no measurement
        return DiffRow(test, nproc, old_mib, new_mib, "predicted on one side", device=device)
    if old_mib is None or new_mib is None:
        return DiffRow(test, nproc, old_mib, new_mib, "unmeasured", device=device)
    tolerance = _tolerance_of(old, new, override)
    kind, allowance = against_reference(new_mib, old_mib, tolerance)  # the baseline gate's own rule
    sites = _grown_sites(old_size, new_size) if kind == "regression" else None
    return DiffRow(test, nproc, old_mib, new_mib, kind, allowance, str(tolerance), device, sites)


def _allocated_row(key: tuple[str, int], old: tuple[TestRecord, SizeRecord] | None,
                   new: tuple[TestRecord, SizeRecord] | None) -> DiffRow | None:
    """The allocator figure of a GPU size, where both reports have it, at the allocator tolerance."""
    if old is None or new is None:
        return None
    (_, old_size), (new_rec, new_size) = old, new
    before, after = old_size.allocated_mib, new_size.allocated_mib
    if before is None or after is None:
        return None
    tolerance = new_rec.spec.allocated_tolerance.resolve(exact=True)
    kind, allowance = against_reference(after, before, tolerance)
    sites = _grown_sites(old_size, new_size) if kind == "regression" else None
    return DiffRow(key[0], key[1], before, after, kind, allowance, str(tolerance), new_size.device, sites,
                   "allocated")


def _fake_on_both_sides(old: tuple[TestRecord, SizeRecord] | None,
                        new: tuple[TestRecord, SizeRecord] | None) -> bool:
    """A fake GPU has one figure, the allocator's: its size is compared once, at that figure's tolerance."""
    return old is not None and new is not None and bool(old[1].measured.fake_gpu and new[1].measured.fake_gpu)


def _grown_sites(old: SizeRecord, new: SizeRecord) -> Growth | None:
    """The gated rank's peak sites that grew from the old report to the new one."""
    before = old.measured.sites.get(old.gated_rank) if old.gated_rank is not None else None
    after = new.measured.sites.get(new.gated_rank) if new.gated_rank is not None else None
    if not before or not after:
        return None
    return site_growth(before, after, "old")


def diff_reports(old: Iterable[TestRecord], new: Iterable[TestRecord],
            tolerance: Tolerance | str | None = None) -> ReportDiff:
    """Per (test, nproc): gated peak old -> new, judged by the baseline gate's rule
    (:func:`verdict.against_reference`): a regression is new > old + tolerance.allowance(old).

    ``tolerance=None`` uses each test's own tolerance (from the new report), as its baseline check
    does. Sizes in only one report are ``added``/``removed``; a size whose gated device changed
    (GPU vs host memory) is not compared, nor one predicted on one side and launched on the other;
    a size not measured on one side is ``unmeasured``.
    """
    override = parse_tolerance(tolerance) if tolerance is not None else None
    old_sizes, new_sizes = _by_size(old), _by_size(new)
    keys = set(old_sizes) | set(new_sizes)
    rows = []
    for key in keys:
        before, after = old_sizes.get(key), new_sizes.get(key)
        allocated = _allocated_row(key, before, after)
        if allocated is None or not _fake_on_both_sides(before, after):
            rows.append(_diff_row(key, before, after, override))
        if allocated is not None:
            rows.append(allocated)
    rows.sort(key=lambda r: (KINDS.index(r.kind), r.test, r.nproc, r.figure))
    return ReportDiff(tuple(rows))
