"""The fit of peak memory versus world size: shapes recovered, LOO choice, refusals, degenerate data;
and the plan of what to launch and what to predict (no launches here)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pytest_gpumem.config.spec import Defaults, Ratio, parse_marker
from pytest_gpumem.judging import report_diff
from pytest_gpumem.judging.assemble import build
from pytest_gpumem.judging.verdict import judge
from pytest_gpumem.launching.scaling import Capacity, plan
from pytest_gpumem.results.predict import (
    FLAT,
    LINEAR,
    SHARDED,
    SUM,
    PredictError,
    fit,
    least_squares,
    loo_error,
    predict,
)
from pytest_gpumem.results.size import SizeResult
from pytest_gpumem.sampling import Peak

SIZES = (1, 2, 4, 8)


def points(shape, sizes=SIZES):
    return [(n, shape(n)) for n in sizes]


@pytest.mark.parametrize("shape, model", [
    (lambda n: 5734.0, FLAT),
    (lambda n: 4400.0 + 1349.0 * n, LINEAR),                 # LiBai Swin eager: 5734 at 1 -> ~15190 at 8
    (lambda n: 1000.0 + 4096.0 / n, SHARDED),                # ZeRO-style sharded optimizer state
    (lambda n: 1000.0 + 64.0 * n + 2048.0 / n, SUM),         # both
])
def test_known_shapes_are_recovered_and_extrapolate(shape, model):
    chosen = fit(points(shape))
    assert chosen.model is model, chosen.candidates
    assert chosen.loo_error == pytest.approx(0.0, abs=1e-9)
    assert chosen.at(64) == pytest.approx(shape(64), rel=1e-9)


def test_three_points_cannot_judge_the_three_parameter_model():
    shape = lambda n: 1000.0 + 64.0 * n + 2048.0 / n  # noqa: E731
    chosen = fit(points(shape, (1, 2, 4)))
    assert chosen.model is not SUM
    reasons = {c.model.name: c.reason for c in chosen.candidates}
    assert reasons["sum"] == "needs 4 sizes to be judged"
    assert chosen.loo_error is not None and chosen.loo_error > 0  # an honest, nonzero error


def test_loo_picks_the_model_that_predicts_unseen_points_best():
    # Linear growth with measurement noise of ~1 MiB: linear's held-out misses are tiny, flat's are not.
    measured = [(1, 601.0), (2, 864.5), (4, 1390.2), (8, 2441.0)]
    chosen = fit(measured)
    assert chosen.model is LINEAR
    by_name = {c.model.name: c.loo_error for c in chosen.candidates}
    assert by_name["flat"] > 0.3 and by_name["linear"] < 0.01
    assert chosen.loo_error == by_name["linear"]


def test_a_simpler_model_wins_a_tie():
    # Flat within noise: linear and the others predict held-out points no better than flat.
    measured = [(1, 480.0), (2, 481.0), (4, 480.5), (8, 480.8)]
    chosen = fit(measured)
    assert chosen.model is FLAT
    assert chosen.at(64) == pytest.approx(480.575)


def test_two_points_give_the_line_through_them_and_no_more():
    chosen = fit([(1, 500.0), (2, 600.0)])
    assert chosen.model is LINEAR and chosen.loo_error is None
    assert chosen.at(8) == pytest.approx(1200.0)
    assert "LOO error n/a: two sizes" in chosen.describe()
    reasons = {c.model.name: c.reason for c in chosen.candidates}
    assert reasons["sum"] == reasons["sharded"] == "two sizes: only the line through them"
    # Even when the data are exactly sharded, two points never buy more than a line.
    assert fit([(1, 2000.0), (2, 1500.0)]).model is LINEAR


def test_one_process_off_the_trend_is_left_out_when_the_larger_sizes_say_so():
    # OneFlow eager with the batch broadcast (live allocations, MiB): a ~22 MiB step from 1 to 2
    # processes (the multi-rank runtime), then +32 MiB per rank. Measured at 8: 406.7.
    step = [(1, 149.5), (2, 215.8), (4, 278.9)]
    chosen = fit(step)
    assert chosen.sizes == (2, 4) and chosen.left_out == ((1, 149.5),) and chosen.model is LINEAR
    assert chosen.at(8) == pytest.approx(405.1, abs=0.1)
    assert chosen.loo_error is None and chosen.loo_error_with_left_out == pytest.approx(0.249, abs=0.001)
    assert chosen.describe() == ("a + b*N from nproc 2,4; LOO error n/a: two sizes; nproc 1 left out: "
                                 "off the larger sizes' trend (LOO error 24.9% with it)")
    assert chosen.as_dict()["left_out"] == {"1": 149.5}
    # With three sizes above 1 the regime fit is judged by LOO too.
    more = fit(step + [(8, 406.7)])
    assert more.sizes == (2, 4, 8) and more.model is LINEAR and more.loo_error < 0.01


def test_one_process_stays_when_every_size_follows_one_model():
    sharded = [(n, 1000.0 + 4096.0 / n) for n in (1, 2, 4)]  # the line through 2, 4 would say 1512 at 8
    assert fit(sharded).left_out == () and fit(sharded).at(8) == pytest.approx(1512.0)
    ddp = [(1, 205.2), (2, 206.3), (4, 205.9)]  # torch DDP: flat within 0.5%, nproc=1 included
    assert fit(ddp).sizes == (1, 2, 4) and fit(ddp).model is FLAT
    assert fit([(1, 117.5), (2, 139.7)]).left_out == ()  # one size above 1: nothing to tell a step by
    u_shape = [(n, 1000.0 + 64.0 * n + 2048.0 / n) for n in (1, 2, 4)]  # nproc=1 above the 2-4 line
    assert fit(u_shape).left_out == () and fit(u_shape).sizes == (1, 2, 4)


def test_identical_points_and_zeros_are_flat_without_dividing_by_zero():
    assert fit([(1, 700.0), (2, 700.0), (4, 700.0)]).model is FLAT
    zero = fit([(1, 0.0), (2, 0.0), (4, 0.0), (8, 0.0)])
    assert zero.model is FLAT and zero.at(64) == 0.0 and zero.loo_error == 0.0
    assert math.isfinite(loo_error(LINEAR, [(1, 0.0), (2, 0.5), (4, 0.0)]))


@pytest.mark.parametrize("given, message", [
    ([(1, 500.0)], "a prediction needs at least two distinct world sizes"),
    ([], "0 measured size(s) (none)"),
    ([(2, 500.0), (2, 510.0)], "world sizes [2, 2] repeat"),
    ([(1, 500.0), (2, None)], "peak at nproc=2 is None: expected a finite number of MiB >= 0"),
    ([(1, 500.0), (2, float("nan"))], "peak at nproc=2 is nan"),
    ([(1, 500.0), (2, -3.0)], "peak at nproc=2 is -3.0"),
    ([(0, 500.0), (2, 1.0)], "world size 0 is not accepted"),
])
def test_refusals_say_why(given, message):
    with pytest.raises(PredictError) as info:
        fit(given)
    assert message in str(info.value)


def test_least_squares_refuses_an_undetermined_system():
    assert least_squares(SUM, [(1, 1.0), (2, 2.0)]) is None
    assert least_squares(LINEAR, [(4, 1.0)]) is None


def test_prediction_describes_itself_and_serialises():
    p = predict([(1, 500.0), (2, 600.0), (4, 800.0)], 8)
    assert p.mib == pytest.approx(1200.0) and p.world_size == 8
    assert p.describe() == "predicted by a + b*N from nproc 1,2,4; LOO error 0.0%"
    data = p.as_dict()
    assert data["formula"] == "a + b*N" and data["fitted_on"] == {"1": 500.0, "2": 600.0, "4": 800.0}
    assert data["basis"] == p.describe() and data["mib"] == 1200.0


# ----------------------------------------------------------------------------- the verdict

def spec(**kw):
    return parse_marker((), kw, Defaults())


def test_a_predicted_size_is_judged_and_says_it_was_predicted():
    s = spec(nproc=[1, 2, 4, 8], max_ratio=1.2, allow_mib=16, max_mib=700)
    launched = [SizeResult(n, "cpu", {0: Peak(580.0 + 20 * n, "high-water mark")}) for n in (1, 2, 4)]
    p = predict([(r.world_size, r.peaks[0].mib) for r in launched], 8)
    v = judge(s, launched + [SizeResult(8, "cpu", {}, prediction=p)])
    assert [(c.kind, c.world_size) for c in v.failures] == [("max_mib", 8), ("max_ratio", 8)]
    assert str(v.failures[1]) == (
        "rank 0 at nproc=8 (cpu, predicted by a + b*N from nproc 1,2,4; LOO error 0.0%): "
        "peak 740.0 MiB > 1.20 x 600.0 MiB (nproc=1) + 16 MiB = 736.0 MiB (ratio 1.23x)")
    assert "4: 660.0 MiB (1.10x) | 8: 740.0 MiB (1.23x) predicted FAIL" in v.summary_line()
    assert "nproc=8 cpu MiB rank 0 740.0, predicted by a + b*N" in v.render()


def test_a_predicted_size_is_never_compared_with_a_baseline():
    from pytest_gpumem.config.spec import Tolerance
    from pytest_gpumem.judging.verdict import BaselineRef

    s = spec(nproc=[1, 2, 8])
    p = predict([(1, 500.0), (2, 600.0)], 8)
    v = judge(s, [SizeResult(8, "cpu", {}, prediction=p)], {8: BaselineRef(100.0, Tolerance(percent=1))})
    assert v.passed and v.checks == ()


# ----------------------------------------------------------------------------- the plan

def test_plan_launches_what_fits_and_predicts_the_rest():
    s = spec(nproc=[1, 2, 4, 8], max_ratio=1.2)
    chosen = plan(s, Capacity(max_nproc=4))
    assert chosen.launch.nproc == (1, 2, 4) and chosen.predicted == (8,)
    assert plan(s, Capacity(max_nproc=8)).launch is s  # nothing above the cap: unchanged
    # A reference launched for the ratio counts as a launched size.
    assert plan(spec(nproc=[2, 8], max_ratio=1.2), Capacity(max_nproc=4)).launch.sizes == (1, 2)


def test_plan_never_skips_what_fits_and_says_why_the_rest_is_not_launched():
    s = spec(nproc=[1, 8])
    few = plan(s, Capacity(max_nproc=4))
    assert few.launch.nproc == (1,) and few.unlaunched == (8,)
    assert few.why == ("needs more processes than can be launched here (at most 4: gpumem_max_nproc=4); "
                       "predicting needs at least two launched sizes")
    off = plan(spec(nproc=[1, 2, 8]), Capacity(max_nproc=4, predict=False))
    assert off.launch.nproc == (1, 2) and off.unlaunched == (8,)
    assert off.why.endswith("prediction is off (--gpumem-no-predict)")


def test_too_few_gpus_simulate_the_sizes_above_them_and_simulate_on_every_size_above_one():
    capacity = Capacity(gpu_count=lambda: 1)
    s = spec(nproc=[1, 2, 8])
    auto = plan(s, capacity)
    assert auto.launch.nproc == (1,) and auto.simulated == (2, 8) and auto.gpus == 1
    assert "1 GPU(s) on this machine" in auto.why
    off = plan(spec(nproc=[1, 2, 8], simulate="off"), capacity)
    assert off.simulated == () and off.unlaunched == (2, 8)
    on = plan(spec(nproc=[1, 2, 8], simulate="on", device="cpu"), Capacity())
    assert on.launch.nproc == (1,) and on.simulated == (2, 8) and on.gpus is None
    # A cap asked for (gpumem_max_nproc) predicts as before: auto simulates only for want of GPUs.
    assert plan(spec(nproc=[1, 2, 4, 8]), Capacity(max_nproc=4, gpu_count=lambda: 8)).predicted == (8,)


def test_a_named_reference_is_launched_or_simulated_once_and_no_unlisted_size_is_added():
    one_gpu = Capacity(gpu_count=lambda: 1)
    tp = spec(nproc=[2, 8], max_ratio=1.1, reference=2)
    chosen = plan(tp, one_gpu)  # a TP=2 job on one GPU: both sizes simulated, nothing launched for real
    assert chosen.launch.sizes == () and chosen.simulated == (2, 8)
    two = plan(tp, Capacity(gpu_count=lambda: 2))  # the reference fits: launched for real, 8 simulated
    assert two.launch.sizes == (2,) and two.launch.max_ratio == Ratio(flat=1.1) and two.simulated == (8,)
    on = plan(spec(nproc=[2, 8], max_ratio=1.1, reference=2, simulate="on", device="cpu"), Capacity())
    assert on.launch.sizes == () and on.simulated == (2, 8)
    fake = plan(spec(nproc=[2, 8], max_ratio=1.1, reference=2, device="gpu"), Capacity())
    assert fake.fake and fake.launch.sizes == () and fake.simulated == (2, 8)
    # The default reference is nproc=1, launched for real as before.
    assert plan(spec(nproc=[2, 8], max_ratio=1.1), one_gpu).launch.sizes == (1,)


def test_the_cap_is_the_gpus_present_unless_set_and_none_on_host_memory():
    calls = []

    def gpus():
        calls.append(1)
        return 4

    s = spec(nproc=[1, 2, 4, 8], simulate="off")
    capacity = Capacity(gpu_count=gpus)
    assert plan(s, capacity).predicted == (8,)
    assert "4 GPU(s) on this machine" in plan(spec(nproc=[1, 8], simulate="off"), capacity).why
    assert plan(spec(nproc=[1, 2, 4, 8]), capacity).simulated == (8,)
    assert len(calls) == 1  # asked once per session
    assert plan(spec(nproc=[1, 8], device="cpu"), Capacity(gpu_count=gpus)).predicted == ()
    assert plan(s, Capacity(gpu_count=lambda: 0)).predicted == ()  # no GPU: host memory, no cap


def test_sizes_this_hosts_memory_cannot_hold_are_not_started_and_say_why():
    """nproc=1000 on a 2-core, 24 GiB runner (issue 36): its 1000 interpreters alone would need ~29 GiB."""
    asked = []

    def host_mib():
        asked.append(1)
        return 24 * 1024.0

    capacity = Capacity(host_mib=host_mib)
    assert plan(spec(nproc=[1, 2, 8], device="cpu"), capacity).launch.nproc == (1, 2, 8) and asked == []
    big = plan(spec(nproc=[1, 1000], device="cpu"), capacity)
    assert big.launch.nproc == (1,) and big.unlaunched == (1000,)
    assert big.why == ("needs more processes than can be launched here (at most 819: this host's 24.0 GiB of "
                       "memory, at the 30 MiB a rank holds before its test starts); predicting needs at least "
                       "two launched sizes")
    assert plan(spec(nproc=[1, 2, 4, 1000], device="cpu"), capacity).predicted == (1000,)
    assert plan(spec(nproc=[1, 800], device="cpu"), capacity).launch.nproc == (1, 800)
    assert plan(spec(nproc=[1, 1000]), Capacity(gpu_count=lambda: 0, host_mib=host_mib)).unlaunched == (1000,)


# ----------------------------------------------------------------------------- renderings of a record

def _predicted_record():
    from pytest_gpumem.launching.launched import SizeRun, TestRun
    from pytest_gpumem.launching.supervise import LaunchResult

    s = spec(nproc=[1, 2, 4, 8], max_ratio=1.2, allow_mib=16)
    launched = [SizeResult(n, "cpu", {0: Peak(580.0 + 20 * n, "high-water mark")}) for n in (1, 2, 4)]
    p = predict([(r.world_size, r.peaks[0].mib) for r in launched], 8)
    test = TestRun("t/p.py::test_grows", s,
                   runs=[SizeRun(r, LaunchResult(r.world_size, []), {}) for r in launched],
                   predicted=[SizeResult(8, "cpu", {}, prediction=p)])
    return build(test, judge(s, test.results), "failed", cause="limit")


def test_every_output_labels_the_predicted_size():
    from pytest_gpumem.presentation import outputs
    from pytest_gpumem.presentation.report import table

    rec = _predicted_record()
    sizes = {s.nproc: s for s in rec.sizes}
    assert sizes[8].basis == "predicted by a + b*N from nproc 1,2,4; LOO error 0.0%"
    assert sizes[4].measured.prediction is None and sizes[8].failed and not sizes[4].failed
    lines = table([rec])
    assert "740.0 (rank 0, predicted)" in lines[5] and lines[5].rstrip().endswith("failed (limit)")
    assert lines[-1] == ("nproc=8 of t/p.py::test_grows: predicted by a + b*N from nproc 1,2,4; "
                         "LOO error 0.0%, not launched")
    md = outputs.markdown([rec])
    assert "740.0 (rank 0, cpu, **predicted**)" in md
    assert "predicted (not launched): nproc=8 of `t/p.py::test_grows`, predicted by a + b*N" in md
    assert "(cpu, predicted by a + b*N from nproc 1,2,4; LOO error 0.0%)" in md  # the failure message
    assert [e["name"] for e in outputs.benchmark_json([rec])] == [
        f"t/p.py::test_grows nproc={n} rank 0" for n in (1, 2, 4)]  # measurements only
    props = dict(outputs.junit_properties(rec))
    assert (props["gpumem_nproc8_predicted"].startswith("predicted by a + b*N")
            and "gpumem_nproc4_predicted" not in props)


def test_the_plot_of_a_predicted_size_shows_the_fit(tmp_path):
    pytest.importorskip("matplotlib")
    from pytest_gpumem.presentation import plots

    rec = _predicted_record()
    path = tmp_path / "p.png"
    plots.plot(rec, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    title = plots._size_title(rec, rec.sizes[-1])
    assert title.startswith("nproc=8 (cpu memory): PREDICTED, not launched: rank 0 740.0 MiB, 1.23x nproc=1 — FAIL")


def test_a_failure_only_at_a_predicted_size_shows_the_boxing_of_the_largest_launched_size():
    from pytest_gpumem.judging.explain import explain_failure
    from pytest_gpumem.launching.launched import SizeRun, TestRun
    from pytest_gpumem.launching.supervise import LaunchResult

    s = spec(nproc=[1, 2, 4, 8], max_ratio=1.2, allow_mib=16)
    launched = [SizeResult(n, "cpu", {r: Peak(580.0 + 20 * n, "high-water mark") for r in range(n)}) for n in (1, 2, 4)]
    gather = {"src": "S(0)", "dst": "B", "op": "cast-0 (cast)", "tensor": "x/out (4096, 1024) float32", "placement": ""}
    grad = {"src": "P", "dst": "B", "op": "w_opt (sgd_update)", "tensor": "g/out (64,) float32", "placement": ""}
    runs = [SizeRun(r, LaunchResult(r.world_size, []), {},
                    boxings=[] if r.world_size == 1 else [grad, gather])
            for r in launched]
    p = predict([(r.world_size, r.peaks[0].mib) for r in launched], 8)
    test = TestRun("t/g.py::test_graph", s, runs=runs, predicted=[SizeResult(8, "cpu", {}, prediction=p)])
    verdict = judge(s, test.results)
    assert [c.world_size for c in verdict.failures] == [8]
    text = explain_failure(test, verdict, [], {})
    assert "  nn.Graph boxing (SBP conversions) at nproc=4 against nproc=1 (no audited baseline):\n" \
           "    new: S(0)->B x1 (was 0); 16.0 MiB moved\n" \
           "      16.0 MiB  x/out (4096, 1024) float32 into cast-0 (cast)" in text
    assert "P->B" not in text  # the gradients' all-reduce: what data parallelism does at any size above one
    assert "nproc=8 (" not in text.split("per-rank peaks over the run:")[1]  # no timeline for what never ran


def test_gpumem_diff_never_compares_a_prediction_with_a_measurement():

    predicted = _predicted_record()
    last = predicted.sizes[-1]
    launched = dataclasses.replace(last, measured=dataclasses.replace(last.measured, prediction=None), gated_mib=600.0)
    measured = dataclasses.replace(predicted, sizes=(*predicted.sizes[:-1], launched))
    kinds = {(r.test, r.nproc): r.kind for r in report_diff.diff_reports([measured], [predicted]).rows}
    assert kinds[("t/p.py::test_grows", 8)] == "predicted on one side"
    assert kinds[("t/p.py::test_grows", 4)] == "unchanged"
    assert report_diff.diff_reports([predicted], [predicted]).rows[-1].kind == "unchanged"  # fit against fit


def test_on_a_gpu_the_part_above_the_floor_is_fitted_and_the_floor_added_back():
    """2 GPUs, a healthy NCCL DDP job (H200: 3190 -> 3476 MiB; empty job 612 -> 1452): a line through
    the raw figures carries the communicator's step on to 8 ranks (5192 MiB, 1.63x); above the floor
    the job's own part shrinks from 1 to 2 (cache noise), so the job is predicted at 0 plus the floor."""
    raw = predict([(1, 3190.0), (2, 3476.0)], 8)
    assert round(raw.mib) == 5192 and not raw.validated
    above = predict([(1, 3190.0), (2, 3476.0)], 8, floors={1: 612.0, 2: 1452.0})
    assert above.floor_mib == 1452.0 and above.floor_size == 2 and round(above.mib) == 1452
    assert "plus the floor measured at nproc=2 (1452 MiB" in above.describe()
    assert above.as_dict()["floor_mib"] == 1452.0
    three = predict([(1, 3190.0), (2, 3476.0), (4, 3500.0)], 8, floors={1: 612.0, 2: 1452.0, 4: 1460.0})
    assert three.validated and three.floor_size == 4


def test_a_oneflow_job_where_a_fake_gpu_would_stand_in_runs_every_size_for_real_with_cuda_on_the_cpu():
    """OneFlow has no fake tensors: its device="gpu" test on a runner without a GPU is launched for real
    on host memory, its ranks told to read CUDA as the CPU (oneflow.cuda_on_cpu); a torch job keeps the fake GPU."""
    from pytest_gpumem.oneflow.cuda_on_cpu import CUDA_ON_CPU_ENV

    both = Capacity(oneflow_only=lambda: False)  # torch installed too: only OneFlow's launcher tells
    by_launcher = plan(spec(nproc=[1, 2], max_ratio=1.2, device="gpu", launcher="oneflow"), both)
    assert not by_launcher.fake and by_launcher.simulated == () and by_launcher.launch.sizes == (1, 2)
    assert by_launcher.launch.device == "cpu" and dict(by_launcher.launch.env)[CUDA_ON_CPU_ENV] == "1"
    assert plan(spec(nproc=[1, 2], device="gpu"), both).fake  # the direct launcher: torch's fake GPU
    no_torch = plan(spec(nproc=[1, 2], device="gpu", env={"A": "1"}), Capacity(oneflow_only=lambda: True))
    assert no_torch.launch.device == "cpu" and dict(no_torch.launch.env) == {"A": "1", CUDA_ON_CPU_ENV: "1"}
    # a GPU here, or a test not asking for one, or fake_gpu="off": nothing is mapped
    two_gpus = Capacity(gpu_count=lambda: 2, oneflow_only=lambda: True)
    assert plan(spec(nproc=[1, 2], device="gpu", launcher="oneflow"), two_gpus).launch.device == "gpu"
    assert plan(spec(nproc=[1, 2], launcher="oneflow"), both).launch.env == ()
    assert plan(spec(nproc=[1, 2], device="gpu", fake_gpu="off", launcher="oneflow"), both).launch.device == "gpu"
