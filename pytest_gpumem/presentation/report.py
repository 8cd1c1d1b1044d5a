"""The end-of-session terminal output: the memory table, the failures by cause, the predicted sizes,
the refreshed baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from ..judging.record import SizeRecord, TestRecord
from ..judging.suggest import HEADROOM, measured_ratios, suggested_ratio
from ..sampling.allocations import is_allocation_method

# The headings failures are listed under, by cause (record.CAUSES): a crash is not a limit.
SECTIONS = (
    ("limit", "limits exceeded"),
    ("crash", "ranks that failed"),
    ("baseline-missing", "baselines missing"),
    ("baseline-error", "baseline files unusable"),
)


def _mib(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _resident(size: SizeRecord, ranks: Iterable[int]) -> bool:
    """A host figure of these ranks is their resident high-water mark (a rank that ended without
    reporting its live allocations, or tracking off), not the live allocations the others report."""
    return size.device == "cpu" and any(
        (peak := size.measured.peaks.get(rank)) is not None and peak.mib is not None and peak.method
        and not is_allocation_method(peak.method) for rank in ranks)


def floor_split(size: SizeRecord) -> str | None:
    """``612.0 + 1022.0``: the gated rank's figure as floor + the job's own, where a floor was measured."""
    floor = size.measured.floor
    parts = None if floor is None or size.predicted else floor.split(size.gated_rank, size.gated_mib)
    return None if parts is None else f"{parts[0]:.1f} + {parts[1]:.1f}"


def ran(simulated: Sequence[int], world: int) -> str:
    """Which ranks of a simulated world above 1 ran: every one, or which alone (the others did not)."""
    if world < 2 or not simulated:
        return ""
    if sorted(simulated) == list(range(world)):
        return ", every rank ran"
    if len(simulated) == 1:
        return f", rank {simulated[0]} ran alone"
    return f", ranks {', '.join(map(str, simulated))} ran"


def table(records: Iterable[TestRecord]) -> list[str]:
    """Fixed-width table, one row per test and world size; a "floor + job" column where a floor was
    measured (``--gpumem-floor``)."""
    records = list(records)
    with_floor = any(floor_split(size) for rec in records for size in rec.sizes)
    header: tuple[str, ...] = ("test", "nproc", "gated peak MiB", "others max", "ratio", "baseline", "device",
                               "verdict")
    if with_floor:
        header = header[:3] + ("floor + job MiB",) + header[3:]
    rows: list[tuple[str, ...]] = []
    resident = False
    for rec in records:
        if not rec.sizes:
            rows.append((rec.test, ",".join(map(str, rec.nproc)), "-", *(["-"] if with_floor else []),
                         "-", "-", "-", "-", rec.verdict))
        digits = rec.digits  # as many decimals as its failure text shows
        for size in rec.sizes:
            m = size.measured
            predicted = (", predicted" + ("" if size.validated else ", not validated")) if size.predicted else ""
            predicted += f", fake {m.fake_gpu}" if m.fake_gpu else ", simulated" if m.simulated else ""
            predicted += ran(m.simulated, size.nproc)
            predicted += f", {m.cuda_on_cpu}" if m.cuda_on_cpu else ""
            predicted += ", comm hook not run" if m.uncounted else ""
            predicted += ", values assumed" if m.supplied else ""
            gated_rss = size.gated_rank is not None and _resident(size, [size.gated_rank])
            others = [(peak.mib, r) for r, peak in m.peaks.items() if r != size.gated_rank and peak.mib is not None]
            others_rss = bool(others) and _resident(size, [max(others)[1]])  # the rank "others max" shows
            resident |= gated_rss or others_rss
            rows.append((
                rec.test,
                str(size.nproc) + ("*" if m.reused else "") + (" ref" if rec.unlisted(size) else ""),
                f"{_mib(size.gated_mib, digits)} ({size.gated_label}{', VmHWM' if gated_rss else ''}{predicted})",
                *([floor_split(size) or "-"] if with_floor else []),
                _mib(size.others_max_mib, digits) + (" VmHWM" if others_rss else ""),
                "-" if size.ratio is None else f"{size.ratio:.2f}x" + (" alloc" if size.ratio_figure == "allocated"
                                                                       else "")
                + ("" if rec.spec.reference == 1 else f" /{rec.spec.reference}"),
                _mib(size.baseline_mib, digits),
                size.device,
                rec.size_verdict(size),
            ))
    out = _aligned(header, rows)
    if any(size.measured.reused for rec in records for size in rec.sizes):
        out.append("* nproc=1 reference reused from an earlier launch in this session")
    if any(rec.unlisted(size) for rec in records for size in rec.sizes):
        out.append("ref: not in the marker's nproc, launched because max_ratio is taken against it; a job that "
                   "cannot run there names a listed size as its reference (reference=2)")
    if any(rec.spec.reference != 1 for rec in records):
        out.append("/N: the ratio is taken against nproc=N, the reference the marker names")
    by_allocator = [size for rec in records for size in rec.sizes if size.ratio_figure == "allocated"]
    if by_allocator:
        fake = [size.measured.fake_gpu for size in by_allocator]
        peak = ("what nvidia-smi shows" if not any(fake) else
                "the allocator's figure too (on a fake GPU every limit reads it)" if all(fake) else
                "the per-process figure of a real GPU, or on a fake GPU the allocator's figure")
        out.append("alloc: the ratio of the GPU allocator's figure (torch max_memory_allocated), "
                   f"which the ratio limit reads; the peak column is {peak}")
    if resident:
        out.append("VmHWM: a rank that ended without reporting its live allocations (killed, crashed, or "
                   "tracking off) is shown by its resident high-water mark, not comparable with live allocations")
    if with_floor:
        out.append("floor: what an empty job of the same framework takes at that size (start-up, "
                   "communicator; on GPU the CUDA context); job: the rest")
    out.extend(predicted_lines(records))
    return out


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header, a rule and the rows, each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def scaling_table(rec: TestRecord) -> list[str]:
    """``gpumem measure``'s table, one row per world size: the gated rank, the other ranks' range, the
    largest, the ratio to nproc=1; a predicted size says so and on what it stands."""
    header = ("nproc", "gated MiB", "other ranks MiB", "largest MiB", "ratio", "seconds", "how")
    rows = []
    for size in rec.sizes:
        peaks = size.measured.peaks
        ranks = {r: p.mib for r, p in peaks.items() if p.mib is not None}
        others = [v for r, v in ranks.items() if r != size.gated_rank]
        largest = max(ranks.items(), key=lambda item: item[1]) if ranks else None
        how = f"{size.device}, {size.basis}" if size.predicted else (
            f"{size.device}, " + ", ".join(sorted({p.method for p in peaks.values()}) or ["not available"]))
        rows.append((
            str(size.nproc) + (" (predicted)" if size.predicted else ""),
            f"{_mib(size.gated_mib)} ({size.gated_label})",
            "-" if not others else (_mib(min(others)) if min(others) == max(others)
                                    else f"{min(others):.1f}-{max(others):.1f}"),
            "-" if largest is None else f"{largest[1]:.1f} (rank {largest[0]})",
            "-" if size.ratio is None else f"{size.ratio:.2f}x",
            "-" if size.predicted else f"{size.measured.duration_s:.1f}",
            how,
        ))
    title = f"gpumem measure: {rec.test} ({rec.launcher} launcher): {rec.verdict}"
    if rec.status == "measured":
        title += " (no limits given: nothing judged)"
    return [title, *_aligned(header, rows)]


def message_sections(records: Iterable[TestRecord]) -> list[tuple[str, list[str]]]:
    """``(heading, lines)`` for each cause with messages: ``failed test: message``, under
    "limits exceeded", "ranks that failed", ... (a record without a cause: under its status)."""
    records = list(records)
    sections = []
    for cause, heading in SECTIONS:
        lines = [f"{rec.status} {rec.test}: {m}" for rec in records if rec.cause == cause for m in rec.messages]
        if lines:
            sections.append((heading, lines))
    other = [f"{rec.status} {rec.test}: {m}" for rec in records if rec.cause is None for m in rec.messages]
    if other:
        sections.append(("messages", other))
    return sections


def predicted_lines(records: Iterable[TestRecord]) -> list[str]:
    """``nproc=8 of test: predicted by a + b*N from nproc 1,2,4; LOO error 1.2%, not launched``."""
    return [f"nproc={size.nproc} of {rec.test}: {size.basis}, not launched"
            for rec in records for size in rec.sizes if size.predicted]


def refresh_lines(records: Iterable[TestRecord]) -> list[str]:
    """``test nproc=2: 512.3 -> 530.1 MiB (+3.5%)`` for each rewritten baseline entry."""
    lines = []
    for rec in records:
        for change in rec.baseline_changes:
            old, new = change.old_mib, change.new_mib
            if old is None:
                text = f"(new) -> {new:.1f} MiB"
            else:
                delta = (new - old) / old * 100 if old else 0.0
                text = f"{old:.1f} -> {new:.1f} MiB ({delta:+.1f}%)"
            if rec.status == "failed" and rec.cause == "limit":  # the figure stored is one its limits refuse
                text += " (this run fails its limits: the baseline now records that; review before committing)"
            lines.append(f"{rec.test} nproc={change.nproc}: {text}")
    return lines


def suggestion_lines(records: Iterable[TestRecord]) -> list[str]:
    """``test: max_ratio={2: 0.78, 8: 0.6} (measured 0.76x at 2, 0.58x at 8, each + 0.02)`` per test with
    a ratio, for the refresh that recorded a healthy run."""
    lines = []
    for record in records:
        ratio = suggested_ratio(record)
        if ratio is None:
            continue
        measured = ", ".join(f"{r:.2f}x at {n}" for n, r in measured_ratios(record).items())
        now = f"; the marker has {record.spec.max_ratio}" if record.spec.max_ratio is not None else ""
        lines.append(f"{record.test}: max_ratio={ratio} (measured {measured}, each + {HEADROOM}{now})")
    return lines


def summary(records: Sequence[TestRecord], baselines: Path, plots: Sequence[Path] = (),
            plots_dir: Path | None = None) -> list[tuple[str | None, list[str]]]:
    """The session's terminal summary as ``(section title, lines)``: the table, a section per cause
    with messages, the baselines refreshed; the plots written as a line without a section."""
    records = sorted(records, key=lambda r: r.test)
    sections: list[tuple[str | None, list[str]]] = [("peak memory per rank", table(records))]
    sections.extend(message_sections(records))
    refreshed = refresh_lines(records)
    if refreshed:
        sections.append((f"baselines refreshed in {baselines}", refreshed))
        suggested = suggestion_lines(r for r in records if r.baseline_changes)
        if suggested:
            sections.append(("ratio limits this run suggests (memory that shrinks with N takes a cap per size)",
                             suggested))
    if plots:
        sections.append((None, [f"gpumem: {len(plots)} plot{'s' if len(plots) > 1 else ''} written to {plots_dir}"]))
    return sections
