"""Which peak sites grew: the answer to "which code holds the extra memory?".

Against nproc=1 for a scaling failure (the seeds' case: what exists at 8 ranks that did not at 1),
against the baseline's stored sites for a baseline failure. Sites of the user's code that grew or
are new are listed, largest first; the ones that shrank and the framework's internals are summed
into one sentence, so that the list starts with the line to read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..results.size import SizeResult
from ..sampling.sites import INTERNALS, NATIVE, Site, from_dicts
from .baseline import Entry
from .record import SiteChange
from .verdict import Verdict

if TYPE_CHECKING:
    from ..launching.launched import TestRun

LISTED_MIB = 1.5  # a site must grow by this much to be listed: below it, a pymalloc arena's MiB
LISTED = 8  # at most this many lines; the rest is summed
STORED = 8  # user sites a baseline keeps (plus the internals' and native sums)


@dataclass(frozen=True)
class Growth:
    against: str  # "nproc=1", "the baseline", "the baseline of rank 3"
    grown: tuple[SiteChange, ...]
    unlisted_mib: float = 0.0  # smaller growths of user sites
    unlisted: int = 0
    shrunk_mib: float = 0.0
    shrunk: int = 0
    internal_mib: float = 0.0  # change of the framework's own Python code
    native_mib: float = 0.0  # change of allocations with no Python stack (a framework's worker threads)
    of: str = ""  # whose sites, where not the gated rank's: "rank 3" (rank="all", against its own baseline)
    internals_kept: str = ""  # what keeps the framework internals' largest share alive (Site.kept_alive_by)

    def summary(self) -> str:
        """``3 smaller sites +2.1 MiB; 2 sites shrank by 12.0 MiB; framework internals +4.1 MiB``."""
        parts = []
        if self.unlisted:
            parts.append(f"{self.unlisted} smaller site{'s' if self.unlisted > 1 else ''} {self.unlisted_mib:+.1f} MiB")
        if self.shrunk:
            parts.append(f"{self.shrunk} site{'s' if self.shrunk > 1 else ''} shrank by {-self.shrunk_mib:.1f} MiB")
        if abs(self.internal_mib) >= 0.05:
            kept = f", kept alive by {self.internals_kept}" if self.internals_kept and self.internal_mib > 0 else ""
            parts.append(f"framework internals and allocations under 4 KiB {self.internal_mib:+.1f} MiB{kept}")
        if abs(self.native_mib) >= 0.05:
            parts.append(f"native code {self.native_mib:+.1f} MiB (no Python stack: allocated on a framework's "
                         "own threads, e.g. gloo's or OneFlow's VM workers)")
        return "; ".join(parts)

    def lines(self, limit: int = LISTED) -> list[str]:
        """Each grown site (where it was allocated, then the user frames it was called from), then
        the summary of the rest."""
        lines = [line for change in self.grown[:limit] for line in change.lines()]
        summary = self.summary()
        return lines + ([f"({summary})"] if summary else [])


def site_growth(old: Sequence[Site], new: Sequence[Site], against: str, old_complete: bool = True) -> Growth:
    """Sites of ``new`` against ``old``. ``old_complete=False`` (a baseline keeps only its top sites):
    a site absent from ``old`` is compared with the smallest stored one, not with nothing."""
    before = {s.key: s for s in old if not s.internal}
    floor = 0.0 if old_complete or not before else min(s.mib for s in before.values())
    grown: list[SiteChange] = []
    unlisted_mib = shrunk_mib = 0.0
    unlisted = shrunk = 0
    users = [site for site in new if not site.internal]
    matched = [before.pop(site.key, None) for site in users]
    # An edit above a line moves it: a site unmatched by file:line is the stored one of the same file,
    # function and call when exactly one such is left (two candidates: ambiguous, not matched).
    moved: dict[tuple[str, str, str], list[Site]] = {}
    for left in before.values():
        moved.setdefault(_unlined(left), []).append(left)
    for i, site in enumerate(users):
        candidates = moved.get(_unlined(site), [])
        if matched[i] is None and len(candidates) == 1:
            same = candidates.pop()
            matched[i] = same
            del before[same.key]
    for site, was in zip(users, matched):
        old_mib = was.mib if was is not None else min(floor, site.mib)
        delta = site.mib - old_mib
        if delta >= LISTED_MIB:
            grown.append(SiteChange(site.label(), old_mib, site.mib, site.callers, site.chains, site.kept_alive_by()))
        elif delta > 0.05:
            unlisted, unlisted_mib = unlisted + 1, unlisted_mib + delta
        elif delta < -0.05:
            shrunk, shrunk_mib = shrunk + 1, shrunk_mib + delta
    for gone in before.values():  # user sites that were live at the old peak and are not now
        shrunk, shrunk_mib = shrunk + 1, shrunk_mib - gone.mib
    def total(sites: Sequence[Site], native: bool) -> float:  # the small allocations count as internals
        return sum(s.mib for s in sites if s.internal and (s.where == NATIVE) == native)

    grown.sort(key=lambda c: (-c.growth, c.label))
    internals_kept = next((s.kept_alive_by() for s in new if s.where == INTERNALS and s.held_by), "")
    return Growth(against, tuple(grown), unlisted_mib, unlisted, shrunk_mib, shrunk,
                  total(new, False) - total(old, False), total(new, True) - total(old, True),
                  internals_kept=internals_kept)


def _unlined(site: Site) -> tuple[str, str, str]:
    """The site's key without its line number: file, function, the framework call made there."""
    return (site.where.rsplit(":", 1)[0], site.function, site.detail)


def stored_sites(sites: Iterable[Site]) -> list[dict[str, Any]]:
    """What a baseline keeps: the top user sites and the internals' sums, sizes to 0.1 MiB (where
    each was allocated; not the callers, which are shown, not compared)."""
    sites = list(sites)
    users = [s for s in sites if not s.internal][:STORED]
    kept = users + [s for s in sites if s.internal]
    return [{key: value for key, value in {**s.as_dict(), "mib": round(s.mib, 1)}.items()
             if key not in ("called_from", "chains", "held_by")} for s in kept]


def steady(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A refresh keeps a stored site's size when it moved by less than rerun noise, so an unchanged
    test rewrites no site: ``max(1 MiB, 2%)``. New, gone and moved sites are rewritten."""
    before = {s.key: s for s in from_dicts(old)}
    out = []
    for raw, site in zip(new, from_dicts(new)):
        was = before.get(site.key)
        if was is not None and abs(site.mib - was.mib) <= max(1.0, 0.02 * was.mib):
            out.append({**raw, "mib": round(was.mib, 1), "count": was.count})
        else:
            out.append(dict(raw))
    return out


def sites_size(verdict: Verdict, launched: Mapping[int, Any]) -> int:
    """The size whose grown sites explain the failure: the headline's (the check furthest over its
    limit), else the largest failing size launched (a predicted failure), else the largest launched."""
    failing = [verdict.worst.world_size, *sorted({c.world_size for c in verdict.failures}, reverse=True)]
    return next((n for n in failing if n in launched), max(launched, default=0))


def grown_sites(test: TestRun, verdict: Verdict, stored: dict[int, Entry]) -> Growth | None:
    """The gated rank's peak sites that grew at the failing size: against the ratio's reference (nproc=1
    unless the marker names one) for a scaling failure, against the baseline's sites for a baseline
    failure (see judging/growth.py)."""
    by_size = {r.world_size: r for r in test.results if not r.predicted}
    if not by_size or not verdict.failures:
        return None
    size = sites_size(verdict, by_size)
    result = by_size[size]
    kinds = {c.kind for c in verdict.failures if c.world_size == size}
    entry = stored.get(size)
    reading = test.readings[size]
    if reading.every and "baseline" in kinds and entry is not None:
        own = _most_grown_rank(result, entry)
        if own is not None:
            return own
    rank = reading.rank
    new = result.sites.get(rank) if rank is not None else None
    if not new:
        return None
    ref = test.spec.reference
    one = by_size.get(ref)
    if "baseline" in kinds and entry is not None and entry.sites:
        return _against_baseline(entry, new)
    # The same rank at the reference; for rank="all" the reference's largest (a relaunch records it).
    ref_rank = test.readings[ref].rank if one is not None else None
    if size > ref and one is not None and ref_rank is not None and one.sites.get(ref_rank):
        against = f"nproc={ref}" if ref_rank == rank else f"rank {ref_rank} (largest) at nproc={ref}"
        return site_growth(one.sites[ref_rank], new, against)
    if entry is not None and entry.sites:
        return _against_baseline(entry, new)
    return None


def _against_baseline(entry: Entry, new: tuple, rank: int | None = None) -> Growth:
    old = from_dicts(entry.sites if rank is None else entry.sites_of(rank))
    complete = sum(not s.internal for s in old) < STORED  # else smaller sites were cut
    against = "the baseline" if rank is None else f"the baseline of rank {rank}"
    growth = site_growth(old, new, against, old_complete=complete)
    return growth if rank is None else replace(growth, of=f"rank {rank}")


def _most_grown_rank(result: SizeResult, entry: Entry) -> Growth | None:
    """Under rank="all", the sites of the rank that grew most over its own stored figure (the
    allocator's where both have it), against its own stored sites: a middle pipeline stage's line,
    not the largest rank's."""
    def growth(rank: int) -> float:
        now, then = result.allocated.get(rank), entry.allocated_ranks.get(rank)
        if now is not None and then is not None:
            return now.mib - then
        peak = result.peaks.get(rank)
        return (peak.mib or 0.0) - entry.ranks[rank] if peak is not None and rank in entry.ranks else float("-inf")

    ranks = [r for r in result.sites if result.sites[r] and entry.sites_of(r)]
    if not ranks:
        return None
    rank = max(ranks, key=lambda r: (growth(r), -r))
    return _against_baseline(entry, result.sites[rank], rank)
