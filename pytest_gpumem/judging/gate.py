"""One test's run -> its outcome: limits and stored baselines judged, baselines refreshed, the
failure explained. Plain Python: ``plugin.py`` only turns the outcome into pass, fail, skip and
warnings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ..config.settings import Settings
from ..config.spec import Spec, Tolerance
from ..launching.launched import TestRun
from ..results.provenance import CONFIG_PREFIX, config_provenance
from ..results.size import ALLOCATED
from ..sampling.allocations import is_allocation_method
from ..sampling.identity import FAKE_KEY, SIMULATED_KEY, host_provenance
from . import audit
from . import growth as growth_mod
from .assemble import build
from .baseline import BaselineError, BaselineStore, Entry
from .explain import explain_failure, hardware_change, provenance_diff
from .growth import grown_sites
from .record import BaselineChange, Cause, Status, TestRecord
from .verdict import BaselineRef, Verdict, judge


@dataclass
class Outcome:
    """What the user's session makes of one gpumem test."""

    record: TestRecord
    skip_reason: str | None = None
    failure: str | None = None  # the whole, self-contained message
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Findings:
    """What one step of the gate found, as a value: failures, warnings and notes, which the gate
    gathers (no step fills a list it is handed)."""

    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __add__(self, other: Findings) -> Findings:
        return Findings(self.problems + other.problems, self.warnings + other.warnings, self.notes + other.notes)


class Gate:
    def __init__(self, settings: Settings, store: BaselineStore) -> None:
        self.settings = settings
        self.store = store

    def before_launch(self, test_id: str, spec: Spec) -> Outcome | None:
        """What can be judged before a launch: the test's baseline file reads and validates. A
        broken file fails the test at once (named, with the field and what is accepted), not after
        every size has run; None: launch."""
        try:
            self.store.platforms(test_id)  # reads and validates the whole file
        except BaselineError as exc:
            what = "not refreshed (file left untouched)" if self.settings.refresh else "file unusable (left untouched)"
            message = (f"baseline {what}: {exc}{self._next_step(test_id)}\n"
                       "  (read before launching: no rank was started)")
            record = build(TestRun(test_id, spec), None, "failed", cause="baseline-error", messages=[message])
            return Outcome(record=record, failure=message)
        return None

    def _next_step(self, test_id: str) -> str:
        """What to do about a baseline file that cannot be used (it is never overwritten)."""
        file = self.store.file_for(test_id)
        if self.settings.refresh:
            return f"; fix what it names, or move {file} aside to record it anew, then refresh again"
        return f"; fix what it names, or restore it from version control (git checkout -- {file})"

    def evaluate(self, test: TestRun, relaunch: Callable[[TestRun, set[int]], TestRun] | None = None) -> Outcome:
        """Judge, refresh, explain. ``relaunch(test, sizes)``: where a failing GPU size has no peak
        sites (its allocator history was not recorded), the test with those sizes relaunched with
        it, judged again."""
        outcome = self._evaluate(test)
        if relaunch is not None and outcome.failure and (wanted := sites_wanted(test, outcome)):
            outcome = self._evaluate(relaunch(test, wanted))
        return outcome

    def _evaluate(self, test: TestRun) -> Outcome:
        spec = test.spec
        # What the marker declared, beside what the ranks reported: a judged copy, the run left as it was.
        test = replace(test, provenance={**test.provenance, **config_provenance(dict(spec.config)),
                                         "launcher": spec.launcher})
        problems = list(test.problems)
        cause: Cause | None = "crash" if problems else None  # the first problem's kind is the test's cause
        notes = [note for run in test.runs for note in run.notes]
        notes += [note for result in test.results for note in result.sites_notes]
        warnings: list[str] = []
        stored: dict[int, Entry] = {}
        changes: dict[int, tuple[Entry | None, Entry]] = {}
        verdict: Verdict | None = None
        if test.skip_reason is None and not problems and not self.settings.refresh:
            try:
                stored, found = self._baselines(test)
                problems += found.problems
                warnings += found.warnings
                notes += found.notes
            except BaselineError as exc:
                problems.append(f"baseline file unusable (left untouched): {exc}{self._next_step(test.test_id)}")
                cause = "baseline-error"
            cause = cause or ("baseline-missing" if problems else None)
        if test.skip_reason is None and not problems:
            notes.extend(self._fake_gpu_difference(test))
            tolerances = {n: self._tolerance(test, n, e) for n, e in stored.items()}
            notes += dict.fromkeys(note for _, note in tolerances.values() if note)  # each said once
            refs = {n: BaselineRef(e.gated_mib, tolerances[n][0], e.allocated_mib,
                                   spec.allocated_tolerance.resolve(exact=True), e.ranks, e.allocated_ranks,
                                   e.gated_rank)
                    for n, e in stored.items()}
            verdict = judge(spec, test.results, refs, tuple(notes), test.readings)
            if self.settings.refresh:
                try:
                    changes = self._refresh(test)
                except BaselineError as exc:
                    problems.append(f"baseline not refreshed (file left untouched): {exc}"
                                    f"{self._next_step(test.test_id)}")
                    cause = cause or "baseline-error"
        if test.unlaunched and test.skip_reason is None and not problems:
            found = self._unlaunched(test)
            problems += found.problems
            warnings += found.warnings
            cause = cause or ("limit" if problems else None)
        changed: list[str] = []
        if stored:
            entry = next(iter(stored.values()))
            declared = provenance_diff(entry.provenance, test.provenance)
            config = [line for line in declared if line.startswith(CONFIG_PREFIX)]  # the test's own choice
            changed = list(dict.fromkeys(config + hardware_change(entry, test.provenance) + declared))
        grown = grown_sites(test, verdict, stored) if verdict is not None and not verdict.passed else None
        status = _status(test, verdict, problems)
        rec = build(test, verdict, status, cause=(cause or "limit") if status == "failed" else None,
                    baselines={n: e.gated_mib for n, e in stored.items()},
                    allocated_baselines={n: e.allocated_mib for n, e in stored.items() if e.allocated_mib is not None},
                    changes=[BaselineChange(n, old.gated_mib if old else None, new.gated_mib)
                             for n, (old, new) in sorted(changes.items())],
                    changed=changed, messages=problems or None, growth=grown,
                    conversions=audit.record_lines(test, verdict, stored))
        outcome = Outcome(record=rec, skip_reason=test.skip_reason, warnings=warnings)
        if test.skip_reason is not None:
            return outcome
        if problems:
            outcome.failure = "\n".join(problems)
        elif verdict is not None and not verdict.passed:
            outcome.failure = explain_failure(test, verdict, changed, stored, grown)
        elif verdict is not None:
            outcome.warnings.extend(verdict.notes)  # improvements, foreign GPU users
            outcome.warnings.extend(f"predicted, not validated: would exceed: {check}"
                                    for check in verdict.advisories)
        return outcome

    def _baselines(self, test: TestRun) -> tuple[dict[int, Entry], Findings]:
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

    def _tolerance(self, test: TestRun, world_size: int, entry: Entry) -> tuple[Tolerance, str | None]:
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

    def _fake_gpu_difference(self, test: TestRun) -> list[str]:
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

    def _unlaunched(self, test: TestRun) -> Findings:
        """Sizes neither launched, simulated nor predicted: shown always; where nothing above
        nproc=1 was gated, a failure in CI (gpumem_unlaunched), since a regression there would pass."""
        text = "; ".join(f"nproc={n} not launched: {why}" for n, why in sorted(test.unlaunched.items()))
        gated = any(n > 1 and reading.mib is not None for n, reading in test.readings.items())
        if not gated and self.settings.fail_on_unlaunched:
            return Findings(problems=(f"gpumem: nothing above nproc=1 was gated: {text} (fails when CI is set; "
                                      "gpumem_unlaunched=warn accepts it, simulate='auto' runs torch sizes as a "
                                      "simulated world)",))
        return Findings(warnings=(text,))

    def _unmatched(self, text: str, always_say: bool = False) -> Findings:
        """A size with no comparable baseline: a failure in CI (configurable), a warning otherwise."""
        mode = self.settings.fail_on_missing_baseline
        if mode:
            return Findings(problems=(text + " (fails when CI is set; gpumem_missing_baseline=warn to relax)",))
        return Findings(warnings=(text,)) if mode is False or always_say else Findings()

    def _refresh(self, test: TestRun) -> dict[int, tuple[Entry | None, Entry]]:
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
            sites = growth_mod.stored_sites(result.sites.get(rank, ())) if rank is not None else []
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
                rank_sites={r: tuple(growth_mod.stored_sites(found)) for r, found in result.sites.items()
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
        return tuple(growth_mod.steady(before, sites)) if before else sites

    gated = new.gated_rank
    return replace(new, sites=new.sites if gated is None else steady(gated, new.sites),
                   rank_sites={r: steady(r, sites) for r, sites in new.rank_sites.items()})


def sites_wanted(test: TestRun, outcome: Outcome) -> set[int]:
    """GPU sizes whose failure would be explained by peak sites they do not have (and the ratio's
    reference for a scaling failure, the sites they are compared with)."""
    if test.problems or outcome.record.status in ("ERROR", "skip"):
        return set()
    failing = {s.nproc for s in outcome.record.sizes if s.failed and not s.predicted}
    by_size = {r.world_size: r for r in test.results if not r.predicted}
    wanted = {n for n in failing if n in by_size}
    ref = test.spec.reference
    if any(c.kind == "max_ratio" and not c.ok for s in outcome.record.sizes for c in s.checks) and ref in by_size:
        wanted.add(ref)
    return {n for n in wanted if by_size[n].device == "gpu" and not by_size[n].sites}


def metric(method: str) -> str:
    """What a figure measures: baselines are compared only within one metric."""
    if is_allocation_method(method):
        return "host live allocations"
    if method.startswith(("high-water mark", "rss")):
        return "host resident memory"
    return "gpu memory"  # per-pid, accounting and device figures are all what nvidia-smi shows


def _status(test: TestRun, verdict: Verdict | None, problems: Sequence[str], unjudged: Status = "passed") -> Status:
    """pytest's word for the test (``unjudged``: where no limit was given); its cause is decided beside it."""
    if test.skip_reason is not None:
        return "skipped"
    if problems or verdict is None or not verdict.passed:
        return "failed"
    judged = any(check.kind in ("max_mib", "max_ratio", "baseline") for check in verdict.checks)
    return "passed" if judged else unjudged


def measured(test: TestRun) -> tuple[TestRecord, list[str]]:
    """``gpumem measure``'s record, its limits judged (a program has no baseline), and what to say if it failed."""
    verdict = judge(test.spec, test.results, readings=test.readings) if test.results and not test.problems else None
    status = _status(test, verdict, test.problems, unjudged="measured")
    cause: Cause | None = None if status != "failed" else "crash" if test.problems or verdict is None else "limit"
    rec = build(test, verdict, status, cause=cause,
                messages=list(test.problems) + ([test.skip_reason] if test.skip_reason else []))
    return rec, list(rec.messages) or [str(c) for c in (verdict.failures if verdict else [])]
