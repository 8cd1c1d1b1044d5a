"""OneFlow's SBP audits in a failure: which launch's audit to read, against what, and the lines the
failure text and the record (Markdown, JSON, JUnit) carry. The rules live in ``oneflow/``
(``boxing.py`` for nn.Graph, ``conversions.py`` for eager); this picks the runs and hands them down.
"""

from __future__ import annotations

from typing import Mapping

from ..launching.launched import SizeRun, TestRun
from ..oneflow import boxing, conversions
from .baseline import Entry
from .verdict import Verdict


def graph_section(test: TestRun, verdict: Verdict, stored: Mapping[int, Entry]) -> list[str]:
    """A failure's nn.Graph part: the graph inputs a rank holds more of than at the smallest size, then
    the new or grown conversions of the largest failing size with an audit."""
    audited = _graph_audited(test, verdict)
    if audited is None:
        return []
    lines = []
    size = audited.launch.nproc
    if inputs := _input_lines(test, audited):
        lines.append(f"  nn.Graph inputs at nproc={size} that a rank holds more of than at the smallest size:")
        lines.extend(f"    {line}" for line in inputs)
    entry = stored.get(size)
    smaller = [(r.launch.nproc, r.boxings) for r in test.runs if r.launch.nproc < size]
    return lines + boxing.failure_lines(size, audited.boxings, entry.provenance if entry else None, smaller)


def _graph_audited(test: TestRun, verdict: Verdict) -> SizeRun | None:
    """The largest failing size with an nn.Graph audit: one rank alone has no conversions to show. A
    size that fails only as predicted was never launched: the largest launched one shows the trend."""
    failing = {check.world_size for check in verdict.failures}
    by_size = sorted(test.runs, key=lambda r: -r.launch.nproc)
    audited = next((r for r in by_size if r.launch.nproc in failing and (r.boxings or r.graph_inputs)), None)
    if audited is None and any(r.predicted for r in verdict.results if r.world_size in failing):
        audited = next((r for r in by_size if r.boxings or r.graph_inputs), None)
    return audited


def _input_lines(test: TestRun, audited: SizeRun) -> list[str]:
    """The audited size's graph inputs that a rank holds more of than at the smallest launched size
    (a batch broadcast before the call), or that changed SBP."""
    smaller = [(r.launch.nproc, r.graph_inputs) for r in test.runs if r.launch.nproc < audited.launch.nproc]
    if not smaller:
        return []
    ref_size, reference = min(smaller, key=lambda pair: pair[0])
    return boxing.input_lines(audited.launch.nproc, audited.graph_inputs, ref_size, reference)


def record_lines(test: TestRun, verdict: Verdict | None, stored: Mapping[int, Entry]) -> list[str]:
    """One line per new SBP conversion at the failing size, eager ones first, for the record (the
    Markdown summary, the JSON report, JUnit): what the failure text lists in its audits."""
    if verdict is None or verdict.passed:
        return []
    lines: list[str] = []
    eager_run = _eager_audited(test, {check.world_size for check in verdict.failures})
    if eager_run is not None:
        size = eager_run.launch.nproc
        smaller = [(r.launch.nproc, r.eager) for r in test.runs if r.launch.nproc < size]
        entry = stored.get(size)
        compared = conversions.news(size, eager_run.eager, smaller, entry.provenance if entry else None)
        lines += compared[1] if compared else []
    graph_run = _graph_audited(test, verdict)
    if graph_run is not None:
        size = graph_run.launch.nproc
        entry = stored.get(size)
        smaller_graphs = [(r.launch.nproc, r.boxings) for r in test.runs if r.launch.nproc < size]
        lines += _input_lines(test, graph_run)
        lines += boxing.headlines(size, graph_run.boxings, entry.provenance if entry else None, smaller_graphs)
    return lines


def _eager_audited(test: TestRun, failing: set[int]) -> SizeRun | None:
    return next((r for r in sorted(test.runs, key=lambda r: -r.launch.nproc)
                 if r.launch.nproc in failing and (r.eager or r.eager_problem)), None)


def eager_section(test: TestRun, failing: set[int], stored: Mapping[int, Entry]) -> list[str]:
    """OneFlow's eager conversions at the largest failing size that recorded them, against the
    smallest launched size: the line, the conversion and what it costs a rank."""
    audited = _eager_audited(test, failing)
    if audited is None:
        return []
    size = audited.launch.nproc
    smaller = [(r.launch.nproc, r.eager) for r in test.runs if r.launch.nproc < size]
    entry = stored.get(size)
    return conversions.scaling_lines(size, audited.eager, smaller, audited.eager_problem,
                                     entry.provenance if entry else None)
