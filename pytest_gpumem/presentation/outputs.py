"""CI gate outputs built from the per-test records: Markdown, benchmark JSON, JUnit properties, diffs.

Plain functions over the JSON-able records of ``report.record`` (no pytest import): the same code
serves the pytest session, the ``gpumem diff`` command and a report loaded back from disk.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from pytest_gpumem.config.spec import DEFAULT_TOLERANCE, SpecError, Tolerance, parse_tolerance
from pytest_gpumem.judging.verdict import against_reference

Record = Mapping[str, Any]

SCHEMA = 1
COMMENT_LIMIT = 60_000  # a GitHub comment holds 65,536 characters; leave room for a header

# Regressions first: what a reviewer must act on, then what the test author expected, then the rest.
_STATUS_GROUP = {"FAIL": 0, "ERROR": 0, "XPASS": 1, "XFAIL": 1, "pass": 2, "skip": 2}
_HEADLINE = (  # status, singular, plural
    ("FAIL", "regression", "regressions"),
    ("ERROR", "error", "errors"),
    ("XPASS", "unexpected pass", "unexpected passes"),
    ("XFAIL", "expected failure", "expected failures"),
    ("pass", "passed", "passed"),
    ("skip", "skipped", "skipped"),
)
_VERDICT_CELL = {"FAIL": "❌ FAIL", "ERROR": "❌ ERROR", "XPASS": "⚠️ XPASS", "XFAIL": "XFAIL",
                 "pass": "✅ pass", "skip": "skip", "ok": "ok"}


# ---------------------------------------------------------------------------------------------
# small shared helpers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mib(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def delta(new: float | None, old: float | None) -> tuple[float, float | None] | None:
    """(new - old in MiB, in percent of old); the percentage is None when old is 0."""
    if not _is_number(new) or not _is_number(old):
        return None
    assert new is not None and old is not None
    return new - old, ((new - old) / old * 100.0 if old else None)


def format_delta(change: tuple[float, float | None] | None) -> str:
    """``+12.3 MiB (+2.6%)``; ``-`` when there is nothing to compare."""
    if change is None:
        return "-"
    mib, pct = change
    return f"{mib:+.1f} MiB" + ("" if pct is None else f" ({pct:+.1f}%)")


def size_verdict(record: Record, size: Mapping[str, Any]) -> str:
    """The test's status, except ``ok`` for a size that passed inside a failing (or xfailing) test."""
    status = record["status"]
    if status in ("FAIL", "XFAIL") and not size.get("failed"):
        return "ok"
    return status


def gated_rank_number(size: Mapping[str, Any]) -> str | None:
    """``"3"`` from the label ``"rank 3 (largest)"``: the key of the gated rank in ``ranks``/``methods``."""
    match = re.match(r"rank (\d+)", str(size.get("gated_rank", "")))
    return match.group(1) if match else None


def gated_method(size: Mapping[str, Any]) -> str | None:
    """How the gated number was measured (``per-pid sampled``, ``high-water mark``, ...)."""
    rank = gated_rank_number(size)
    methods = size.get("methods") or {}
    return methods.get(rank) if rank is not None else None


def _ordered(records: Iterable[Record]) -> list[Record]:
    return sorted(records, key=lambda r: (_STATUS_GROUP.get(r["status"], 2), r["test"]))


def headline(records: Sequence[Record]) -> str:
    """``❌ **pytest-gpumem**: 1 regression, 5 passed``: counts per status, the ones to act on first."""
    if not records:
        return "**pytest-gpumem**: no gpumem test ran"
    counts = {status: sum(1 for r in records if r["status"] == status) for status, *_ in _HEADLINE}
    parts = [f"{n} {one if n == 1 else many}" for status, one, many in _HEADLINE if (n := counts[status])]
    bad = counts["FAIL"] + counts["ERROR"]
    return ("❌" if bad else "✅") + " **pytest-gpumem**: " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Markdown summary (PR comment, $GITHUB_STEP_SUMMARY)


def _cell(text: str) -> str:
    """A table cell: pipes escaped (GitHub's tables split on them even inside code spans)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _md_rows(record: Record) -> list[str]:
    test = _cell(f"`{record['test']}`")
    if not record.get("sizes"):
        nproc = ",".join(map(str, record.get("nproc", [])))
        return [f"| {test} | {nproc} | - | - | - | - | {_VERDICT_CELL.get(record['status'], record['status'])} |"]
    rows = []
    for size in record["sizes"]:
        verdict = size_verdict(record, size)
        peak = _mib(size.get("gated_mib"))
        if size.get("gated_mib") is not None:
            predicted = ", **predicted**" if size.get("predicted") else ""
            peak += f" ({size.get('gated_rank', '?')}, {size.get('device', '?')}{predicted})"
        ratio = "-" if size.get("ratio") is None else f"{size['ratio']:.2f}x"
        nproc = f"{size['nproc']}" + ("\\*" if size.get("reused") else "")
        change = format_delta(delta(size.get("gated_mib"), size.get("baseline_mib")))
        cells = [test, nproc, peak, _mib(size.get("baseline_mib")), change, ratio,
                 _VERDICT_CELL.get(verdict, verdict)]
        rows.append("| " + " | ".join(_cell(c) if i else c for i, c in enumerate(cells)) + " |")
    return rows


def _indent(text: str) -> str:
    """Continuation lines of a multi-line message stay inside their list item."""
    return text.replace("\n", "\n  ")


def _md_messages(records: Sequence[Record]) -> list[str]:
    lines: list[str] = []
    for rec in records:
        messages = rec.get("messages") or []
        if not messages and rec["status"] == "ERROR":
            messages = ["no measurement: see the test's output in the log"]
        lines.extend(f"- **{rec['status']}** `{rec['test']}`: {_indent(str(m))}" for m in messages)
    return lines


def _md_notes(records: Sequence[Record]) -> list[str]:
    return [f"- `{rec['test']}`: {_indent(str(note))}" for rec in records for note in rec.get("notes") or []]


_TABLE_HEAD = [
    "| test | nproc | gated peak MiB | baseline MiB | delta vs baseline | ratio to nproc=1 | verdict |",
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
]


def markdown(records: Iterable[Record], *, max_chars: int = COMMENT_LIMIT) -> str:
    """A PR-comment-ready summary: headline, table (regressions first), the messages, the notes.

    Stays under ``max_chars`` (GitHub caps a comment at 65,536): rows of tests that need no action
    are the first to go, with a line saying how many were left out.
    """
    records = _ordered(records)
    head = [headline(records), ""]
    if not records:
        return "\n".join(head)
    tail: list[str] = []
    messages = _md_messages(records)
    if messages:
        tail += ["", "**Limits exceeded**", "", *messages]
    notes = _md_notes(records)
    if notes:
        tail += ["", "**Notes**", "", *notes]
    legend = []
    if any(size.get("reused") for rec in records for size in rec.get("sizes", [])):
        legend.append("\\* nproc=1 reference reused from an earlier launch with the same parameters")
    legend.append("delta: gated peak minus the stored baseline of this platform; "
                  "ratio: gated peak over the nproc=1 peak")
    legend.extend(f"predicted (not launched): nproc={size['nproc']} of `{rec['test']}`, "
                  f"{size['predicted'].get('basis', '')}"
                  for rec in records for size in rec.get("sizes", []) if size.get("predicted"))
    tail += ["", *legend]
    rows = [row for rec in records for row in _md_rows(rec)]
    budget = max_chars - sum(len(line) + 1 for line in head + _TABLE_HEAD + tail) - 80
    kept, used = [], 0
    for row in rows:
        if used + len(row) + 1 > budget:
            break
        kept.append(row)
        used += len(row) + 1
    omitted = []
    if len(kept) < len(rows):
        omitted = [f"| … {len(rows) - len(kept)} more rows: see the JSON report | | | | | | |"]
    text = "\n".join(head + _TABLE_HEAD + kept + omitted + tail) + "\n"
    return text if len(text) <= max_chars else text[: max_chars - 2] + "…\n"


# ---------------------------------------------------------------------------------------------
# github-action-benchmark


def benchmark_name(record: Record, nproc: int) -> str:
    """Stable across runs (the series key): the configured gated rank, not the one that peaked."""
    rank = (record.get("limits") or {}).get("rank", 0)
    return f"{record['test']} nproc={nproc} rank {rank}"


def benchmark_json(records: Iterable[Record]) -> list[dict[str, Any]]:
    """github-action-benchmark ``customSmallerIsBetter`` entries, one per test and world size.

    Tests that errored or were skipped are left out: a crashed launch's peak would be a false dip.
    """
    out = []
    for rec in sorted(records, key=lambda r: r["test"]):
        if rec["status"] in ("ERROR", "skip"):
            continue
        for size in rec.get("sizes", []):
            if not _is_number(size.get("gated_mib")) or size.get("predicted"):
                continue  # a chart of measurements: a predicted figure is not one
            extra = [size.get("device", "?"), gated_method(size) or "method unknown", size.get("gated_rank", "")]
            if size.get("ratio") is not None:
                extra.append(f"ratio {size['ratio']:.2f}x to nproc=1")
            if size.get("baseline_mib") is not None:
                extra.append(f"baseline {size['baseline_mib']:.1f} MiB")
            extra.append(f"verdict {size_verdict(rec, size)}")
            out.append({"name": benchmark_name(rec, size["nproc"]), "unit": "MiB",
                        "value": round(float(size["gated_mib"]), 2), "extra": ", ".join(e for e in extra if e)})
    return out


# ---------------------------------------------------------------------------------------------
# JUnit XML properties


def junit_properties(record: Record) -> list[tuple[str, str]]:
    """``(name, value)`` pairs for ``item.user_properties``: pytest's --junitxml writes each as <property>."""
    sizes = record.get("sizes", [])
    devices = sorted({str(s.get("device")) for s in sizes if s.get("device")})
    methods = sorted({m for s in sizes if (m := gated_method(s))})
    props = [
        ("gpumem_status", str(record["status"])),
        ("gpumem_nproc", ",".join(map(str, record.get("nproc", [])))),
        ("gpumem_device", ",".join(devices) or "-"),
        ("gpumem_method", ",".join(methods) or "-"),
        ("gpumem_rank", str((record.get("limits") or {}).get("rank", 0))),
    ]
    for size in sizes:
        key = f"gpumem_nproc{size['nproc']}"
        gated, base = size.get("gated_mib"), size.get("baseline_mib")
        props.append((f"{key}_gated_mib", _mib(gated, 2)))
        if base is not None:
            props.append((f"{key}_baseline_mib", _mib(base, 2)))
        change = delta(gated, base)
        if change is not None:
            props.append((f"{key}_delta_mib", f"{change[0]:+.2f}"))
            if change[1] is not None:
                props.append((f"{key}_delta_pct", f"{change[1]:+.2f}"))
        if size.get("ratio") is not None:
            props.append((f"{key}_ratio", f"{size['ratio']:.3f}"))
        if size.get("predicted"):
            props.append((f"{key}_predicted", str(size["predicted"].get("basis", "predicted"))))
    return props


# ---------------------------------------------------------------------------------------------
# Reports on disk and `gpumem diff`


class ReportError(ValueError):
    """A report that cannot be compared; the message names the file and what is wrong."""


def _check_record(rec: Any, where: str) -> list[str]:
    """What is wrong with one record, for the fields a diff reads."""
    if not isinstance(rec, dict):
        return [f"{where}: expected an object, got {type(rec).__name__}"]
    problems = []
    if not isinstance(rec.get("test"), str) or not rec.get("test"):
        problems.append(f"{where}.test: expected a test id string, got {rec.get('test')!r}")
    if not isinstance(rec.get("status"), str):
        problems.append(f"{where}.status: expected a string, got {rec.get('status')!r}")
    limits = rec.get("limits", {})
    if not isinstance(limits, dict):
        problems.append(f"{where}.limits: expected an object, got {type(limits).__name__}")
    elif limits.get("tolerance") is not None:
        try:
            parse_tolerance(limits["tolerance"])
        except SpecError as exc:
            problems.append(f"{where}.limits.tolerance: {exc}")
    sizes = rec.get("sizes")
    if not isinstance(sizes, list):
        return problems + [f"{where}.sizes: expected a list, got {type(sizes).__name__}"]
    for j, size in enumerate(sizes):
        at = f"{where}.sizes[{j}]"
        if not isinstance(size, dict):
            problems.append(f"{at}: expected an object, got {type(size).__name__}")
            continue
        if not isinstance(size.get("nproc"), int) or isinstance(size.get("nproc"), bool) or size["nproc"] < 1:
            problems.append(f"{at}.nproc: expected an integer >= 1, got {size.get('nproc')!r}")
        if size.get("gated_mib") is not None and not _is_number(size.get("gated_mib")):
            problems.append(f"{at}.gated_mib: expected a number of MiB or null, got {size.get('gated_mib')!r}")
    return problems


def parse_report(doc: Any) -> list[dict[str, Any]]:
    """The records of a ``--gpumem-report`` document; ReportError lists every problem found."""
    if not isinstance(doc, dict):
        raise ReportError(f"expected a JSON object with 'schema' and 'tests', got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise ReportError(f"schema: expected {SCHEMA} (a pytest --gpumem-report file), got {doc.get('schema')!r}")
    tests = doc.get("tests")
    if not isinstance(tests, list):
        raise ReportError(f"tests: expected a list of test records, got {type(tests).__name__}")
    problems = [p for i, rec in enumerate(tests) for p in _check_record(rec, f"tests[{i}]")]
    seen: set[str] = set()
    for i, rec in enumerate(tests):
        test = rec.get("test") if isinstance(rec, dict) else None
        if not isinstance(test, str):
            continue
        if test in seen:
            problems.append(f"tests[{i}].test: {test!r} appears twice")
        seen.add(test)
    if problems:
        raise ReportError("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    return tests


def load_report(path: Path | str) -> list[dict[str, Any]]:
    """Read and validate a JSON report; every error message starts with the file's path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    try:
        return parse_report(doc)
    except ReportError as exc:
        raise ReportError(f"{path}: {exc}") from None


# Order of a diff's rows: what fails the gate first.
_KINDS = ("regression", "unmeasured", "device changed", "predicted on one side", "improved", "unchanged", "added",
          "removed")


@dataclass(frozen=True)
class DiffRow:
    """One test at one world size, old report vs new."""

    test: str
    nproc: int
    old_mib: float | None
    new_mib: float | None
    kind: str  # one of _KINDS
    allowance_mib: float | None = None
    tolerance: str = ""
    device: str = ""

    @property
    def change(self) -> tuple[float, float | None] | None:
        return delta(self.new_mib, self.old_mib)


@dataclass(frozen=True)
class ReportDiff:
    rows: tuple[DiffRow, ...]

    @property
    def regressions(self) -> list[DiffRow]:
        return [row for row in self.rows if row.kind == "regression"]

    def count(self, kind: str) -> int:
        return sum(1 for row in self.rows if row.kind == kind)

    def summary(self) -> str:
        """``1 regression, 3 unchanged, 1 added``; only the kinds present."""
        parts = [f"{n} {kind}" + ("s" if kind == "regression" and n != 1 else "")
                 for kind in _KINDS if (n := self.count(kind))]
        return ", ".join(parts) or "nothing to compare"


def _by_size(records: Iterable[Record]) -> dict[tuple[str, int], tuple[Record, Mapping[str, Any]]]:
    return {(rec["test"], size["nproc"]): (rec, size) for rec in records for size in rec.get("sizes", [])}


def _tolerance_of(record: Record, override: Tolerance | None) -> Tolerance:
    if override is not None:
        return override
    return parse_tolerance((record.get("limits") or {}).get("tolerance") or DEFAULT_TOLERANCE)


def _diff_row(key: tuple[str, int], old: tuple[Record, Mapping[str, Any]] | None,
              new: tuple[Record, Mapping[str, Any]] | None, override: Tolerance | None) -> DiffRow:
    test, nproc = key
    if old is None:
        assert new is not None
        return DiffRow(test, nproc, None, new[1].get("gated_mib"), "added", device=str(new[1].get("device", "")))
    if new is None:
        return DiffRow(test, nproc, old[1].get("gated_mib"), None, "removed", device=str(old[1].get("device", "")))
    (_, old_size), (new_rec, new_size) = old, new
    old_mib, new_mib = old_size.get("gated_mib"), new_size.get("gated_mib")
    device = str(new_size.get("device", ""))
    if old_size.get("device") != new_size.get("device"):
        return DiffRow(test, nproc, old_mib, new_mib, "device changed",
                       device=f"{old_size.get('device')} -> {device}")
    if bool(old_size.get("predicted")) != bool(new_size.get("predicted")):  # a fit is no measurement
        return DiffRow(test, nproc, old_mib, new_mib, "predicted on one side", device=device)
    if old_mib is None or new_mib is None:
        return DiffRow(test, nproc, old_mib, new_mib, "unmeasured", device=device)
    tolerance = _tolerance_of(new_rec, override)
    kind, allowance = against_reference(new_mib, old_mib, tolerance)  # the baseline gate's own rule
    return DiffRow(test, nproc, old_mib, new_mib, kind, allowance, str(tolerance), device)


def compare(old: Iterable[Record], new: Iterable[Record], tolerance: Tolerance | str | None = None) -> ReportDiff:
    """Per (test, nproc): gated peak old -> new, judged by the baseline gate's rule
    (:func:`verdict.against_reference`): a regression is new > old + tolerance.allowance(old).

    ``tolerance=None`` uses each test's own tolerance (from the new report), as its baseline check
    does. Sizes in only one report are ``added``/``removed``; a size whose gated device changed
    (GPU vs host memory) is not compared, nor one predicted on one side and launched on the other;
    a size not measured on one side is ``unmeasured``.
    """
    override = parse_tolerance(tolerance) if tolerance is not None else None
    old_sizes, new_sizes = _by_size(old), _by_size(new)
    rows = [_diff_row(key, old_sizes.get(key), new_sizes.get(key), override)
            for key in set(old_sizes) | set(new_sizes)]
    rows.sort(key=lambda r: (_KINDS.index(r.kind), r.test, r.nproc))
    return ReportDiff(tuple(rows))


def _diff_cells(row: DiffRow) -> tuple[str, ...]:
    allowed = "-" if row.allowance_mib is None else f"+{row.allowance_mib:.1f} ({row.tolerance})"
    return (row.test, str(row.nproc), _mib(row.old_mib), _mib(row.new_mib), format_delta(row.change),
            allowed, row.kind.upper() if row.kind == "regression" else row.kind)


_DIFF_HEADER = ("test", "nproc", "old MiB", "new MiB", "delta", "allowed", "result")


def diff_table(diff: ReportDiff) -> list[str]:
    """Fixed-width lines for a terminal, regressions first, and a summary line."""
    rows = [_diff_cells(row) for row in diff.rows]
    widths = [max(len(r[i]) for r in [_DIFF_HEADER, *rows]) for i in range(len(_DIFF_HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    out = [line(_DIFF_HEADER), line(["-" * w for w in widths]), *(line(r) for r in rows)]
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
    return "\n".join(lines) + "\n"
