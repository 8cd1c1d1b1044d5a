"""A verdict on sizes that were not a real world: simulated ranks, a fake GPU, a stand-in that left a
comm hook out. What the verdict says about each is all a reviewer has to tell it from a real launch
(mutation testing found these lines unpinned by any in-process test: benchmarks/results/mutmut.txt)."""

from pytest_gpumem.config.spec import Defaults, Tolerance, parse_marker
from pytest_gpumem.judging.verdict import UNCOUNTED, BaselineRef, judge, simulated_ranks
from pytest_gpumem.results.size import SizeResult
from pytest_gpumem.sampling import AllocatedPeak, DeviceEstimate, Peak

SAMPLED = "per-pid sampled"


def gpu(n, peaks, allocated=None, **kw):
    """A GPU size: ``peaks`` and ``allocated`` map each rank to its device and allocator MiB."""
    return SizeResult(world_size=n, device="gpu", peaks={r: Peak(m, SAMPLED) for r, m in peaks.items()},
                      allocated={r: AllocatedPeak(m, None, "torch") for r, m in (allocated or {}).items()}, **kw)


def spec(**kw):
    return parse_marker((), kw, Defaults())


def test_simulated_ranks_are_named_one_a_run_or_a_list():
    def named(*ranks):
        return simulated_ranks(SizeResult(8, "gpu", {}, simulated=ranks))

    assert named(3) == "rank 3"
    assert named(2, 3) == "ranks 2-3"
    assert named(7, 5, 6) == "ranks 5-7"
    assert named(1, 3, 7) == "ranks 1, 3, 7"


def test_a_simulated_gpu_size_says_its_ranks_ran_alone_and_what_its_device_figure_lacks():
    results = [gpu(1, {0: 100.0}, {0: 90.0}),
               gpu(8, {r: 130.0 for r in range(8)}, {r: 120.0 for r in range(8)}, simulated=tuple(range(8)))]
    text = judge(spec(nproc=[1, 8], max_ratio=1.05), results).render()
    assert "rank 0 peak, nproc 1: 100.0 MiB | 8: 130.0 MiB (1.33x) simulated FAIL" in text
    assert ("  nproc=8 gpu MiB per rank {0: 130.0, 1: 130.0, 2: 130.0, 3: 130.0, 4: 130.0, 5: 130.0, 6: 130.0, "
            "7: 130.0} [per-pid sampled] (simulated: ranks 0-7 alone with a stand-in communicator)") in text
    assert text.endswith(
        "  note: nproc=8 ran as a simulated world: its allocator figure is exact; its device figure has no "
        "communicator buffers, so real ranks hold more (a limit on it fails only where even that figure exceeds it)")


def test_simulated_host_sizes_name_every_size_and_claim_no_exact_allocator_figure():
    def cpu(n, mib, simulated=()):
        return SizeResult(n, "cpu", {0: Peak(mib, "live allocations")}, simulated=simulated)

    verdict = judge(spec(nproc=[1, 2, 4], max_ratio=1.5),
                    [cpu(1, 100.0), cpu(2, 101.0, (0,)), cpu(4, 102.0, (0,))])
    assert verdict.passed
    assert verdict.notes == (
        "nproc=2, 4 ran as a simulated world: its host figure has no communicator buffers, so real ranks hold "
        "more (a limit on it fails only where even that figure exceeds it)",)


def test_a_fake_gpu_size_says_every_limit_reads_its_allocator_figure():
    fake = gpu(2, {0: 50.0, 1: 50.0}, {0: 50.0, 1: 50.0}, simulated=(0, 1), fake_gpu="NVIDIA H200")
    verdict = judge(spec(nproc=2, max_mib=40), [fake])
    text = verdict.render()
    assert "rank 0 peak, nproc 2: 50.0 MiB fake GPU FAIL" in text and " simulated" not in verdict.summary_line()
    assert "[per-pid sampled] (fake NVIDIA H200: ranks 0-1 alone, every CUDA tensor fake)" in text
    assert verdict.notes == (
        "nproc=2 ran on a fake GPU (NVIDIA H200): every limit reads the allocator figure, what torch's caching "
        "allocator would count on that model; a real GPU holds more (the CUDA context, the communicator's "
        "buffers, the allocator's cache), not predicted: its model has no calibration of them (gpumem calibrate)",)
    assert verdict.failures[0].basis == "fake GPU" and verdict.failures[0].figure == "allocated"
    assert "nvidia-smi" not in text and "device figure" not in text


def test_a_calibrated_fake_gpu_gates_max_mib_on_its_predicted_device_figure_and_says_each_sizes_fit():
    def estimate(reserved):
        return DeviceEstimate((("reserved", reserved), ("context", 512.0), ("nccl", 256.0)), "NVIDIA H100 80GB HBM3",
                              81079.0)

    fake = SizeResult(2, "gpu", {0: Peak(50.0, SAMPLED), 1: Peak(60.0, SAMPLED)}, simulated=(0, 1),
                      fake_gpu="NVIDIA H100 80GB HBM3",
                      allocated={0: AllocatedPeak(50.0, 64.0, "torch", estimate(64.0)),
                                 1: AllocatedPeak(60.0, 80.0, "torch", estimate(80.0))})
    verdict = judge(spec(nproc=2, max_mib=800, rank="all"), [fake])
    (failure,) = verdict.failures
    assert (failure.measured_mib, failure.figure, failure.rank_label) == (848.0, "device", "rank 1 (largest)")
    assert "rank 1 (largest) at nproc=2 (gpu, device figure predicted, fake GPU): peak 848.0 MiB > max_mib" in \
        failure.text()
    assert verdict.notes[0].startswith("nproc=2 ran on a fake GPU (NVIDIA H100 80GB HBM3): its device figure is "
                                       "predicted") and verdict.notes[0].endswith("max_mib reads it, other limits "
                                                                                 "the allocator figure")
    assert verdict.notes[1] == ("nproc=2 rank 1 (largest): fits NVIDIA H100 80GB HBM3: 0.8 of 79.2 GiB, margin 78.4 "
                                "GiB (predicted: reserved 80.0 + context 512.0 + nccl 256.0 MiB)")


def test_a_fake_gpu_size_is_judged_against_its_baseline_once_at_the_allocator_tolerance():
    """Issue 55: one number judged twice, at 5% as a 'device figure' and at 0.5% as the allocator's."""
    fake = gpu(1, {0: 9694.5}, {0: 9694.5}, simulated=(0,), fake_gpu="NVIDIA H200")
    base = BaselineRef(9569.6, Tolerance(percent=5.0, mib=32.0), 9569.6, Tolerance(percent=0.5, mib=16.0))
    for rank in (0, "all"):
        verdict = judge(spec(nproc=1, rank=rank), [fake], {1: base})
        (check,) = verdict.checks
        assert (check.kind, check.figure, check.ok, check.limit_mib) == ("baseline", "allocated", False, 9617.448)


def test_a_simulated_size_below_the_reference_for_a_hook_it_did_not_run_fails_as_uncounted():
    one = gpu(1, {0: 100.0}, {0: 100.0})
    hook = "DDP comm hook 'keep_buckets'"

    def at_2(allocated):
        return gpu(2, {0: allocated}, {0: allocated}, simulated=(0,), uncounted=(hook,))

    failing = judge(spec(nproc=[1, 2], max_ratio=1.2), [one, at_2(80.0)])
    (check,) = failing.failures
    assert check.kind == UNCOUNTED and check.figure == "allocated" and check.reference_mib == 100.0
    assert check.headline() == (f"80.0 MiB < nproc=1's 100.0 MiB: without its {hook} (not run in the simulated "
                                "world, its buffers not counted) no limit can gate this size (rank 0, allocated, "
                                "nproc=2)")
    assert str(check).startswith("rank 0 at nproc=2 (gpu, allocated, simulated world): peak 80.0 MiB < nproc=1's")
    assert str(check).endswith("run it for real (simulate='off' on enough GPUs) or leave it out of nproc")
    assert judge(spec(nproc=[1, 2], max_ratio=1.2), [one, at_2(100.0)]).passed  # not below: gated as it is
    simulated_one = gpu(1, {0: 100.0}, {0: 100.0}, simulated=(0,))
    assert judge(spec(nproc=[1, 2], max_ratio=1.2), [simulated_one, at_2(80.0)]).passed  # no real reference


def test_max_mib_reads_the_figure_the_marker_names():
    size = gpu(1, {0: 900.0}, {0: 700.0})
    assert not judge(spec(nproc=1, max_mib=800), [size]).passed  # the device figure by default
    assert judge(spec(nproc=1, max_mib=800, figures={"max_mib": "allocated"}), [size]).passed


def test_every_fake_size_is_named_and_more_failures_are_counted_in_the_plural():
    sizes = [gpu(n, {r: 50.0 for r in range(n)}, {r: 50.0 for r in range(n)}, simulated=tuple(range(n)),
                 fake_gpu="NVIDIA H200") for n in (1, 2, 4)]
    verdict = judge(spec(nproc=[1, 2, 4], max_mib=40), sizes)
    assert verdict.notes[0].startswith("nproc=1, 2, 4 ran on a fake GPU (NVIDIA H200): ")
    assert verdict.render().splitlines()[0] == ("gpumem: 50.0 MiB > max_mib 40.0 MiB (rank 0, allocated, nproc=1); "
                                                "2 more limits exceeded")


def test_a_prediction_that_could_not_be_validated_is_shown_as_would_exceed_never_failing():
    from pytest_gpumem.results.predict import MODELS, Fit, Prediction

    fit = Fit(MODELS[1], (90.0, 10.0), ((1, 100.0), (2, 110.0)), None)  # two points: no leave-one-out error
    predicted = SizeResult(8, "gpu", {}, prediction=Prediction(8, 170.0, fit))
    launched = [gpu(1, {0: 100.0}), gpu(2, {0: 110.0, 1: 110.0})]
    verdict = judge(spec(nproc=[1, 2, 8], max_mib=150), [*launched, predicted])
    assert verdict.passed and [c.world_size for c in verdict.advisories] == [8]
    assert verdict.summary_line().endswith("| 8: 170.0 MiB (1.70x) predicted (would exceed, not validated)")
    assert "  predicted, not validated (shown, not failing: fit on fewer than 3 launched sizes):" in verdict.render()
