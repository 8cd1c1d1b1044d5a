"""Every limit pinned at its edge: exactly at the limit passes, just above it fails.

One test per check of ``verdict.judge`` (max_mib, max_ratio + allow_mib, baseline + tolerance, the
"below the baseline" note) and of ``gpumem diff``, which applies the gate's own rule
(``verdict.against_reference``). The numbers are exact in binary floating point, so "at the limit"
is the limit itself; "just above" is 0.01 MiB over (far below any slack a mutant would add).
``make mutate`` runs mutmut over the code these tests pin.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem import cli
from pytest_gpumem.config.spec import DEFAULT_TOLERANCE, Defaults, Tolerance, parse_marker, parse_tolerance
from pytest_gpumem.judging import report_diff
from pytest_gpumem.judging.record import SizeRecord, TestRecord, report_document
from pytest_gpumem.judging.verdict import BaselineRef, against_reference, judge
from pytest_gpumem.results.predict import predict
from pytest_gpumem.results.size import FloorResult, SizeResult, gated_reading
from pytest_gpumem.sampling import Peak

JUST = 0.01  # MiB


def result(n: int, *mibs: float | None) -> SizeResult:
    return SizeResult(world_size=n, device="cpu", peaks={r: Peak(m, "high-water mark") for r, m in enumerate(mibs)})


def spec(**kw: Any):
    return parse_marker((), kw, Defaults(tolerance=parse_tolerance("max(5%, 32MiB)")))


def kinds(verdict) -> list[tuple[str, int, bool]]:
    return [(c.kind, c.world_size, c.ok) for c in verdict.checks]


# -- max_mib ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mib, ok", [(999.0, True), (1000.0, True), (1000.0 + JUST, False)])
def test_max_mib_edge(mib, ok):
    v = judge(spec(nproc=1, max_mib=1000), [result(1, mib)])
    assert kinds(v) == [("max_mib", 1, ok)] and v.passed is ok
    assert v.checks[0].limit_mib == 1000.0


def test_max_mib_applies_at_every_size_to_the_gated_rank_only():
    v = judge(spec(nproc=[1, 2], max_mib=1000), [result(1, 1000.0), result(2, 1000.0, 5000.0)])
    assert v.passed
    v = judge(spec(nproc=2, max_mib=1000, rank=1), [result(2, 5000.0, 1000.0 + JUST)])
    assert kinds(v) == [("max_mib", 2, False)]


# -- max_ratio + allow_mib -------------------------------------------------------------------


@pytest.mark.parametrize(
    "allow, mib, ok",
    [
        (0, 1500.0, True),            # 1.5 x 1000 exactly
        (0, 1500.0 + JUST, False),
        (64, 1564.0, True),           # 1.5 x 1000 + 64 exactly
        (64, 1564.0 + JUST, False),
    ],
)
def test_ratio_edge_with_and_without_allowance(allow, mib, ok):
    v = judge(spec(nproc=[1, 2], max_ratio=1.5, allow_mib=allow), [result(1, 1000.0), result(2, mib)])
    assert kinds(v) == [("max_ratio", 2, ok)]
    assert v.checks[0].limit_mib == 1500.0 + allow
    digits = 1 if ok else 2  # a failure 0.01 MiB over its limit shows the hundredths that make it fail
    assert f"= {1500.0 + allow:.{digits}f} MiB (ratio {mib / 1000:.2f}x)" in v.checks[0].detail


def test_ratio_is_not_checked_at_nproc_1_nor_without_a_reference():
    assert kinds(judge(spec(nproc=[1, 2], max_ratio=1.5), [result(1, 1000.0)])) == []
    assert kinds(judge(spec(nproc=[1, 2], max_ratio=1.5), [result(2, 9999.0)])) == []


def test_ratio_against_a_zero_reference_gates_on_the_allowance_without_dividing():
    at = judge(spec(nproc=[1, 2], max_ratio=1.5, allow_mib=64), [result(1, 0.0), result(2, 64.0)])
    above = judge(spec(nproc=[1, 2], max_ratio=1.5, allow_mib=64), [result(1, 0.0), result(2, 64.0 + JUST)])
    assert at.passed and not above.passed
    assert str(above.failures[0]) == ("rank 0 at nproc=2 (cpu): peak 64.01 MiB > 1.50 x 0.00 MiB (nproc=1) + 64 MiB"
                                      " = 64.00 MiB (no ratio: the nproc=1 peak is 0 MiB)")
    assert at.ratio(2) is None and "2: 64.0 MiB" in at.summary_line()


def test_ratio_uses_the_reference_of_the_gated_rank():
    v = judge(spec(nproc=[1, 2], max_ratio=1.0, rank="all"), [result(1, 1000.0), result(2, 900.0, 1000.0)])
    assert v.passed
    v = judge(spec(nproc=[1, 2], max_ratio=1.0, rank="all"), [result(1, 1000.0), result(2, 900.0, 1000.0 + JUST)])
    assert kinds(v) == [("max_ratio", 2, False)] and "rank 1 (largest)" in str(v.failures[0])


# -- baseline + tolerance, and the improvement note -----------------------------------------


@pytest.mark.parametrize(
    "tolerance, base, limit, shown",
    [
        ("5%", 1000.0, 1050.0, "5% (50.0 MiB)"),
        ("32MiB", 1000.0, 1032.0, "32 MiB"),
        ("max(5%, 32MiB)", 1000.0, 1050.0, "max(5% = 50.0, 32) MiB"),   # the percentage is larger here
        ("max(5%, 32MiB)", 400.0, 432.0, "max(5% = 20.0, 32) MiB"),     # the MiB part is larger here
        ("1GiB", 1000.0, 2024.0, "1024 MiB"),
        ("0%", 1000.0, 1000.0, "0% (0.0 MiB)"),
    ],
)
def test_baseline_edge(tolerance, base, limit, shown):
    tol = parse_tolerance(tolerance)
    refs = {2: BaselineRef(base, tol)}
    at = judge(spec(nproc=2), [result(2, limit)], refs)
    above = judge(spec(nproc=2), [result(2, limit + JUST)], refs)
    assert kinds(at) == [("baseline", 2, True)] and kinds(above) == [("baseline", 2, False)]
    assert at.checks[0].limit_mib == limit
    assert f"baseline {base:.1f} MiB + {shown} = {limit:.1f} MiB" in str(at.checks[0])
    assert (f"peak {limit + JUST:.2f} MiB > baseline {base:.2f} MiB + {shown} = {limit:.2f} MiB"
            in str(above.failures[0]))


@pytest.mark.parametrize(
    "tolerance, base, floor",
    [("5%", 1000.0, 950.0), ("32MiB", 1000.0, 968.0), ("max(5%, 32MiB)", 400.0, 368.0), ("0%", 1000.0, 1000.0)],
)
def test_improvement_note_edge(tolerance, base, floor):
    refs = {2: BaselineRef(base, parse_tolerance(tolerance))}
    at = judge(spec(nproc=2), [result(2, floor)], refs)
    below = judge(spec(nproc=2), [result(2, floor - JUST)], refs)
    assert at.passed and below.passed
    assert at.notes == ()
    assert len(below.notes) == 1
    shown = parse_tolerance(tolerance).explain(base)
    assert f"is below the baseline {base:.1f} MiB by more than {shown}; refresh the baseline" in below.notes[0]


def test_baselines_only_for_requested_sizes_and_notes_kept():
    refs = {1: BaselineRef(10.0, Tolerance(percent=0.0)), 2: BaselineRef(1000.0, Tolerance(percent=0.0))}
    v = judge(spec(nproc=2, max_ratio=2.0), [result(1, 500.0), result(2, 1000.0)], refs, notes=("given",))
    assert kinds(v) == [("max_ratio", 2, True), ("baseline", 2, True)]  # nproc=1 is only the ratio's reference
    assert v.notes == ("given",)


@pytest.mark.parametrize(
    "measured, kind",
    [(1050.0 + JUST, "regression"), (1050.0, "unchanged"), (1000.0, "unchanged"), (950.0, "unchanged"),
     (950.0 - JUST, "improved")],
)
def test_the_one_rule(measured, kind):
    assert against_reference(measured, 1000.0, Tolerance(percent=5.0)) == (kind, 50.0)


# -- gpumem diff: the same rule ---------------------------------------------------------------


def report(mib: float, tolerance: str = "5%") -> list[TestRecord]:
    size = SizeRecord(SizeResult(2, "cpu", {}), gated_rank=0, gated_label="rank 0", gated_mib=mib)
    return [TestRecord("t.py::test", "passed", spec(nproc=2, tolerance=tolerance or DEFAULT_TOLERANCE), sizes=(size,))]


@pytest.mark.parametrize(
    "new, kind",
    [(1050.0, "unchanged"), (1050.0 + JUST, "regression"), (950.0, "unchanged"), (950.0 - JUST, "improved")],
)
def test_diff_edge(new, kind):
    row = report_diff.diff_reports(report(1000.0), report(new)).rows[0]
    assert (row.kind, row.allowance_mib, row.tolerance) == (kind, 50.0, "5%")


def test_diff_without_a_tolerance_in_the_record_uses_the_default():
    new = report(1050.0 + JUST, tolerance="")
    assert report_diff.diff_reports(report(1000.0), new).rows[0].kind == "regression"  # 5% = 50 > 32 MiB
    assert report_diff.diff_reports(report(400.0), report(432.0, "")).rows[0].kind == "unchanged"  # 32 MiB > 5%
    assert report_diff.diff_reports(report(400.0), report(432.0 + JUST, "")).rows[0].kind == "regression"


def test_diff_override_tolerance_edge():
    assert report_diff.diff_reports(report(1000.0), report(1100.0), "10%").rows[0].kind == "unchanged"
    assert report_diff.diff_reports(report(1000.0), report(1100.0 + JUST), "10%").rows[0].kind == "regression"


def test_diff_of_a_fake_gpu_size_is_one_row_for_its_one_figure():
    """Issue 55: 9569.6 -> 9694.5 read 'REGRESSION' (allocator, 0.5%) and 'unchanged' (device, 5%) at once."""
    def fake(mib: float, fake_gpu: str = "NVIDIA H200") -> list[TestRecord]:
        measured = SizeResult(1, "gpu", {}, fake_gpu=fake_gpu)
        size = SizeRecord(measured, gated_rank=0, gated_label="rank 0", gated_mib=mib, allocated_mib=mib)
        return [TestRecord("t.py::test", "passed", spec(nproc=1, tolerance="max(5%, 32MiB)"), sizes=(size,))]

    rows = report_diff.diff_reports(fake(9569.6), fake(9694.5)).rows
    assert [(row.figure, row.kind) for row in rows] == [("allocated", "regression")]
    real = report_diff.diff_reports(fake(9569.6, ""), fake(9694.5, "")).rows  # a real GPU has two figures
    assert sorted((row.figure, row.kind) for row in real) == [("", "unchanged"), ("allocated", "regression")]


@pytest.mark.parametrize("new, code", [(1050.0, 0), (1050.0 + JUST, 1)])
def test_diff_command_exit_code_edge(tmp_path: Path, new, code):
    paths = []
    for name, mib in (("old", 1000.0), ("new", new)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report_document(report(mib))))
        paths.append(str(path))
    assert cli.main(["diff", *paths]) == code


# -- what the verdict says: every word a reviewer reads --------------------------------------


def test_unmeasured_size_fails_and_the_larger_sizes_are_still_judged():
    v = judge(spec(nproc=[1, 2], max_mib=100), [result(1, None), result(2, 100.0 + JUST)])
    assert kinds(v) == [("measured", 1, False), ("max_mib", 2, False)]
    assert str(v.checks[0]) == "rank 0 at nproc=1 (cpu): no peak could be measured (high-water mark)"
    assert str(v.checks[1]) == "rank 0 at nproc=2 (cpu): peak 100.01 MiB > max_mib 100.00 MiB"


def test_ratio_text_against_a_reference_below_1_mib():
    v = judge(spec(nproc=[1, 2], max_ratio=2.0), [result(1, 0.5), result(2, 1.0)])
    assert str(v.checks[0]) == ("rank 0 at nproc=2 (cpu): peak 1.0 MiB <= 2.00 x 0.5 MiB (nproc=1) + 0 MiB"
                                " = 1.0 MiB (ratio 2.00x)")
    assert v.ratio(2) == 2.0


def test_ratio_is_none_without_both_sizes_or_a_positive_reference():
    s = spec(nproc=[1, 2, 4], max_ratio=10.0)
    v = judge(s, [result(1, 100.0), result(2, 150.0)])
    assert (v.ratio(1), v.ratio(2), v.ratio(4)) == (None, 1.5, None)
    assert judge(s, [result(2, 150.0), result(4, 150.0)]).ratio(4) is None
    assert judge(s, [result(1, None), result(2, 150.0)]).ratio(2) is None
    assert judge(s, [result(1, 100.0), result(2, None)]).ratio(2) is None
    assert judge(s, [result(1, 0.0), result(2, 150.0)]).ratio(2) is None


def test_a_gated_rank_with_no_peak_at_all_fails_as_unmeasured():
    v = judge(spec(nproc=2, rank=1, max_mib=100), [result(2, 50.0)])  # rank 1 reported nothing
    assert kinds(v) == [("measured", 2, False)]
    assert str(v.checks[0]) == "rank 1 at nproc=2 (cpu): no peak could be measured (high-water mark)"


def test_others_max_is_the_largest_other_measured_rank():
    three = result(3, 600.0, 650.0, None)
    assert tuple(gated_reading(three, rank).others_mib for rank in (0, 1, 2, "all")) == (
        650.0, 600.0, 650.0, 600.0)  # under rank="all" the others are all but the largest (issue 55)
    assert gated_reading(result(1, 500.0), 0).others_mib is None
    assert gated_reading(result(2, 500.0, None), 0).others_mib is None
    assert gated_reading(result(1, 500.0), "all").others_mib is None  # one rank: no others


def test_the_rendering_of_floors_resident_memory_nodes_and_predicted_sizes():
    """Information lines: the floor split (CUDA context and communicator only where they exist), the
    resident high-water mark (cpu only), the node of each rank, and every predicted size."""
    hwm = "high-water mark"
    launched = [
        SizeResult(1, "cpu", {0: Peak(500.0, hwm)}, floor=FloorResult("torch", {0: 300.0})),
        SizeResult(2, "gpu", {0: Peak(600.0, "per-pid sampled"), 1: Peak(650.0, "per-pid sampled"),
                              2: Peak(None, "not available")},
                   floor=FloorResult("torch", {0: 310.0, 1: 315.0, 2: 320.0}), rss_peaks={0: 900.0},
                   nodes={0: "node-a", 1: "node-b"}),
        SizeResult(3, "cpu", {0: Peak(700.0, hwm), 1: Peak(710.0, hwm)}, rss_peaks={1: 720.04, 0: 730.0}),
    ]
    fitted = [(1, 500.0), (3, 700.0)]
    predicted = [SizeResult(n, "cpu", {}, prediction=predict(fitted, n)) for n in (8, 16)]
    v = judge(spec(nproc=[1, 2, 3, 8, 16]), launched + predicted)
    assert v.passed and v.render().splitlines() == [
        "  rank 0 peak, nproc 1: 500.0 MiB | 2: 600.0 MiB (1.20x) | 3: 700.0 MiB (1.40x)"
        " | 8: 1200.0 MiB (2.40x) predicted | 16: 2000.0 MiB (4.00x) predicted",
        "  nproc=1 cpu MiB per rank {0: 500.0} [high-water mark]",
        "    floor + job's own MiB per rank {0: 300.0 + 200.0} (floor: an empty job, torch start-up)",
        "  nproc=2 gpu MiB per rank {0: 600.0 on node-a, 1: 650.0 on node-b, 2: n/a} [not available, per-pid sampled]",
        "    floor + job's own MiB per rank {0: 310.0 + 290.0, 1: 315.0 + 335.0}"
        " (floor: an empty job, CUDA context + torch start-up + communicator)",
        "  nproc=3 cpu MiB per rank {0: 700.0, 1: 710.0} [high-water mark]",
        "    resident high-water mark (VmHWM, not gated: follows the page cache) {0: 730.0, 1: 720.0}",
        "  nproc=8 cpu MiB rank 0 1200.0, predicted by a + b*N from nproc 1,3; LOO error n/a: two sizes"
        " (not launched)",
        "  nproc=16 cpu MiB rank 0 2000.0, predicted by a + b*N from nproc 1,3; LOO error n/a: two sizes"
        " (not launched)",
    ]


def test_the_whole_rendering_of_a_failing_verdict():
    refs = {4: BaselineRef(1000.0, parse_tolerance("5%"))}
    results = [
        SizeResult(1, "cpu", {0: Peak(500.0, "high-water mark")}, reused=True),
        SizeResult(2, "cpu", {0: Peak(600.0, "high-water mark"), 1: Peak(None, "not available")}),
        SizeResult(4, "gpu", {r: Peak(900.0 + r, "per-pid sampled") for r in range(4)}),
    ]
    v = judge(spec(nproc=[2, 4], max_ratio=1.5, max_mib=2000, rank="all"), results, refs, notes=("a note",))
    assert v.render().splitlines() == [
        "gpumem: 903.0 MiB > ratio limit 750.0 MiB (rank 3 (largest), nproc=4)",
        "  rank 3 (largest) at nproc=4 (gpu): peak 903.0 MiB > 1.50 x 500.0 MiB (nproc=1) + 0 MiB = 750.0 MiB"
        " (ratio 1.81x)",
        "  largest rank peak, nproc 1: 500.0 MiB | 2: 600.0 MiB (1.20x) | 4: 903.0 MiB (1.81x) FAIL",
        "  nproc=1 cpu MiB per rank {0: 500.0} [high-water mark] (reference reused)",
        "  nproc=2 cpu MiB per rank {0: 600.0, 1: n/a} [high-water mark, not available]",
        "  nproc=4 gpu MiB per rank {0: 900.0, 1: 901.0, 2: 902.0, 3: 903.0} [per-pid sampled]",
        "  note: a note",
        "  note: rank 3 (largest) at nproc=4: peak 903.0 MiB is below the baseline 1000.0 MiB by more than "
        "5% (50.0 MiB); refresh the baseline to tighten it",
    ]


def test_the_rendering_of_a_passing_verdict_and_of_unmeasured_ranks():
    v = judge(spec(nproc=2, max_mib=1000), [result(2, 10.0, None)])
    assert v.passed and v.render().splitlines() == [
        "  rank 0 peak, nproc 2: 10.0 MiB",
        "  nproc=2 cpu MiB per rank {0: 10.0, 1: n/a} [high-water mark]",
    ]
    assert str(v.checks[0]) == "rank 0 at nproc=2 (cpu): peak 10.0 MiB <= max_mib 1000.0 MiB"
    every = judge(spec(nproc=2, rank="all"), [result(2, None, None)])
    assert every.readings[2].label == "all ranks" and every.readings[2].mib is None
    assert "largest rank peak, nproc 2: n/a FAIL" in every.render()
    assert SizeResult(1, "cpu", {}).methods == "not available"


# -- tolerances: parsed, shown and refused in so many words ----------------------------------


@pytest.mark.parametrize(
    "text, shown, percent, mib",
    [("5%", "5%", 5.0, None), ("256MiB", "256MiB", None, 256.0), ("1GiB", "1024MiB", None, 1024.0),
     ("max(5%, 32MiB)", "max(5%, 32MiB)", 5.0, 32.0), ("max(32MiB,5%)", "max(5%, 32MiB)", 5.0, 32.0),
     (" max ( 2.5 % , 1.5 GiB ) ", "max(2.5%, 1536MiB)", 2.5, 1536.0),
     ],
)
def test_tolerance_parsed_and_shown(text, shown, percent, mib):
    tol = parse_tolerance(text)
    assert (tol.percent, tol.mib, str(tol)) == (percent, mib, shown)
    assert parse_tolerance(tol) is tol


def test_no_tolerance_is_zero():
    assert str(Tolerance()) == "0" and Tolerance().allowance(1000.0) == 0.0 and Tolerance().explain(1000.0) == "0 MiB"


@pytest.mark.parametrize(
    "value, message",
    [(5, 'tolerance=5 is not accepted: expected "auto" or a string like "5%", "256MiB" or "max(5%, 256MiB)" '
         '(the larger of the two)'),
     ("-5%", "tolerance='-5%' is not accepted: expected \"auto\" or a string like \"5%\", \"256MiB\" or "
             "\"max(5%, 256MiB)\" (the larger of the two) (non-negative)"),
     ("5", "tolerance='5' is not accepted"), ("5 MB", "tolerance='5 MB' is not accepted"),
     ("5%+", "tolerance='5%+' is not accepted"), ("max(5%, 32MiB", "tolerance='max(5%, 32MiB' is not accepted"),
     ("min(5%, 32MiB)", "tolerance='min(5%, 32MiB)' is not accepted"), ("max()", "tolerance='max()' is not accepted"),
     # spellings of a release that never happened: a sum sign, a bare comma, a list
     ("5%+32MiB", "tolerance='5%+32MiB' is not accepted"), ("5%, 32MiB", "tolerance='5%, 32MiB' is not accepted"),
     (["10%", "64MiB"], "tolerance=['10%', '64MiB'] is not accepted")],
)
def test_tolerance_refused_naming_what_is_accepted(value, message):
    from pytest_gpumem.config.spec import SpecError

    with pytest.raises(SpecError) as info:
        parse_tolerance(value)
    assert str(info.value).startswith(message)
    with pytest.raises(SpecError, match="^--tolerance="):
        parse_tolerance(value, "--tolerance")


# -- which rank is gated: an int, never parsed back from its label -------------------------------


def test_the_gated_rank_is_the_configured_one_or_the_largest_measured():
    three = SizeResult(3, "cpu", {0: Peak(10.0, "m"), 1: Peak(30.0, "m"), 2: Peak(None, "not available")})
    every, two = gated_reading(three, "all"), gated_reading(three, 2)
    assert gated_reading(three, 0).rank == 0 and two.rank == 2  # configured: whether or not it was measured
    assert every.rank == 1 and (every.label, every.mib) == ("rank 1 (largest)", 30.0)
    assert (two.label, two.mib) == ("rank 2", None)
    tie = gated_reading(SizeResult(2, "cpu", {0: Peak(30.0, "m"), 1: Peak(30.0, "m")}), "all")
    assert tie.rank == 1  # a tie goes to the higher rank, in the label and the int alike
    assert tie.label == "rank 1 (largest)"
    assert gated_reading(SizeResult(2, "cpu", {0: Peak(None, "x")}), "all").rank is None
    fitted = predict([(1, 100.0), (2, 110.0)], 8)
    predicted = SizeResult(8, "cpu", {}, prediction=fitted)
    every = gated_reading(predicted, "all")
    assert every.rank is None and gated_reading(predicted, 3).rank == 3
    assert (every.label, every.mib) == (fitted.rank_label, fitted.mib)


# -- tolerance="auto": as tight as the compared figure is steady ------------------------------------


def test_auto_is_exact_for_live_allocations_on_the_baselines_cpu_model_and_moving_elsewhere(tmp_path: Path):
    from pytest_gpumem.config.settings import resolve
    from pytest_gpumem.judging.baseline import BaselineStore, Entry
    from pytest_gpumem.judging.gate import Gate
    from pytest_gpumem.launching.launched import SizeRun, TestRun
    from pytest_gpumem.launching.supervise import LaunchResult

    gate = Gate(resolve({}, {}, {}, rootdir=tmp_path, enabled=True, refresh=False), BaselineStore(tmp_path))

    def tolerance(method: str, device: str = "cpu", cpu: str = "Xeon A", stored_cpu: str = "Xeon A",
                  given: str | None = None) -> tuple[str, list[str]]:
        kw = {"nproc": 1} if given is None else {"nproc": 1, "tolerance": given}
        test = TestRun("t.py::test", parse_marker((), kw, Defaults()), provenance={"cpu_model": cpu})
        result = SizeResult(1, device, {0: Peak(300.0, method)})
        test.runs.append(SizeRun(result=result, launch=LaunchResult(1, []), outcomes={}))
        entry = Entry(300.0, {0: 300.0}, 0, device, method, {"cpu_model": stored_cpu})
        found, note = gate.stored.tolerance(test, 1, entry)
        return str(found), [note] if note else []

    live = "live allocations (memray)"
    assert tolerance(live) == ("max(1%, 4MiB)", [])
    assert tolerance("high-water mark") == ("max(5%, 32MiB)", [])  # a resident set wanders
    assert tolerance("per-pid sampled", device="gpu") == ("max(5%, 32MiB)", [])  # NVML's figure moves
    other, notes = tolerance(live, cpu="EPYC B")
    assert other == "max(5%, 32MiB)" and notes == [
        "the baseline was recorded on another CPU model (Xeon A; this run: EPYC B): compared at tolerance "
        "max(5%, 32MiB), the width MKL's code paths need between CPU models; `gpumem refresh` on this machine "
        "compares at max(1%, 4MiB)"]
    assert tolerance(live, cpu="EPYC B", given="2%") == ("2%", [])  # a given tolerance is used as given
    assert tolerance(live, stored_cpu="") == ("max(5%, 32MiB)", [])  # a baseline that did not record its CPU


@pytest.mark.parametrize("mib, exact_ok, moving_ok", [(300.0 + 4.0, True, True), (300.0 + 4.0 + JUST, False, True),
                                                      (300.0 + 32.0 + JUST, False, False)])
def test_auto_resolved_edges(mib, exact_ok, moving_ok):
    auto = parse_tolerance("auto")
    assert str(auto) == "auto" and auto.resolve(exact=False).allowance(300.0) == 32.0
    for exact, ok in ((True, exact_ok), (False, moving_ok)):
        v = judge(spec(nproc=1), [result(1, mib)], {1: BaselineRef(300.0, auto.resolve(exact))})
        assert v.passed is ok
    assert auto.allowance(300.0) == 32.0  # unresolved (a report read without its machine): never tighter


def test_grown_sites_compare_the_largest_rank_with_the_references_largest():
    """rank="all" with reference=4 (Megatron TP=2 x PP=2): the relaunch records each size's largest
    rank, rank 1 at 4 and rank 3 at 8; the growth is taken between those two, not against rank 0 at
    4 (which has no sites), and the failure names both."""
    from pytest_gpumem.judging.explain import explain_failure
    from pytest_gpumem.judging.growth import grown_sites
    from pytest_gpumem.launching.launched import SizeRun, TestRun
    from pytest_gpumem.launching.supervise import LaunchResult
    from pytest_gpumem.sampling.sites import Site

    spec = parse_marker((), {"nproc": [4, 8], "reference": 4, "rank": "all", "max_ratio": 1.05}, Defaults())
    kept = Site("train.py:40", "step", "all_gather", 512.0)
    grads = Site("train.py:52", "step", "", 1024.0)

    def run(n: int, peaks: dict[int, float], sites: tuple[Site, ...]) -> SizeRun:
        top = max(peaks, key=lambda r: peaks[r])
        result = SizeResult(n, "cpu", {r: Peak(mib, "live allocations (memray)") for r, mib in peaks.items()},
                            sites={top: sites})
        return SizeRun(result, LaunchResult(n, []), {})

    test = TestRun("t.py::test_tp_pp", spec, runs=[
        run(4, {0: 1500.0, 1: 1600.0, 2: 900.0, 3: 900.0}, (grads,)),
        run(8, {r: (1600.0 + 512.0 if r == 3 else 1500.0) for r in range(8)}, (grads, kept))])
    verdict = judge(spec, test.results)
    assert not verdict.passed
    grown = grown_sites(test, verdict, {})
    assert grown is not None and grown.against == "rank 1 (largest) at nproc=4"
    assert [c.label for c in grown.grown] == ["train.py:40 step (all_gather)"]
    text = explain_failure(test, verdict, [], {}, grown)
    assert "peak sites of rank 3 (largest) at nproc=8 that grew since rank 1 (largest) at nproc=4:" in text
    assert "+512.0 MiB  train.py:40 step (all_gather)  (new)" in text


# -- rank="all" against a baseline: each rank against its own -------------------------------


def _pipeline_run(n: int, peaks: dict[int, float], sites: dict[int, tuple] | None = None):
    from pytest_gpumem.launching.launched import SizeRun
    from pytest_gpumem.launching.supervise import LaunchResult

    result = SizeResult(n, "cpu", {r: Peak(mib, "live allocations (memray)") for r, mib in peaks.items()},
                        sites=sites or {})
    return SizeRun(result, LaunchResult(n, []), {})


HEALTHY_STAGES = {0: 1300.0, 1: 1800.0, 2: 1790.0, 3: 2150.0}  # the last stage the largest (1F1B at 4)


@pytest.mark.parametrize("grown, ok", [(0.0, True), (18.0, True), (18.0 + JUST, False), (300.0, False)])
def test_rank_all_holds_each_rank_to_its_own_baseline_figure(grown, ok):
    """A middle stage that grows below the largest rank: the largest's own check passes, rank 1's fails
    at its own figure + tolerance (max(1%, 4MiB) of 1800 = 18 MiB)."""
    exact = parse_tolerance("max(1%, 4MiB)")
    stages = {**HEALTHY_STAGES, 1: HEALTHY_STAGES[1] + grown}
    ref = BaselineRef(HEALTHY_STAGES[3], exact, ranks=HEALTHY_STAGES, gated_rank=3)
    v = judge(spec(nproc=4, rank="all"), [result(4, *stages.values())], {4: ref})
    assert v.passed is ok
    labels = [(c.rank_label, c.ok) for c in v.checks]
    assert labels == [("rank 3 (largest)", True), ("rank 0", True), ("rank 1", ok), ("rank 2", True)]
    assert [c.own for c in v.checks] == [False, True, True, True]  # a plot draws the largest's limit only
    if not ok:
        digits = v.failures[0].digits
        assert str(v.failures[0]) == (f"rank 1 at nproc=4 (cpu): peak {1800.0 + grown:.{digits}f} MiB > baseline "
                                      f"{1800:.{digits}f} MiB + max(1% = 18.0, 4) MiB = {1818:.{digits}f} MiB")


def test_rank_all_checks_the_new_largest_against_its_own_figure_too():
    """The largest rank moved (rank 2 grew past rank 3): largest against largest, and rank 2 against
    its own stored figure, which is where the growth shows."""
    exact = parse_tolerance("max(1%, 4MiB)")
    ref = BaselineRef(HEALTHY_STAGES[3], exact, ranks=HEALTHY_STAGES, gated_rank=3)
    v = judge(spec(nproc=4, rank="all"), [result(4, 1300.0, 1800.0, 2160.0, 2150.0)], {4: ref})
    assert [(c.rank_label, c.ok) for c in v.checks if c.rank_label.startswith("rank 2")] == [
        ("rank 2 (largest)", True), ("rank 2", False)]


def test_a_fixed_gated_rank_is_not_held_to_the_other_ranks_figures():
    exact = parse_tolerance("max(1%, 4MiB)")
    ref = BaselineRef(HEALTHY_STAGES[0], exact, ranks=HEALTHY_STAGES, gated_rank=0)
    v = judge(spec(nproc=4, rank=0), [result(4, 1300.0, 2400.0, 1790.0, 2150.0)], {4: ref})
    assert v.passed and [c.rank_label for c in v.checks] == ["rank 0"]


def test_rank_all_names_the_line_of_the_rank_that_grew_most_against_its_own_stored_sites():
    """Pipeline stages keeping every microbatch's output: rank 1 grew most, so its sites are compared with
    rank 1's stored sites (not the largest rank's), and the failure leads with its line."""
    from pytest_gpumem.judging.baseline import Entry
    from pytest_gpumem.judging.explain import explain_failure
    from pytest_gpumem.judging.growth import grown_sites, stored_sites
    from pytest_gpumem.launching.launched import TestRun
    from pytest_gpumem.sampling.sites import Site

    layer = Site("test_pp.py:20", "forward", "linear", 200.0)
    kept = Site("test_pp.py:22", "forward", "", 400.0)
    targets = Site("test_pp.py:40", "pp_job", "randn", 600.0)
    before = {1: (layer,), 2: (layer,), 3: (targets,)}
    entry = Entry(HEALTHY_STAGES[3], HEALTHY_STAGES, "all", "cpu", "live allocations (memray)", {},
                  sites=tuple(stored_sites(before[3])),
                  rank_sites={r: tuple(stored_sites(s)) for r, s in before.items() if r != 3})
    assert entry.gated_rank == 3 and entry.sites_of(1)[0]["where"] == "test_pp.py:20"
    marker = parse_marker((), {"nproc": 4, "rank": "all"}, Defaults())
    grown_stages = {0: 1300.0, 1: 2200.0, 2: 2150.0, 3: 2150.0}
    test = TestRun("test_pp.py::test_1f1b", marker, runs=[
        _pipeline_run(4, grown_stages, {1: (layer, kept), 2: (layer, replace(kept, mib=360.0)), 3: (targets,)})])
    ref = BaselineRef(entry.gated_mib, parse_tolerance("max(1%, 4MiB)"), ranks=entry.ranks,
                      gated_rank=entry.gated_rank)
    verdict = judge(marker, test.results, {4: ref})
    assert not verdict.passed
    grown = grown_sites(test, verdict, {4: entry})
    assert grown is not None and grown.of == "rank 1" and grown.against == "the baseline of rank 1"
    assert [c.label for c in grown.grown] == ["test_pp.py:22 forward"]
    lines = explain_failure(test, verdict, [], {4: entry}, grown).splitlines()
    assert lines[1:3] == ["  peak sites of rank 1 at nproc=4 that grew since its baseline:",
                          "    +400.0 MiB  test_pp.py:22 forward  (new)"]


def test_a_failure_says_when_another_rank_than_the_gated_one_peaked_higher():
    """Rank 0 gated by default while rank 1 held 18.6 MiB more (issue 57): the failure says so and
    names the argument that gates it; with rank="all" there is nothing to say."""
    from pytest_gpumem.judging.explain import higher_rank

    s = spec(nproc=[1, 2], max_ratio=1.1, allow_mib=0)
    results = [SizeResult(1, "cpu", {0: Peak(280.0, "live allocations (memray)")}),
               SizeResult(2, "cpu", {0: Peak(319.4, "live allocations (memray)"),
                                     1: Peak(338.0, "live allocations (memray)")})]
    verdict = judge(s, results)
    assert not verdict.passed
    assert higher_rank(verdict, 0) == [
        '  rank 1 peaked 18.6 MiB above the gated rank 0 at nproc=2 (338.0 MiB): gate it with rank=1 or rank="all"']
    assert higher_rank(verdict, "all") == []
