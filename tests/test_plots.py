"""Draw what you gate: a plot's main curve per rank is the gated figure over time, its peak marked
where it happened, the limits drawn against the figure they read; resident memory, where drawn, is
labelled "not gated". Checked on the figure's own data, from real launches of a passing and a
failing test, and on a GPU record (NVML samples beside the allocator's curve)."""

from __future__ import annotations

import json

import pytest

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging.record import SizeRecord, TestRecord
from pytest_gpumem.judging.record_reader import load_report
from pytest_gpumem.judging.verdict import Check
from pytest_gpumem.presentation import plots
from pytest_gpumem.results.size import SizeResult
from pytest_gpumem.sampling import AllocatedPeak, Peak

pytest.importorskip("matplotlib")
# Loaded before pytester's runs, which unload whatever a run imported: matplotlib must stay whole.
pytest.importorskip("matplotlib.backends.backend_agg")
pytest.importorskip("matplotlib.figure")
pytestmark = pytest.mark.slow

JOBS = '''
import time
import pytest

MiB = 1024 * 1024


def hold(mib):
    block = bytearray(mib * MiB)  # touched: a live allocation memray counts at once
    time.sleep(0.3)  # several of memray's 10 ms snapshots at the peak
    return len(block)


@pytest.mark.gpumem(nproc=[1, 2], max_mib=400)
def test_fits():
    hold(120)


@pytest.mark.gpumem(nproc=[1, 2], max_mib=100)
def test_too_big():
    hold(160)
'''


def gated_lines(fig) -> list[tuple[str, float]]:
    """(label, highest point) of every curve whose legend calls it gated."""
    return [(line.get_label(), max(line.get_ydata())) for ax in fig.axes for line in ax.get_lines()
            if "(gated" in str(line.get_label()) and len(line.get_ydata())]


def test_a_passing_and_a_failing_plot_draw_the_gated_figure_up_to_its_reported_peak(pytester, launch_tag, tmp_path):
    pytester.makepyfile(JOBS)
    report = tmp_path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    for record in load_report(report):
        fig = plots.plot(record, tmp_path / plots.plot_filename(record.test))
        lines = gated_lines(fig)
        assert len(lines) == len(record.sizes), [label for label, _ in lines]
        for (label, highest), size in zip(lines, record.sizes):
            assert size.gated_mib is not None and "live allocations" in label
            # memray snapshots the live heap every 10 ms: a peak held 300 ms is in the curve, to the
            # allocation the sampling step can miss; the curve never goes above the reported peak
            assert highest <= size.gated_mib + 0.01, (record.test, size.nproc, highest, size.gated_mib)
            assert size.gated_mib - highest <= max(2.0, 0.01 * size.gated_mib), (highest, size.gated_mib)
        labels = [str(line.get_label()) for ax in fig.axes for line in ax.get_lines()]
        assert any("resident (RSS), not gated" in label for label in labels)
        assert not any("RSS" in label and "(gated" in label for label in labels)
        peaks = [label for label in labels if label.startswith("peak ")]
        assert peaks == [f"peak {s.gated_mib:.1f} MiB (live allocations, rank 0)" for s in record.sizes]
        limits = [text for ax in fig.axes for text in (str(h.get_label()) for h in ax.get_lines())
                  if text.startswith("max_mib")]
        assert limits == [f"max_mib {record.spec.max_mib:.0f} [live allocations]"] * len(record.sizes)
    stored = json.loads(report.read_text())["tests"]
    assert all(size["live_timeline"] for test in stored for size in test["sizes"])


def test_on_a_gpu_each_limit_is_drawn_against_the_figure_it_reads():
    checks = (Check("max_mib", 1, "rank 0", "gpu", 14370.0, 20000.0, True, "", figure="device"),
              Check("baseline", 1, "rank 0", "gpu", 7905.0, 7803.9, False, "", figure="allocated"))
    measured = SizeResult(
        1, "gpu", {0: Peak(14370.0, "per-pid sampled")},
        timeline=((0.0, {0: 612.0}), (1.0, {0: 14370.0}), (2.0, {0: 14000.0})),
        allocated={0: AllocatedPeak(7905.0, 12876.0, "torch")},
        live_timeline=((0.5, {0: 100.0}), (1.1, {0: 7905.0}), (1.9, {0: 2000.0})))
    size = SizeRecord(measured, gated_rank=0, gated_label="rank 0", gated_mib=14370.0, checks=checks,
                      allocated_mib=7905.0, allocated_baseline_mib=7765.1)
    record = TestRecord(test="t.py::test_fsdp", status="failed", cause="limit",
                        spec=parse_marker((), {"nproc": 1}, Defaults()), sizes=(size,))
    figure, canvas = plots._matplotlib()
    fig = figure()
    canvas(fig)
    ax = fig.subplots()
    plots._draw_size(ax, record, size)
    lines = {str(line.get_label()): max(line.get_ydata()) for line in ax.get_lines()}
    assert lines["rank 0 what nvidia-smi shows, sampled (gated: max_mib)"] == 14370.0
    assert lines["rank 0 torch allocated, from its history (gated: baseline)"] == 7905.0
    assert "peak 7905.0 MiB (allocated, rank 0)" in lines and "peak 14370.0 MiB (device figure, rank 0)" in lines
    assert "baseline + tolerance = 7804 [allocated]" in lines and "max_mib 20000 [device figure]" in lines
    assert "baseline 7765 [allocated]" in lines


def newcomer_size() -> SizeRecord:
    """The newcomer's nproc=1 panel: a 1500 MiB cap far above live figures of 473-538 MiB, a baseline
    and baseline + tolerance 16 MiB apart, RSS up to 1200 MiB running on after the gated curve,
    two ranks whose curves coincide."""
    checks = (Check("max_mib", 2, "rank 0", "cpu", 538.0, 1500.0, True, "", figure="host"),
              Check("baseline", 2, "rank 0", "cpu", 538.0, 560.0, True, "", figure="host"))
    live = tuple((t / 10, {0: 473.0 + 65.0 * (t == 10), 1: 473.0 + 65.0 * (t == 10)}) for t in range(18))
    rss = tuple((t / 10, {0: 600.0 + 30.0 * t, 1: 600.0 + 30.0 * t}) for t in range(21))
    measured = SizeResult(2, "cpu", {0: Peak(538.0, "live allocations (memray)"),
                                     1: Peak(538.0, "live allocations (memray)")},
                          timeline=rss, live_timeline=live)
    return SizeRecord(measured, gated_rank=0, gated_label="rank 0", gated_mib=538.0, checks=checks,
                      baseline_mib=544.0)


def test_the_axis_is_scaled_to_what_is_gated_and_a_far_cap_is_marked_at_the_top():
    size = newcomer_size()
    record = TestRecord(test="t.py::test_lm", status="passed", sizes=(size,),
                        spec=parse_marker((), {"nproc": 2, "max_mib": 1500.0}, Defaults()))
    figure, canvas = plots._matplotlib()
    fig = figure(figsize=(13, 4), layout="constrained")
    canvas(fig)
    ax = fig.subplots()
    plots._draw_size(ax, record, size)
    bottom, top = ax.get_ylim()
    # the gated curve, the baseline and baseline + tolerance are in view; the cap and most of RSS are not
    assert bottom == 0 and 560.0 < top < 1500.0 and top <= 560.0 * plots.HEADROOM + 0.01
    notes = [text.get_text() for text in ax.texts]
    assert "\u25b2 max_mib 1500 [live allocations] (above the scale)" in notes
    assert {"544", "560"} <= set(notes)  # the close lines carry their figures at the edge
    labels = {str(line.get_label()) for line in ax.get_lines()}
    assert "rank 0 resident (RSS), not gated; cut at the top" in labels
    assert "rank 1 live allocations (peak = rank 0's within 0.1 MiB)" in labels  # would hide under rank 0
    styles = {str(line.get_label()).split(" live")[0]: line.get_linestyle() for line in ax.get_lines()
              if " live allocations" in str(line.get_label())}
    assert styles["rank 0"] != styles["rank 1"]
    # why the gated curve ends where it ends: a marker at its last sample, before RSS ends
    ends = [line for line in ax.get_lines() if str(line.get_label()).startswith("gated curve ends")]
    assert len(ends) == 1 and list(ends[0].get_xdata()) == [1.7, 1.7]
    # the legend sits outside the axes, off the lines
    fig.canvas.draw()
    legend = ax.get_legend()
    assert legend is not None
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_the_scale_keeps_near_limits_and_leaves_far_ones_above():
    top, far = plots.y_scale([473.0, 538.0, 544.0, 560.0], [675.0, 1500.0])
    assert top == pytest.approx(675.0 * plots.HEADROOM) and far == [1500.0]
    assert plots.y_scale([], [1500.0]) == (None, [])
