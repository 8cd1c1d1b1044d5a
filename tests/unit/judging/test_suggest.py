"""The ratio caps a healthy run suggests: one per size for a job that shrinks, one for a flat job."""

from __future__ import annotations

from pytest_gpumem.config.spec import Defaults, Ratio, parse_marker
from pytest_gpumem.judging.record import BaselineChange, SizeRecord, TestRecord
from pytest_gpumem.judging.suggest import suggested_ratio
from pytest_gpumem.presentation.report import summary
from pytest_gpumem.results.size import SizeResult


def record(ratios: dict[int, float | None], nproc: tuple[int, ...] = (2, 8)) -> TestRecord:
    sizes = tuple(SizeRecord(SizeResult(n, "cpu", {}), 0, "rank 0", 100.0, ratio=r) for n, r in ratios.items())
    return TestRecord("t.py::test_fsdp", "passed", parse_marker((), {"nproc": list(nproc)}, Defaults()), sizes=sizes,
                      baseline_changes=tuple(BaselineChange(n, None, 100.0) for n in ratios))


def test_a_job_that_shrinks_gets_a_cap_per_size_each_its_ratio_plus_the_headroom():
    assert suggested_ratio(record({1: None, 2: 0.7634, 8: 0.5801})) == Ratio(sizes=((2, 0.79), (8, 0.61)))


def test_a_flat_job_gets_one_cap_and_a_job_without_a_ratio_none():
    assert suggested_ratio(record({1: None, 2: 1.01, 8: 1.04})) == Ratio(flat=1.06)
    assert suggested_ratio(record({2: None, 8: None})) is None
    # the unlisted reference and sizes that were not listed are not capped
    assert suggested_ratio(record({1: None, 2: 0.5, 4: 0.4}, nproc=(2,))) == Ratio(sizes=((2, 0.52),))


def test_the_refresh_summary_prints_the_suggestion_under_the_refreshed_baselines(tmp_path):
    sections = dict(summary([record({1: None, 2: 0.7634, 8: 0.5801})], tmp_path))
    lines = next(v for k, v in sections.items() if k and k.startswith("ratio limits this run suggests"))
    assert lines == ["t.py::test_fsdp: max_ratio={2: 0.79, 8: 0.61} (measured 0.76x at 2, 0.58x at 8, each + 0.02)"]
