"""Verdicts say the limit, the measured value, the unit, the rank and the world size."""

from pytest_gpumem.config.spec import Defaults, Tolerance, parse_marker
from pytest_gpumem.judging.verdict import BaselineRef, SizeResult, judge
from pytest_gpumem.sampling import Peak


def result(n, *mibs, device="gpu"):
    return SizeResult(world_size=n, device=device, peaks={r: Peak(m, "per-pid sampled") for r, m in enumerate(mibs)})


def spec(**kw):
    return parse_marker((), kw, Defaults())


def test_libai_swin_inflation_is_caught_at_8():
    s = spec(nproc=[1, 8], max_ratio=1.2)
    v = judge(s, [result(1, 5734), result(8, *([15190] + [14000] * 7))])
    assert not v.passed
    text = v.render()
    assert "memory limit exceeded at nproc=8" in text
    assert "rank 0 at nproc=8 (gpu): peak 15190.0 MiB > 1.20 x 5734.0 MiB (nproc=1) + 0 MiB = 6880.8 MiB" in text
    assert "(ratio 2.65x)" in text


def test_healthy_ddp_passes_with_allowance():
    s = spec(nproc=[1, 8], max_ratio=1.0, allow_mib=512)
    assert judge(s, [result(1, 5592), result(8, *[5920] * 8)]).passed
    assert not judge(spec(nproc=[1, 8], max_ratio=1.0), [result(1, 5592), result(8, *[5920] * 8)]).passed


def test_max_mib_every_size_first_failure_named():
    s = spec(nproc=[1, 2, 4], max_mib=1000)
    v = judge(s, [result(1, 900), result(2, 1100, 900), result(4, 1300, 1, 1, 1)])
    assert [c.world_size for c in v.failures] == [2, 4]
    assert v.render().splitlines()[0] == "gpumem: memory limit exceeded at nproc=2"
    assert "2: 1100.0 MiB (1.22x) FAIL" in v.summary_line()


def test_rank_all_gates_the_largest_rank():
    s = spec(nproc=2, rank="all", max_mib=1000)
    v = judge(s, [result(2, 500, 1500)])
    assert "rank 1 (largest) at nproc=2" in str(v.failures[0])


def test_not_available_is_a_failure_not_zero():
    s = spec(nproc=1, max_mib=1000)
    v = judge(s, [SizeResult(1, "gpu", {0: Peak(None, "not available")})])
    assert not v.passed and "no peak could be measured" in str(v.failures[0])


def test_baseline_exceeded_and_improvement_noted():
    s = spec(nproc=2)
    tol = Tolerance(percent=5.0)
    bad = judge(s, [result(2, 1100, 1000)], {2: BaselineRef(1000, tol)})
    assert "baseline 1000.0 MiB + tolerance 5% = 1050.0 MiB" in str(bad.failures[0])
    better = judge(s, [result(2, 800, 800)], {2: BaselineRef(1000, tol)})
    assert better.passed and "refresh the baseline" in better.notes[0]
