"""CI gate outputs rendered from the typed per-test records: Markdown, benchmark JSON, JUnit
properties, and the table of ``gpumem diff`` (judged in :mod:`..judging.report_diff`).

Plain functions over :class:`~pytest_gpumem.judging.record.TestRecord` (no pytest import): the same
code serves the pytest session, the ``gpumem diff`` command and a report loaded back from disk.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..config.settings import Settings
from ..judging.record import CAUSES, TestRecord, report_document
from ..judging.report_diff import DiffRow, ReportDiff, delta
from .report import floor_split

COMMENT_LIMIT = 60_000  # a GitHub comment holds 65,536 characters; leave room for a header

# Failures first: what a reviewer must act on, then what the test author expected, then the rest.
_STATUS_GROUP = {"failed": 0, "xpassed": 1, "xfailed": 1, "passed": 2, "measured": 2, "skipped": 2}
_HEADLINE_ORDER = ("failed", "xpassed", "xfailed", "passed", "measured", "skipped")  # pytest's words
_MARK = {"failed": "❌ ", "xpassed": "⚠️ ", "passed": "✅ "}
# The headings failures are listed under, by cause (a crash is not a limit).
_MD_SECTIONS = (("limit", "Limits exceeded"), ("crash", "Crashed or hung"),
                ("baseline-missing", "Baselines missing"), ("baseline-error", "Baseline files unusable"))


# ---------------------------------------------------------------------------------------------
# small shared helpers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mib(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_delta(change: tuple[float, float | None] | None, digits: int = 1) -> str:
    """``+12.3 MiB (+2.6%)``; ``-`` when there is nothing to compare."""
    if change is None:
        return "-"
    mib, pct = change
    mib, pct = round(mib, digits) + 0.0, None if pct is None else round(pct, 1) + 0.0  # no "-0.0": it reads as a drop
    return f"{mib:+.{digits}f} MiB" + ("" if pct is None else f" ({pct:+.1f}%)")


def _ordered(records: Iterable[TestRecord]) -> list[TestRecord]:
    return sorted(records, key=lambda r: (_STATUS_GROUP.get(r.status, 2), r.test))


def headline(records: Sequence[TestRecord]) -> str:
    """``❌ **pytest-gpumem**: 2 failed (1 limit, 1 crash), 5 passed``: counts in pytest's words, the
    ones to act on first, a failure's cause beside it."""
    if not records:
        return "**pytest-gpumem**: no gpumem test ran"
    parts = []
    for status in _HEADLINE_ORDER:
        found = [r for r in records if r.status == status]
        if not found:
            continue
        causes = [f"{n} {cause}" for cause in CAUSES if (n := sum(1 for r in found if r.cause == cause))]
        parts.append(f"{len(found)} {status}" + (f" ({', '.join(causes)})" if status == "failed" and causes else ""))
    bad = any(r.status == "failed" for r in records)
    return ("❌" if bad else "✅") + " **pytest-gpumem**: " + ", ".join(parts)


def _verdict_cell(record: TestRecord, verdict: str) -> str:
    """``❌ failed (crash)``, ``✅ passed``, ``ok`` (a size that passed inside a failing test)."""
    return ("" if verdict == "ok" else _MARK.get(record.status, "")) + verdict


# ---------------------------------------------------------------------------------------------
# Markdown summary (PR comment, $GITHUB_STEP_SUMMARY)


def _cell(text: str) -> str:
    """A table cell: pipes escaped (GitHub's tables split on them even inside code spans)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _md_rows(record: TestRecord, with_floor: bool = False) -> list[str]:
    test = _cell(f"`{record.test}`")
    if not record.sizes:
        nproc = ",".join(map(str, record.nproc))
        empty = " - |" if with_floor else ""
        return [f"| {test} | {nproc} | - |{empty} - | - | - | {_verdict_cell(record, record.verdict)} |"]
    rows = []
    digits = record.digits  # as many decimals as its failure text shows
    for size in record.sizes:
        m = size.measured
        verdict = record.size_verdict(size)
        peak = _mib(size.gated_mib, digits)
        if size.gated_mib is not None:
            predicted = (", **predicted**" + ("" if size.validated else ", not validated: shown only")
                         if size.predicted else "") + (f", **fake GPU** ({m.fake_gpu})" if m.fake_gpu else
                                                       ", **simulated world**" if m.simulated else "")
            predicted += f", **{m.cuda_on_cpu}**" if m.cuda_on_cpu else ""
            if m.uncounted:
                predicted += f", **without its {', '.join(m.uncounted)}**"
            peak += f" ({size.gated_label}, {size.device}{predicted})"
        if size.allocated_mib is not None and not m.fake_gpu:  # a fake GPU's gated figure is the allocator's
            peak += f"; allocated {size.allocated_mib:.1f}"
        ratio = "-" if size.ratio is None else f"{size.ratio:.2f}x" + _against(record)
        nproc = f"{size.nproc}" + ("\\*" if m.reused else "") + (" (reference)" if record.unlisted(size) else "")
        change = format_delta(delta(size.gated_mib, size.baseline_mib), digits)
        floor = [floor_split(size) or "-"] if with_floor else []
        cells = [test, nproc, peak, *floor, _mib(size.baseline_mib, digits), change, ratio,
                 _verdict_cell(record, verdict)]
        rows.append("| " + " | ".join(_cell(c) if i else c for i, c in enumerate(cells)) + " |")
    return rows


def _against(record: TestRecord) -> str:
    """`` to nproc=2`` where the ratio is not taken against nproc=1 (the column's default)."""
    return "" if record.spec.reference == 1 else f" to nproc={record.spec.reference}"


def _indent(text: str) -> str:
    """Continuation lines of a multi-line message stay inside their list item."""
    return text.replace("\n", "\n  ")


def _md_messages(records: Sequence[TestRecord]) -> list[str]:
    """The messages under a heading per cause ("Limits exceeded", "Crashed or hung", ...): a test's
    first message (the limit furthest exceeded), what changed since its baseline and the peak sites
    that grew (the lines that hold the memory, top 3), then its other messages."""
    out: list[str] = []
    headings = dict(_MD_SECTIONS)
    for cause in [c for c, _ in _MD_SECTIONS] + [None]:
        lines: list[str] = []
        for rec in records:
            if rec.cause != cause:
                continue
            messages = list(rec.messages)
            if not messages and cause == "crash":
                messages = ["no measurement: see the test's output in the log"]
            lines.extend(f"- **{rec.status}** `{rec.test}`: {_indent(m)}" for m in messages[:1])
            if rec.changed_since_baseline:  # the answer first: what differs from the baseline's run
                lines.append("  - changed since the baseline: " + "; ".join(map(_cell, rec.changed_since_baseline)))
            if rec.grown_sites:  # the line that holds the memory, top 3
                lines.append(f"  - peak sites that grew since {rec.grown_against}: "
                             + ", ".join(f"`{_cell(c.brief())}`" for c in rec.grown_sites[:3]))
            lines.extend(_md_conversions(rec))
            lines.extend(f"- **{rec.status}** `{rec.test}`: {_indent(m)}" for m in messages[1:])
        if lines:
            out += ["", f"**{headings[cause] if cause else 'Messages'}**", "", *lines]
    return out


def _md_conversions(rec: TestRecord, top: int = 3) -> list[str]:
    """OneFlow's new SBP conversions under a failure (the line that asked for the memory), top 3."""
    if not rec.conversions:
        return []
    more = len(rec.conversions) - top
    return ["  - new SBP conversions (OneFlow): " + ", ".join(f"`{_cell(c)}`" for c in rec.conversions[:top])
            + (f" and {more} more" if more > 0 else "")]


def _md_notes(records: Sequence[TestRecord]) -> list[str]:
    return [f"- `{rec.test}`: {_indent(note)}" for rec in records for note in rec.notes]


def _table_head(with_floor: bool) -> list[str]:
    floor = (" floor + job MiB |", " ---: |") if with_floor else ("", "")
    return [f"| test | nproc | gated peak MiB |{floor[0]} baseline MiB | delta vs baseline | ratio to nproc=1 "
            "| verdict |",
            f"| --- | ---: | ---: |{floor[1]} ---: | ---: | ---: | --- |"]


def markdown(records: Iterable[TestRecord], *, max_chars: int = COMMENT_LIMIT) -> str:
    """A PR-comment-ready summary: headline, table (regressions first), the messages, the notes.

    Stays under ``max_chars`` (GitHub caps a comment at 65,536): rows of tests that need no action
    are the first to go, with a line saying how many were left out.
    """
    records = _ordered(records)
    head = [headline(records), ""]
    if not records:
        return "\n".join(head)
    tail: list[str] = _md_messages(records)
    notes = _md_notes(records)
    if notes:
        tail += ["", "**Notes**", "", *notes]
    legend = []
    if any(size.measured.reused for rec in records for size in rec.sizes):
        legend.append("\\* nproc=1 reference reused from an earlier launch with the same parameters")
    with_floor = any(floor_split(size) for rec in records for size in rec.sizes)
    legend.append("delta: gated peak minus the stored baseline of this platform; "
                  "ratio: gated peak over the nproc=1 peak (or the reference the marker names)")
    if any(rec.unlisted(size) for rec in records for size in rec.sizes):
        legend.append("(reference): not in the marker's nproc, launched because max_ratio is taken against it; "
                      "a job that cannot run there names a listed size as its reference (reference=2)")
    if with_floor:
        legend.append("floor + job: the gated peak as what an empty job of the same framework takes at that size "
                      "(start-up, communicator; on GPU the CUDA context) plus the job's own")
    legend.extend(f"predicted (not launched): nproc={size.nproc} of `{rec.test}`, {size.basis}"
                  for rec in records for size in rec.sizes if size.predicted)
    legend.extend(f"simulated world: nproc={size.nproc} of `{rec.test}` "
                  f"(ranks {', '.join(map(str, size.measured.simulated))} "
                  "each alone with a stand-in communicator: allocator figure exact, device and host figures "
                  "without the communicator's buffers)" for rec in records for size in rec.sizes
                  if size.measured.simulated and not size.measured.fake_gpu)
    legend.extend(_fake_gpu_footnote(rec) for rec in records if any(size.measured.fake_gpu for size in rec.sizes))
    legend.extend(f"fake GPU supplied, for `{rec.test}`: " + "; ".join(supplied)
                  for rec in records if (supplied := _supplied(rec)))
    tail += ["", *legend]
    rows = [row for rec in records for row in _md_rows(rec, with_floor)]
    table_head = _table_head(with_floor)
    budget = max_chars - sum(len(line) + 1 for line in head + table_head + tail) - 80
    kept, used = [], 0
    for row in rows:
        if used + len(row) + 1 > budget:
            break
        kept.append(row)
        used += len(row) + 1
    omitted = []
    if len(kept) < len(rows):
        omitted = [f"| … {len(rows) - len(kept)} more rows: see the JSON report |" + " |" * (6 + with_floor)]
    text = "\n".join(head + table_head + kept + omitted + tail) + "\n"
    return text if len(text) <= max_chars else text[: max_chars - 2] + "…\n"


def _fake_gpu_footnote(record: TestRecord) -> str:
    """One line per test, its fake sizes together."""
    fake = [size for size in record.sizes if size.measured.fake_gpu]
    sizes = ", ".join(str(size.nproc) for size in fake)
    return (f"fake GPU: nproc={sizes} of `{record.test}` on a fake {fake[0].measured.fake_gpu} (every CUDA tensor "
            "fake: every limit reads the allocator figure as torch would count it on that model; a real GPU holds "
            "more: the CUDA context, the communicator's buffers, the allocator's cache)")


# ---------------------------------------------------------------------------------------------
# github-action-benchmark


def benchmark_name(record: TestRecord, nproc: int) -> str:
    """Stable across runs (the series key): the configured gated rank, not the one that peaked."""
    return f"{record.test} nproc={nproc} rank {record.spec.rank}"


def benchmark_json(records: Iterable[TestRecord]) -> list[dict[str, Any]]:
    """github-action-benchmark ``customSmallerIsBetter`` entries, one per test and world size.

    Tests that crashed or were skipped are left out: a crashed launch's peak would be a false dip.
    """
    out = []
    for rec in sorted(records, key=lambda r: r.test):
        if rec.status == "skipped" or rec.cause == "crash":
            continue
        for size in rec.sizes:
            if size.gated_mib is None or not math.isfinite(size.gated_mib) or size.predicted:
                continue  # a chart of measurements: a predicted figure is not one
            extra = [size.device, size.gated_method or "method unknown", size.gated_label]
            if size.ratio is not None:
                extra.append(f"ratio {size.ratio:.2f}x to nproc={rec.spec.reference}")
            if size.baseline_mib is not None:
                extra.append(f"baseline {size.baseline_mib:.1f} MiB")
            extra.append(f"verdict {rec.size_verdict(size)}")
            out.append({"name": benchmark_name(rec, size.nproc), "unit": "MiB",
                        "value": round(size.gated_mib, 2), "extra": ", ".join(e for e in extra if e)})
            if size.allocated_mib is not None and not size.measured.fake_gpu:  # the exact series (a fake
                # GPU's gated figure is it already): a 1% step shows, the cache does not
                out.append({"name": benchmark_name(rec, size.nproc) + " allocated", "unit": "MiB",
                            "value": round(size.allocated_mib, 2),
                            "extra": f"gpu, the allocator's peak of live tensors, verdict {rec.size_verdict(size)}"})
    return out


# ---------------------------------------------------------------------------------------------
# JUnit XML properties


def junit_properties(record: TestRecord) -> list[tuple[str, str]]:
    """``(name, value)`` pairs for ``item.user_properties``: pytest's --junitxml writes each as <property>."""
    devices = sorted({s.device for s in record.sizes if s.device})
    methods = sorted({m for s in record.sizes if (m := s.gated_method)})
    props = [
        ("gpumem_status", record.status),
        *([("gpumem_cause", record.cause)] if record.cause else []),
        ("gpumem_nproc", ",".join(map(str, record.nproc))),
        ("gpumem_device", ",".join(devices) or "-"),
        ("gpumem_method", ",".join(methods) or "-"),
        ("gpumem_rank", str(record.spec.rank)),
        *[(f"gpumem_conversion_{i}", line) for i, line in enumerate(record.conversions, 1)],
    ]
    for size in record.sizes:
        key = f"gpumem_nproc{size.nproc}"
        props.append((f"{key}_gated_mib", _mib(size.gated_mib, 2)))
        if size.baseline_mib is not None:
            props.append((f"{key}_baseline_mib", _mib(size.baseline_mib, 2)))
        change = delta(size.gated_mib, size.baseline_mib)
        if change is not None:
            props.append((f"{key}_delta_mib", f"{change[0]:+.2f}"))
            if change[1] is not None:
                props.append((f"{key}_delta_pct", f"{change[1]:+.2f}"))
        if size.ratio is not None:
            props.append((f"{key}_ratio", f"{size.ratio:.3f}"))
        if size.allocated_mib is not None:
            props.append((f"{key}_allocated_mib", _mib(size.allocated_mib, 2)))
            if size.allocated_baseline_mib is not None:
                props.append((f"{key}_allocated_baseline_mib", _mib(size.allocated_baseline_mib, 2)))
        if size.predicted:
            props.append((f"{key}_predicted", size.basis))
        if size.measured.simulated:
            props.append((f"{key}_simulated_ranks", ",".join(map(str, size.measured.simulated))))
        if size.measured.fake_gpu:
            props.append((f"{key}_fake_gpu", size.measured.fake_gpu))
        if size.measured.cuda_on_cpu:
            props.append((f"{key}_cuda_on_cpu", size.measured.cuda_on_cpu))
        if size.measured.supplied:
            props.append((f"{key}_fake_gpu_supplied", "; ".join(size.measured.supplied)))
    return props


def _supplied(rec: TestRecord) -> tuple[str, ...]:
    """What a fake GPU supplied in any of a test's sizes, each line once."""
    return tuple(dict.fromkeys(line for size in rec.sizes for line in size.measured.supplied))


# ---------------------------------------------------------------------------------------------
# `gpumem diff`


def _diff_cells(row: DiffRow) -> tuple[str, ...]:
    allowed = "-" if row.allowance_mib is None else f"+{row.allowance_mib:.1f} ({row.tolerance})"
    nproc = str(row.nproc) + (" allocated" if row.figure == "allocated" else "")
    return (row.test, nproc, _mib(row.old_mib), _mib(row.new_mib), format_delta(row.change),
            allowed, row.kind.upper() if row.kind == "regression" else row.kind)


_DIFF_HEADER = ("test", "nproc", "old MiB", "new MiB", "delta", "allowed", "result")


def diff_table(diff: ReportDiff) -> list[str]:
    """Fixed-width lines for a terminal, regressions first, and a summary line."""
    rows = [_diff_cells(row) for row in diff.rows]
    widths = [max(len(r[i]) for r in [_DIFF_HEADER, *rows]) for i in range(len(_DIFF_HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    out = [line(_DIFF_HEADER), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    for row in diff.regressions:
        if row.growth is not None and row.growth.lines():  # as the failure reads
            out += ["", f"{row.test} nproc={row.nproc}: peak sites that grew"] + [f"  {s}" for s in row.growth.lines()]
    return out + ["", f"gpumem diff: {diff.summary()}"]


def diff_markdown(diff: ReportDiff, old_label: str = "old", new_label: str = "new") -> str:
    """The diff as a PR comment: headline, then the table, regressions first."""
    mark = "❌" if diff.regressions else "✅"
    lines = [f"{mark} **gpumem diff** ({old_label} → {new_label}): {diff.summary()}", ""]
    if diff.rows:
        lines += ["| test | nproc | " + _cell(f"{old_label} MiB") + " | " + _cell(f"{new_label} MiB")
                  + " | delta | allowed | result |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for row in diff.rows:
            cells = list(_diff_cells(row))
            cells[0] = f"`{cells[0]}`"
            if row.kind == "regression":
                cells[-1] = "❌ REGRESSION"
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    grown = [row for row in diff.regressions if row.growth is not None and row.growth.grown]
    if grown:  # as the failure's Markdown names them: one line a site, its caller chain on it
        lines += ["", "**Peak sites that grew**", ""]
        lines += [f"- `{row.test}` nproc={row.nproc}: "
                  + ", ".join(f"`{_cell(c.brief())}`" for c in row.growth.grown[:3]) for row in grown if row.growth]
    return "\n".join(lines) + "\n"


def write_session_outputs(settings: Settings, records: Sequence[TestRecord], step_summary: str | None) -> list[Path]:
    """Every output a session asked for, written once (by the xdist controller, covering every
    worker): the JSON report, benchmark JSON, Markdown, the GitHub step summary (``step_summary``:
    $GITHUB_STEP_SUMMARY, appended to) and the plots, which it returns."""
    if settings.report is not None:
        _write(settings.report, json.dumps(report_document(records), indent=2) + "\n")
    if settings.benchmark_json is not None:
        _write(settings.benchmark_json, json.dumps(benchmark_json(records), indent=2) + "\n")
    if not records:
        return []
    text = markdown(records)
    if settings.markdown is not None:
        _write(settings.markdown, text)
    if step_summary:
        with open(step_summary, "a") as handle:
            handle.write(text + "\n")
    if settings.plots is None:
        return []
    from . import plots

    return plots.plot_all(records, settings.plots)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
