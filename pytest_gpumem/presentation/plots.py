"""Memory-over-time plots, one PNG per test: each rank's samples and the limits they are judged by.

Read at a glance: the y-axis is scaled to the figures that matter (the gated curves, the baseline,
baseline + tolerance, the limits near them); a cap far above them is an arrow at the top edge, not a
line the axis stretches to, and resident memory (information only) is cut at the top. Ranks are told
apart by line style (a rank whose curve lies on the gated rank's says so), the legend sits outside
the axes, and where the gated curve ends before the others a marker says why.

matplotlib is optional (the ``plots`` extra): imported only when a plot is asked for, and drawn on
an Agg canvas of its own, so the user's pyplot state and backend are never touched.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from pathlib import Path
from typing import Any, Iterable

from ..judging.record import SizeRecord, TestRecord

INSTALL_HINT = "plots need matplotlib: pip install 'pytest-gpumem[plots]'"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), imported on first use."""
    try:
        import matplotlib  # noqa: F401  (first, so a missing package fails here and not half-way)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(INSTALL_HINT) from exc
    return Figure, FigureCanvasAgg


def check_available() -> None:
    """Raise PlotsUnavailable now: lets --gpumem-plots fail at start-up, not after an hour of launches."""
    _matplotlib()


def plot_filename(test_id: str) -> str:
    """A file name for a test id: readable, safe on every filesystem, unique per id."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", test_id.replace("::", "__")).strip("._")[-120:]
    digest = hashlib.sha1(test_id.encode()).hexdigest()[:8]
    return f"{stem}-{digest}.png"


def _series(timeline: tuple[tuple[float, Any], ...]) -> dict[int, tuple[list[float], list[float]]]:
    """Per rank: (seconds, MiB) from a record's timeline."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for t, point in timeline:
        for rank, mib in point.items():
            xs, ys = series.setdefault(rank, ([], []))
            xs.append(t)
            ys.append(mib)
    return dict(sorted(series.items()))


_LIMIT_STYLE = {
    "max_mib": {"color": "tab:red", "linestyle": "-", "linewidth": 1.2},
    "max_ratio": {"color": "tab:orange", "linestyle": "--", "linewidth": 1.2},
    "baseline": {"color": "0.35", "linestyle": "--", "linewidth": 1.0},
}


_FIGURE_NAME = {"device": "device figure", "allocated": "allocated", "host": "live allocations"}


def _limit_label(record: TestRecord, kind: str, limit: float, figure: str, nproc: int) -> str:
    of = f" [{_FIGURE_NAME[figure]}]" if figure in _FIGURE_NAME else ""
    if kind == "max_mib":
        return f"max_mib {limit:.0f}{of}"
    cap = record.spec.max_ratio.at(nproc) if record.spec.max_ratio is not None else None
    if kind == "max_ratio" and cap is not None:
        return (f"ratio limit {cap:.2f} x nproc={record.spec.reference} + {record.spec.allow_mib:.0f} "
                f"= {limit:.0f}{of}")
    return f"baseline + tolerance = {limit:.0f}{of}"


def _limits(record: TestRecord, size: SizeRecord) -> list[tuple[float, str, dict[str, Any]]]:
    """(MiB, label, line style) for every limit this size was judged by, as the gate computed it,
    each naming the figure it reads (the curve to compare it with)."""
    lines: list[tuple[float, str, dict[str, Any]]] = []
    stored = [(size.baseline_mib, "device" if size.device == "gpu" else "host"),
              (size.allocated_baseline_mib, "allocated")]
    if size.measured.fake_gpu:  # one figure, the allocator's
        stored = [(size.allocated_baseline_mib or size.baseline_mib, "allocated")]
    for mib, figure in stored:
        if mib is not None:
            lines.append((mib, f"baseline {mib:.0f} [{_FIGURE_NAME[figure]}]",
                          {"color": "0.35" if figure != "allocated" else "mediumpurple", "linestyle": ":",
                           "linewidth": 1.2}))
    for check in size.limits():
        assert check.limit_mib is not None
        style = dict(_LIMIT_STYLE.get(check.kind, {"color": "0.5", "linestyle": "-."}))
        if check.figure == "allocated":
            style["color"] = "tab:purple" if check.kind != "baseline" else "mediumpurple"
        label = _limit_label(record, check.kind, check.limit_mib, check.figure, size.nproc)
        lines.append((check.limit_mib, label, style))
    return lines


FAR = 1.5  # a limit above this many times the figures that matter is marked at the top edge, not scaled to
HEADROOM = 1.08  # the y-axis ends this far above the highest figure that matters
_RANK_STYLES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (4, 1.5, 1, 1.5)), (0, (8, 2, 1, 2)))


def _rank_style(index: int) -> Any:
    """A line style per rank (by its place in the panel): coinciding curves stay told apart."""
    return _RANK_STYLES[index % len(_RANK_STYLES)]


def y_scale(values: Iterable[float], limits: Iterable[float]) -> tuple[float | None, list[float]]:
    """(top of the y-axis, the limits above it) for the figures that matter (``values``: the gated
    curves, the baselines, baseline + tolerance) and the other limits: a limit within :data:`FAR`
    times the highest figure is scaled to, a farther one is left above the top and marked there.
    None: nothing to scale to (matplotlib's own scaling stands)."""
    values = [v for v in values if v is not None]
    limits = list(limits)
    if not values:
        return None, []
    top = max(values)
    near = [mib for mib in limits if mib <= FAR * top]
    top = max([top, *near]) * HEADROOM
    return (top if top > 0 else None), sorted(mib for mib in limits if top > 0 and mib > top)


def _size_title(record: TestRecord, size: SizeRecord) -> str:
    verdict = "FAIL" if size.failed else "ok"
    ratio = "" if size.ratio is None else f", {size.ratio:.2f}x nproc={record.spec.reference}"
    if size.predicted:
        return (f"nproc={size.nproc} ({size.device} memory): PREDICTED, not launched: "
                f"{size.gated_label} {size.gated_mib or 0:.1f} MiB{ratio} — {verdict}\n{size.basis}")
    peak = "no peak measured" if size.gated_mib is None else f"{size.gated_label} peak {size.gated_mib:.1f} MiB"
    measured = size.measured
    reused = ", reference reused" if measured.reused else ""
    reused += (f", FAKE GPU ({measured.fake_gpu}): the allocator's figure" if measured.fake_gpu else
               ", SIMULATED world (stand-in communicator)" if measured.simulated else "")
    return f"nproc={size.nproc} ({size.device} memory): {peak}{ratio} — {verdict}{reused}"


def _rank_color(index: int, count: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * index / max(1, count - 1) if count > 1 else 0.25)


def _draw_predicted(ax: Any, record: TestRecord, size: SizeRecord) -> None:
    """Not a timeline (nothing ran): the measured peaks per world size, the fitted model through
    them, and the predicted point, against the limits."""
    prediction = size.measured.prediction
    fit = prediction.fit if prediction is not None else None
    points = list(fit.points) if fit is not None else []
    target = size.nproc
    if fit is not None and points:
        xs = [points[0][0] + (target - points[0][0]) * i / 100 for i in range(101)]
        ax.plot(xs, [fit.at(x) for x in xs], color="tab:blue", linestyle="--", linewidth=1.0,
                label=f"fit: {fit.model.formula}")
    ax.plot([n for n, _ in points], [v for _, v in points], "o", color="tab:blue", label="measured")
    left_out = list(fit.left_out) if fit is not None else []
    if left_out:
        ax.plot([n for n, _ in left_out], [v for _, v in left_out], "x", color="0.4", markersize=8,
                label="measured, left out of the fit (off the trend)")
    if size.gated_mib is not None:
        ax.plot([target], [size.gated_mib], "D", color="tab:purple", markersize=8,
                label=f"predicted {size.gated_mib:.0f}")
    for mib, label, style in _limits(record, size):
        ax.axhline(mib, label=label, **style)
    ax.set_title(_size_title(record, size), fontsize=9, loc="left")
    ax.set_xlabel("nproc")
    ax.set_ylabel("MiB")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _legend(ax: Any) -> None:
    """Outside the axes, to the right: never over a line."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.05, 1.0), borderaxespad=0.0)


def _readers(size: SizeRecord, figure: str) -> list[str]:
    """The limits that read ``figure`` at this size: what makes a curve the gated one."""
    return sorted({c.kind.replace("max_ratio", "ratio") for c in size.limits() if c.figure == figure})


def _curves(size: SizeRecord) -> list[tuple[str, str, dict[int, tuple[list[float], list[float]]], float | None]]:
    """(figure, what it is, per-rank samples, the figure's reported peak of the gated rank).

    On the host the gated curve is the live heap (memray's snapshots), resident memory beside it
    is not gated; on a GPU the device figure is NVML's samples and the allocator figure the
    allocator's history replayed. Older records without a live curve draw what they have.
    """
    if size.measured.fake_gpu:  # one figure: the allocator's, its curve from the fake GPU's history
        return [("allocated", f"torch allocated on the fake {size.measured.fake_gpu}",
                 _series(size.measured.live_timeline), size.allocated_mib or size.gated_mib)]
    if size.device == "gpu":
        curves = [("device", "what nvidia-smi shows, sampled", _series(size.measured.timeline), size.gated_mib)]
        if size.measured.live_timeline:
            curves.append(("allocated", "torch allocated, from its history", _series(size.measured.live_timeline),
                           size.allocated_mib))
        return curves
    curves = []
    if size.measured.live_timeline:
        curves.append(("host", "live allocations", _series(size.measured.live_timeline), size.gated_mib))
    curves.append(("rss", "resident (RSS), not gated", _series(size.measured.timeline), None))
    return curves


_ENDS = {
    "host": "gated curve ends: rank {rank}'s exit report stops memray\n(RSS is sampled on until the process is gone)",
    "allocated": "allocator curve ends: rank {rank}'s test body ended\n(NVML is sampled on until the process is gone)",
}


def _draw_size(ax: Any, record: TestRecord, size: SizeRecord) -> None:
    if size.predicted:
        _draw_predicted(ax, record, size)
        return
    drawn = False
    matters: list[float] = []  # the figures the y-axis is scaled to
    rss: list[tuple[Any, float]] = []  # (line, highest point) of the information-only curves
    ends: dict[str, float] = {}  # figure -> where the gated rank's curve ends
    gated_peaks: dict[str, float] = {}
    curves = _curves(size)
    for figure, what, series, peak in curves:
        readers = _readers(size, figure) if figure != "rss" else []
        gated = f"gated: {', '.join(readers)}" if readers else ("not gated" if figure == "rss" else "")
        highest = {rank: max(ys) for rank, (xs, ys) in series.items() if ys}
        reference = highest.get(size.gated_rank) if size.gated_rank is not None else None
        for i, (rank, (xs, ys)) in enumerate(series.items()):
            is_gated_rank = rank == size.gated_rank
            if figure == "rss":  # information, drawn under the rest
                line, = ax.plot(xs, ys, color="0.7", linewidth=0.8, linestyle="--", zorder=1,
                                label=f"rank {rank} {what}" if i == 0 or is_gated_rank else None)
                rss.append((line, max(ys) if ys else 0.0))
                if is_gated_rank and xs:
                    ends["rss"] = xs[-1]
                drawn = True
                continue
            matters.extend(ys)
            color = _rank_color(i, len(series)) if figure != "allocated" else "tab:purple"
            label = f"rank {rank} {what}" + (f" ({gated})" if gated and is_gated_rank else "")
            if not is_gated_rank and reference is not None and rank in highest:
                gap = abs(highest[rank] - reference)
                if gap <= max(1.0, 0.005 * reference):  # drawn over the gated one, dashed: it would hide
                    label += f" (peak = rank {size.gated_rank}'s within {max(gap, 0.05):.1f} MiB)"
            style = _rank_style(i) if figure != "allocated" else "-."
            ax.plot(xs, ys, label=label, color=color, linewidth=1.8 if is_gated_rank else 1.0,
                    zorder=3 if is_gated_rank else 3.5, linestyle=style)
            drawn = True
            if is_gated_rank and xs:
                ends[figure] = xs[-1]
            if is_gated_rank and peak is not None and ys:
                gated_peaks[figure] = peak
                at = xs[max(range(len(ys)), key=ys.__getitem__)]
                ax.plot([at], [peak], marker="v", color="black", markersize=7, linestyle="none", zorder=4,
                        label=f"peak {peak:.1f} MiB ({_FIGURE_NAME.get(figure, figure)}, rank {rank})")
    if not drawn:
        ax.text(0.5, 0.5, "no samples recorded", transform=ax.transAxes, ha="center", va="center", color="0.4")
    limits = _limits(record, size)
    for mib, label, style in limits:
        ax.axhline(mib, label=label, **style)
    # The baselines and baseline + tolerance always matter; the other limits only when near.
    matters += [mib for mib, label, _ in limits if label.startswith(("baseline", "baseline + tolerance"))]
    matters += list(gated_peaks.values())
    top, far = y_scale(matters, [mib for mib, label, _ in limits if not label.startswith("baseline")])
    if top is not None:
        ax.set_ylim(0, top)
        _mark_far(ax, [(mib, label, style) for mib, label, style in limits if mib in far])
        _tag_limits(ax, [(mib, style) for mib, _, style in limits if mib <= top], top)
        for line, tallest in rss:
            if tallest > top and line.get_label() and not str(line.get_label()).startswith("_"):
                line.set_label(f"{line.get_label()}; cut at the top")
    _mark_ends(ax, size, ends, curves)
    ax.set_title(_size_title(record, size), fontsize=9, loc="left")
    ax.set_ylabel("MiB")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _tag_limits(ax: Any, limits: list[tuple[float, dict[str, Any]]], top: float) -> None:
    """Each horizontal line's MiB at the right edge, nudged apart where lines lie close (a baseline
    and baseline + tolerance 16 MiB apart read as two numbers, not one thick line)."""
    placed = float("-inf")
    for mib, style in sorted(limits, key=lambda item: item[0]):
        y = max(mib, placed + 0.05 * top)
        placed = y
        ax.text(1.005, y, f"{mib:.0f}", transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=7,
                color=style.get("color", "0.3"), clip_on=False)


def _mark_far(ax: Any, far: list[tuple[float, str, dict[str, Any]]]) -> None:
    """Limits far above what is drawn: named at the top edge, right of the title (an upward
    triangle: above the scale), not a line the axis stretches to."""
    for k, (mib, label, style) in enumerate(sorted(far, key=lambda item: item[0], reverse=True)):
        ax.text(1.0, 1.01 + 0.09 * k, f"\u25b2 {label} (above the scale)", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=7, color=style.get("color", "0.3"), clip_on=False)


def _mark_ends(ax: Any, size: SizeRecord, ends: dict[str, float], curves: list[Any]) -> None:
    """Where the gated rank's gated curve ends well before the sampled one (memray stops at the exit
    report, torch's history at the body's end; RSS and NVML are sampled until the process is gone),
    a vertical marker says so."""
    sampled = ends.get("rss" if size.device == "cpu" else "device")
    figure = "host" if size.device == "cpu" else "allocated"
    end = ends.get(figure)
    xs = [x for _, _, series, _ in curves for xs_, _ in series.values() for x in xs_[:1] + xs_[-1:]]
    if end is None or sampled is None or not xs:
        return
    if sampled - end > 0.03 * (max(xs) - min(xs)):
        ax.axvline(end, color="0.45", linestyle=":", linewidth=1.0, zorder=1,
                   label=_ENDS[figure].format(rank=size.gated_rank))


def plot(record: TestRecord, path: Path) -> Any:
    """Write a PNG of every rank's memory over time, one panel per world size, limits drawn in;
    returns the figure (its lines are the data a test can check)."""
    Figure, FigureCanvasAgg = _matplotlib()
    sizes = list(record.sizes)
    panels = max(1, len(sizes))
    fig = Figure(figsize=(13, 1.2 + 2.8 * panels), layout="constrained")  # room for the legends outside
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    for ax, size in zip(axes, sizes):
        _draw_size(ax, record, size)
    if not sizes:
        axes[0].text(0.5, 0.5, "no launch measured", transform=axes[0].transAxes, ha="center", va="center")
    if not (sizes and sizes[-1].predicted):  # a predicted panel's x axis is nproc
        axes[-1].set_xlabel("seconds since launch")
    title = "\n".join(textwrap.wrap(record.test, 110))
    fig.suptitle(f"{title}\nverdict: {record.verdict}", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return fig


def plot_all(records: Iterable[TestRecord], directory: Path) -> list[Path]:
    """One PNG per measured test in ``directory``; returns the paths written."""
    written = []
    for rec in records:
        if not rec.sizes:
            continue
        path = Path(directory) / plot_filename(rec.test)
        plot(rec, path)
        written.append(path)
    return written
