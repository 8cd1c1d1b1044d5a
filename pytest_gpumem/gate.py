"""One test's run -> its outcome: limits and stored baselines judged, baselines refreshed, the
failure explained. Plain Python: ``plugin.py`` only turns the outcome into pass, fail, skip and
warnings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .config.settings import Settings
from .judging.baseline import BaselineError, BaselineStore, Entry
from .judging.explain import config_provenance, provenance_diff, timeline_lines
from .judging.record import BaselineChange, TestRecord, build
from .judging.verdict import BaselineRef, SizeResult, Verdict, judge
from .launching.runner import SizeRun, TestRun
from .oneflow import boxing
from .sampling.allocations import is_allocation_method
from .sampling.identity import host_provenance


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
        self.store = store

    def evaluate(self, test: TestRun) -> Outcome:
        spec = test.spec
        test.provenance.update({**config_provenance(dict(spec.config)), "launcher": spec.launcher})
        problems = list(test.problems)
        notes = [note for run in test.runs for note in run.notes]
        warnings: list[str] = []
        stored: dict[int, Entry] = {}
        changes: dict[int, tuple[Entry | None, Entry]] = {}
        verdict: Verdict | None = None
        if test.skip_reason is None and not problems and not self.settings.refresh:
            try:
                stored = self._baselines(test, notes, problems, warnings)
            except BaselineError as exc:
                problems.append(f"baseline file unusable (left untouched): {exc}")
        if test.skip_reason is None and not problems:
            refs = {n: BaselineRef(e.gated_mib, spec.tolerance) for n, e in stored.items()}
            verdict = judge(spec, test.results, refs, tuple(notes))
            if self.settings.refresh:
                try:
                    changes = self._refresh(test)
                except BaselineError as exc:
                    problems.append(f"baseline not refreshed (file left untouched): {exc}")
        changed = provenance_diff(next(iter(stored.values())).provenance, test.provenance) if stored else []
        rec = build(test, verdict, _status(test, verdict, problems),
                    baselines={n: e.gated_mib for n, e in stored.items()},
                    changes=[BaselineChange(n, old.gated_mib if old else None, new.gated_mib)
                             for n, (old, new) in sorted(changes.items())],
                    changed=changed, messages=problems or None)
        outcome = Outcome(record=rec, skip_reason=test.skip_reason, warnings=warnings)
        if test.skip_reason is not None:
            return outcome
        if problems:
            outcome.failure = "\n".join(problems)
        elif verdict is not None and not verdict.passed:
            outcome.failure = explain_failure(test, verdict, changed, stored)
        elif verdict is not None:
            outcome.warnings.extend(verdict.notes)  # improvements, foreign GPU users
        return outcome

    def _baselines(self, test: TestRun, notes: list[str], problems: list[str],
                   warnings: list[str]) -> dict[int, Entry]:
        """Stored entries for this platform; missing ones (or ones of another metric) warn, or fail in CI."""
        stored: dict[int, Entry] = {}
        missing: list[int] = []
        other_metric: list[str] = []
        platform = ""
        for result in test.results:
            if result.world_size not in test.spec.nproc or result.predicted:
                continue
            platform = result.platform
            entry = self.store.lookup(test.test_id, platform, result.world_size)
            measured = _gated_method(result, test.spec.rank)
            if entry is None:
                missing.append(result.world_size)
            elif metric(entry.method) != metric(measured):  # never compared: the numbers mean different things
                other_metric.append(f"nproc={result.world_size} holds {entry.method!r}, this run measured "
                                    f"{measured!r}")
            else:
                stored[result.world_size] = entry
        where = f"{test.test_id} on {platform} in {self.store.file_for(test.test_id)}"
        refresh = f"`gpumem refresh {test.test_id}` and commit the file"
        if other_metric:
            self._unmatched(f"baseline of {where} was measured another way ({'; '.join(other_metric)}): "
                            f"not compared; record it again with {refresh}", problems, warnings, always_say=True)
        if missing:
            elsewhere = [p for p in self.store.platforms(test.test_id) if p != platform]
            if elsewhere:
                notes.append(f"baselines exist only for other platforms ({', '.join(elsewhere)}); "
                             f"not compared on {platform}")
            self._unmatched(f"no baseline stored for {test.test_id} on {platform} at "
                            f"nproc={', '.join(map(str, missing))} in {self.store.file_for(test.test_id)}: "
                            f"record it with {refresh}", problems, warnings)
        return stored

    def _unmatched(self, text: str, problems: list[str], warnings: list[str], always_say: bool = False) -> None:
        """A size with no comparable baseline: a failure in CI (configurable), a warning otherwise."""
        mode = self.settings.fail_on_missing_baseline
        if mode:
            problems.append(text + " (fails when CI is set; gpumem_missing_baseline=warn to relax)")
        elif mode is False or always_say:
            warnings.append(text)

    def _refresh(self, test: TestRun) -> dict[int, tuple[Entry | None, Entry]]:
        spec = test.spec
        # The ranks' own view (their env knobs, the frameworks they imported), not pytest's.
        provenance = {**host_provenance(os.environ), **test.provenance}
        entries: dict[int, Entry] = {}
        platform = ""
        for result in test.results:
            _, gated = result.gated(spec.rank)
            if result.world_size not in spec.nproc or gated is None or result.predicted:
                continue  # a predicted figure is never stored as a measurement
            platform = result.platform
            entries[result.world_size] = Entry(
                gated_mib=gated,
                ranks={r: p.mib for r, p in result.peaks.items() if p.mib is not None},
                rank=spec.rank,
                device=result.device,
                method=_gated_method(result, spec.rank),
                provenance=provenance,
            )
        return self.store.update(test.test_id, platform, entries) if entries else {}


def explain_failure(test: TestRun, verdict: Verdict, changed: list[str], stored: dict[int, Entry]) -> str:
    """The verdict, what differs from the baseline's provenance, when each rank peaked, the new
    nn.Graph boxing, and where the torch snapshots are."""
    lines = [verdict.render()]
    driver = _driver_change(stored, test.provenance)
    if driver:  # first: a new driver moves every GPU figure through the CUDA context
        lines.insert(0, driver)
    if changed:
        lines.append("  changed since the baseline (declared config first):")
        lines.extend(f"    {line}" for line in changed)
    lines.append("  per-rank peaks over the run:")
    lines.extend(f"    {line}" for line in timeline_lines(verdict.results))
    failing = {check.world_size for check in verdict.failures}
    # The largest failing size with an audit: one rank alone has no conversions to show. A size
    # that fails only as predicted was never launched: the largest launched one shows the trend.
    by_size = sorted(test.runs, key=lambda r: -r.launch.nproc)
    audited = next((r for r in by_size if r.launch.nproc in failing and r.boxings), None)
    if audited is None and any(r.predicted for r in verdict.results if r.world_size in failing):
        audited = next((r for r in by_size if r.boxings), None)
    if audited is not None:
        size = audited.launch.nproc
        old, against = _boxing_reference(audited, test.runs, stored.get(size))
        found = boxing.explain(old, audited.boxings)
        if found:
            lines.append(f"  nn.Graph boxing (SBP conversions) at nproc={size} {against}:")
            lines.extend(f"    {line}" for line in found)
        else:
            lines.append(f"  nn.Graph boxing (SBP conversions) at nproc={size} {against}: "
                         "no new or grown conversions; the memory came from elsewhere")
    snapshots = [f"    nproc={run.launch.nproc} rank {rank}: {path}" for run in test.runs
                 if run.launch.nproc in failing for rank, path in sorted(run.snapshots.items())]
    if snapshots:
        lines.append("  torch memory snapshots (pytorch.org/memory_viz):")
        lines.extend(snapshots)
    return "\n".join(lines)


def _boxing_reference(audited: SizeRun, runs: list[SizeRun], entry: Entry | None) -> tuple[dict[str, int], str]:
    """The baseline's audit when it has one, else the smallest launched size's (one rank: none)."""
    old = boxing.from_provenance(entry.provenance) if entry is not None else None
    if old is not None:
        return old, "against the baseline"
    smaller = [r for r in runs if r.launch.nproc < audited.launch.nproc]
    if not smaller:
        return {}, "(no audited baseline to compare)"
    smallest = min(smaller, key=lambda r: r.launch.nproc)
    return boxing.summarize(smallest.boxings), f"against nproc={smallest.launch.nproc} (no audited baseline)"


def _driver_change(stored: dict[int, Entry], provenance: dict[str, str]) -> str | None:
    old = next((e.provenance for e in stored.values() if e.device == "gpu"), None)
    if old is None:
        return None
    moved = [f"{key} {old[key]} -> {provenance.get(key, '(unknown)')}"
             for key in ("nvidia_driver", "cuda_driver", "torch_cuda")
             if key in old and old[key] != provenance.get(key)]
    if not moved:
        return None
    return (f"gpumem: the GPU software differs from the baseline's ({'; '.join(moved)}): the CUDA context, "
            "part of every rank's figure, changes size with it. Compare the floor below; if the job's own "
            "part did not move, refresh the baseline on this driver")


def metric(method: str) -> str:
    """What a figure measures: baselines are compared only within one metric."""
    if is_allocation_method(method):
        return "host live allocations"
    if method.startswith(("high-water mark", "rss")):
        return "host resident memory"
    return "gpu memory"  # per-pid, accounting and device figures are all what nvidia-smi shows


def _gated_method(result: SizeResult, rank: int | str) -> str:
    gated = result.gated_rank(rank)
    peak = result.peaks.get(gated) if gated is not None else None
    return peak.method if peak is not None else result.methods


def _status(test: TestRun, verdict: Verdict | None, problems: list[str]) -> str:
    if test.skip_reason is not None:
        return "skip"
    if problems:
        return "ERROR"
    return "pass" if verdict is not None and verdict.passed else "FAIL"
