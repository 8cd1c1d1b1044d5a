"""Which figure a limit reads off one size: the rank it gates, the figure it falls back to."""

from pytest_gpumem.results.predict import MODELS, Fit, Prediction
from pytest_gpumem.results.size import ALLOCATED, DEVICE, HOST, FloorResult, SizeResult, gated_reading
from pytest_gpumem.sampling import AllocatedPeak, DeviceEstimate, Peak


def test_rank_all_reads_the_largest_rank_of_the_figure_it_reads():
    """The allocator's largest rank is not the device figure's: each figure names its own."""
    size = SizeResult(2, "gpu", {0: Peak(100.0, "m"), 1: Peak(90.0, "m")},
                      allocated={0: AllocatedPeak(50.0, None, "torch"), 1: AllocatedPeak(70.0, None, "torch")})
    assert gated_reading(size, "all").read(ALLOCATED) == ("rank 1 (largest)", 70.0, ALLOCATED)
    assert gated_reading(size, "all").read(DEVICE) == ("rank 0 (largest)", 100.0, DEVICE)
    assert gated_reading(size, 0).read(ALLOCATED) == ("rank 0", 50.0, ALLOCATED)


def test_a_fake_gpus_device_figure_is_the_one_it_predicts_else_its_allocator_figure():
    def estimate(reserved: float) -> DeviceEstimate:
        return DeviceEstimate((("reserved", reserved), ("context", 500.0)), "NVIDIA H100 80GB HBM3", 81079.0)

    peaks = {0: Peak(None, "fake GPU"), 1: Peak(None, "fake GPU")}
    size = SizeResult(2, "gpu", peaks, fake_gpu="NVIDIA H100 80GB HBM3",
                      allocated={0: AllocatedPeak(50.0, 64.0, "torch", estimate(64.0)),
                                 1: AllocatedPeak(70.0, 80.0, "torch", estimate(80.0))})
    assert gated_reading(size, 0).read(DEVICE) == ("rank 0", 564.0, DEVICE)
    assert gated_reading(size, "all").read(DEVICE) == ("rank 1 (largest)", 580.0, DEVICE)
    assert gated_reading(size, 0).read(ALLOCATED) == ("rank 0", 50.0, ALLOCATED)
    uncalibrated = SizeResult(1, "gpu", {0: Peak(None, "fake GPU")}, fake_gpu="NVIDIA H200",
                              allocated={0: AllocatedPeak(50.0, 64.0, "torch")})
    assert gated_reading(uncalibrated, 0).read(DEVICE) == ("rank 0", 50.0, ALLOCATED)


def test_host_memory_has_one_figure_whatever_the_limit_asks():
    size = SizeResult(1, "cpu", {0: Peak(10.0, "live allocations")})
    assert gated_reading(size, 0).read(ALLOCATED) == ("rank 0", 10.0, HOST)
    assert gated_reading(size, 0).read(DEVICE) == ("rank 0", 10.0, HOST)


def test_a_predicted_size_reads_its_own_allocator_prediction():
    fit = Fit(MODELS[0], (1.0, 0.0), ((1, 1.0), (2, 2.0)), None)
    size = SizeResult(8, "gpu", {}, prediction=Prediction(8, 900.0, fit),
                      allocated_prediction=Prediction(8, 800.0, fit, rank_label="largest rank"))
    assert gated_reading(size, 0).read(ALLOCATED) == ("largest rank", 800.0, ALLOCATED)
    assert gated_reading(size, 0).read(DEVICE) == ("rank 0", 900.0, DEVICE)
    alone = SizeResult(8, "gpu", {}, prediction=Prediction(8, 900.0, fit))  # no allocator figure was fitted
    assert gated_reading(alone, 0).read(ALLOCATED) == ("rank 0", 900.0, DEVICE)


def test_a_sizes_gated_reading_holds_the_rank_its_label_and_each_figure():
    """What every step after the gate reads of a size, made once: under rank="all" the device figure's
    largest rank is gated, the allocator figure names its own largest, the others are the rest."""
    size = SizeResult(2, "gpu", {0: Peak(100.0, "per-pid"), 1: Peak(90.0, "per-pid")},
                      allocated={0: AllocatedPeak(50.0, None, "torch"), 1: AllocatedPeak(70.0, None, "torch")})
    every = gated_reading(size, "all")
    assert (every.rank, every.label, every.mib, every.others_mib, every.method, every.every) == (
        0, "rank 0 (largest)", 100.0, 90.0, "per-pid", True)
    assert every.read(ALLOCATED) == ("rank 1 (largest)", 70.0, ALLOCATED) and every.read(DEVICE) == every.device
    one = gated_reading(size, 1)
    assert (one.rank, one.label, one.mib, one.others_mib, one.every) == (1, "rank 1", 90.0, 100.0, False)


def test_a_figure_is_split_into_floor_and_job_only_where_it_holds_the_floor():
    """A CPU job on a GPU machine makes no CUDA context: 3.2 MiB against a 612 MiB floor is no split
    (the table showed 612.0 + -608.8)."""
    floor = FloorResult("torch", {0: 612.0})
    assert floor.split(0, 1000.0) == (612.0, 388.0)
    assert floor.split(0, 3.2) is None
    assert floor.split(1, 1000.0) is None and floor.split(None, 1000.0) is None and floor.split(0, None) is None
