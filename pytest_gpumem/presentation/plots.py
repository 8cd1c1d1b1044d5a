"""Memory-over-time plots, one PNG per test: each rank's samples and the limits they are judged by.

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
from ..sampling.allocations import is_allocation_method

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


def _series(size: SizeRecord) -> dict[int, tuple[list[float], list[float]]]:
    """Per rank: (seconds, MiB) from the record's timeline."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for t, point in size.timeline:
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


def _limit_label(record: TestRecord, kind: str, limit: float) -> str:
    limits = record.limits
    if kind == "max_mib":
        return f"max_mib {limit:.0f}"
    if kind == "max_ratio":
        return f"ratio limit {limits.max_ratio:.2f} x nproc=1 + {limits.allow_mib:.0f} = {limit:.0f}"
    return f"baseline + {limits.tolerance} = {limit:.0f}"


def _limits(record: TestRecord, size: SizeRecord) -> list[tuple[float, str, dict[str, Any]]]:
    """(MiB, label, line style) for every limit this size was judged by, as the gate computed it."""
    lines: list[tuple[float, str, dict[str, Any]]] = []
    if size.baseline_mib is not None:
        lines.append((size.baseline_mib, f"baseline {size.baseline_mib:.0f}",
                      {"color": "0.35", "linestyle": ":", "linewidth": 1.2}))
    for check in size.limits():
        assert check.limit_mib is not None
        style = _LIMIT_STYLE.get(check.kind, {"color": "0.5", "linestyle": "-."})
        lines.append((check.limit_mib, _limit_label(record, check.kind, check.limit_mib), style))
    return lines


def _size_title(record: TestRecord, size: SizeRecord) -> str:
    verdict = "FAIL" if size.failed else "ok"
    ratio = "" if size.ratio is None else f", {size.ratio:.2f}x nproc=1"
    if size.predicted:
        return (f"nproc={size.nproc} ({size.device} memory): PREDICTED, not launched: "
                f"{size.gated_label} {size.gated_mib or 0:.1f} MiB{ratio} — {verdict}\n{size.basis}")
    peak = "no peak measured" if size.gated_mib is None else f"{size.gated_label} peak {size.gated_mib:.1f} MiB"
    reused = ", reference reused" if size.reused else ""
    return f"nproc={size.nproc} ({size.device} memory): {peak}{ratio} — {verdict}{reused}"


def _rank_color(index: int, count: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * index / max(1, count - 1) if count > 1 else 0.25)


def _draw_predicted(ax: Any, record: TestRecord, size: SizeRecord) -> None:
    """Not a timeline (nothing ran): the measured peaks per world size, the fitted model through
    them, and the predicted point, against the limits."""
    from ..judging.predict import MODELS

    fit = size.prediction or {}
    points = sorted((int(n), float(v)) for n, v in (fit.get("fitted_on") or {}).items())
    target = size.nproc
    model = {m.name: m for m in MODELS}.get(fit.get("model", ""))
    if model is not None and points:
        xs = [points[0][0] + (target - points[0][0]) * i / 100 for i in range(101)]
        ys = [sum(c * term(x) for c, term in zip(fit.get("coefficients", []), model.terms)) for x in xs]
        ax.plot(xs, ys, color="tab:blue", linestyle="--", linewidth=1.0, label=f"fit: {fit.get('formula')}")
    ax.plot([n for n, _ in points], [v for _, v in points], "o", color="tab:blue", label="measured")
    left_out = sorted((int(n), float(v)) for n, v in (fit.get("left_out") or {}).items())
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
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right", ncol=2)


def _gated_label(size: SizeRecord) -> str:
    """Why the gated line need not touch the curves: it is measured another way than they are."""
    method = size.gated_method or "method unknown"
    if is_allocation_method(method):
        why = "tracked in the rank; the curves are resident memory"
    else:
        why = "exact peak; the curves are samples and can miss it"
    return f"gated peak {size.gated_mib or 0:.0f} ({method}: {why})"


def _draw_size(ax: Any, record: TestRecord, size: SizeRecord) -> None:
    if size.predicted:
        _draw_predicted(ax, record, size)
        return
    series = _series(size)
    for i, (rank, (xs, ys)) in enumerate(series.items()):
        is_gated = rank == size.gated_rank
        # Ranks in blues and greens: red, orange and grey stay free for the limits.
        color = _rank_color(i, len(series))
        curve = "RSS, sampled" if size.device == "cpu" else "sampled"
        ax.plot(xs, ys, label=f"rank {rank} ({curve}" + (", gated)" if is_gated else ")"), color=color,
                linewidth=1.8 if is_gated else 0.9, zorder=3 if is_gated else 2)
    if not series:
        ax.text(0.5, 0.5, "no samples recorded", transform=ax.transAxes, ha="center", va="center", color="0.4")
    if size.gated_mib is not None:
        ax.axhline(size.gated_mib, color="black", linewidth=0.6, alpha=0.6, label=_gated_label(size))
    for mib, label, style in _limits(record, size):
        ax.axhline(mib, label=label, **style)
    ax.set_title(_size_title(record, size), fontsize=9, loc="left")
    ax.set_ylabel("MiB")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right", ncol=2)


def plot(record: TestRecord, path: Path) -> None:
    """Write a PNG of every rank's memory over time, one panel per world size, limits drawn in."""
    Figure, FigureCanvasAgg = _matplotlib()
    sizes = list(record.sizes)
    panels = max(1, len(sizes))
    fig = Figure(figsize=(10, 1.2 + 2.8 * panels))
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    for ax, size in zip(axes, sizes):
        _draw_size(ax, record, size)
    if not sizes:
        axes[0].text(0.5, 0.5, "no launch measured", transform=axes[0].transAxes, ha="center", va="center")
    if not (sizes and sizes[-1].predicted):  # a predicted panel's x axis is nproc
        axes[-1].set_xlabel("seconds since launch")
    title = "\n".join(textwrap.wrap(record.test, 110))
    fig.suptitle(f"{title}\nverdict: {record.status}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


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
