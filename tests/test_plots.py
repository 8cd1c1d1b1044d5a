"""Draw what you gate: a plot's main curve per rank is the gated figure over time, its peak marked
where it happened, the limits drawn against the figure they read; resident memory, where drawn, is
labelled "not gated". Checked on the figure's own data, from real launches of a passing and a
failing test, and on a GPU record (NVML samples beside the allocator's curve)."""

from __future__ import annotations

import json

import pytest

from pytest_gpumem.judging.record import AllocatedRecord, CheckRecord, RankPeak, SizeRecord, TestRecord, load_report
from pytest_gpumem.presentation import plots

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
        assert limits == [f"max_mib {record.limits.max_mib:.0f} [live allocations]"] * len(record.sizes)
    stored = json.loads(report.read_text())["tests"]
    assert all(size["live_timeline"] for test in stored for size in test["sizes"])


def test_on_a_gpu_each_limit_is_drawn_against_the_figure_it_reads():
    checks = (CheckRecord("max_mib", True, 14370.0, 20000.0, "", "device"),
              CheckRecord("baseline", False, 7905.0, 7803.9, "", "allocated"))
    size = SizeRecord(
        nproc=1, device="gpu", gated_rank=0, gated_label="rank 0", gated_mib=14370.0,
        ranks={0: RankPeak(14370.0, "per-pid sampled")}, checks=checks,
        timeline=((0.0, {0: 612.0}), (1.0, {0: 14370.0}), (2.0, {0: 14000.0})),
        allocated_ranks={0: AllocatedRecord(7905.0, 12876.0)}, allocated_mib=7905.0, allocated_baseline_mib=7765.1,
        live_timeline=((0.5, {0: 100.0}), (1.1, {0: 7905.0}), (1.9, {0: 2000.0})))
    record = TestRecord(test="t.py::test_fsdp", status="failed", cause="limit", nproc=(1,), sizes=(size,))
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
