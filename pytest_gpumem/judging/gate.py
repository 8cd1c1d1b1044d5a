"""One test's run -> its outcome: limits and stored baselines judged, baselines refreshed, the
failure explained. Plain Python: ``plugin.py`` only turns the outcome into pass, fail, skip and
warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ..config.settings import Settings
from ..config.spec import Spec
from ..launching.launched import TestRun
from ..results.provenance import CONFIG_PREFIX, config_provenance
from . import audit
from .assemble import build
from .baseline import BaselineError, BaselineStore, Entry
from .explain import explain_failure, hardware_change, provenance_diff
from .growth import grown_sites
from .record import BaselineChange, Cause, Status, TestRecord
from .stored import Findings, StoredBaselines
from .verdict import BaselineRef, Verdict, judge


@dataclass
class Outcome:
    """What the user's session makes of one gpumem test."""

    record: TestRecord
    skip_reason: str | None = None
    failure: str | None = None  # the whole, self-contained message
    warnings: list[str] = field(default_factory=list)


class Gate:
    def __init__(self, settings: Settings, store: BaselineStore) -> None:
        self.settings = settings
        self.stored = StoredBaselines(settings, store)

    def before_launch(self, test_id: str, spec: Spec) -> Outcome | None:
        """What can be judged before a launch: the test's baseline file reads and validates. A
        broken file fails the test at once (named, with the field and what is accepted), not after
        every size has run; None: launch."""
        try:
            self.stored.store.platforms(test_id)  # reads and validates the whole file
        except BaselineError as exc:
            what = "not refreshed (file left untouched)" if self.settings.refresh else "file unusable (left untouched)"
            message = (f"baseline {what}: {exc}{self.stored.next_step(test_id)}\n"
                       "  (read before launching: no rank was started)")
            record = build(TestRun(test_id, spec), None, "failed", cause="baseline-error", messages=[message])
            return Outcome(record=record, failure=message)
        return None

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
                stored, found = self.stored.comparable(test)
                problems += found.problems
                warnings += found.warnings
                notes += found.notes
            except BaselineError as exc:
                problems.append(f"baseline file unusable (left untouched): {exc}{self.stored.next_step(test.test_id)}")
                cause = "baseline-error"
            cause = cause or ("baseline-missing" if problems else None)
        if test.skip_reason is None and not problems:
            notes.extend(self.stored.fake_gpu_difference(test))
            tolerances = {n: self.stored.tolerance(test, n, e) for n, e in stored.items()}
            notes += dict.fromkeys(note for _, note in tolerances.values() if note)  # each said once
            refs = {n: BaselineRef(e.gated_mib, tolerances[n][0], e.allocated_mib,
                                   spec.allocated_tolerance.resolve(exact=True), e.ranks, e.allocated_ranks,
                                   e.gated_rank)
                    for n, e in stored.items()}
            verdict = judge(spec, test.results, refs, tuple(notes), test.readings)
            if self.settings.refresh:
                try:
                    changes = self.stored.refresh(test)
                except BaselineError as exc:
                    problems.append(f"baseline not refreshed (file left untouched): {exc}"
                                    f"{self.stored.next_step(test.test_id)}")
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
