"""Simulated ranks that do not fit the GPUs together run in groups, one after another, merged into one run."""

from pytest_gpumem.launching.launched import SizeRun
from pytest_gpumem.launching.rank_groups import merged, rank_groups, ranks_to_simulate
from pytest_gpumem.launching.supervise import LaunchResult
from pytest_gpumem.results.size import SizeResult, gated_reading
from pytest_gpumem.sampling import Peak


def test_on_gpus_as_many_ranks_run_at_a_time_as_there_are_gpus():
    assert rank_groups(tuple(range(8)), 1, fake=False) == [(r,) for r in range(8)]
    assert rank_groups(tuple(range(8)), 2, fake=False) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert rank_groups(tuple(range(3)), 2, fake=False) == [(0, 1), (2,)]
    assert rank_groups((0,), 1, fake=False) == [(0,)]  # the gated rank alone: one launch, as before


def test_on_host_memory_or_a_fake_gpu_every_rank_runs_at_once():
    assert rank_groups(tuple(range(8)), None, fake=False) == [tuple(range(8))]
    assert rank_groups(tuple(range(8)), 1, fake=True) == [tuple(range(8))]


def group(ranks, mib, seconds):
    peaks = {r: Peak(m, "per-pid sampled") for r, m in zip(ranks, mib)}
    result = SizeResult(8, "gpu", peaks, platform="gpu:NVIDIA H200 (simulated)", duration_s=seconds,
                        timeline=((1.0, {r: m for r, m in zip(ranks, mib)}),), simulated=ranks)
    return SizeRun(result=result, launch=LaunchResult(8, []), outcomes={}, notes=["same note"])


def test_the_groups_merge_into_one_run_of_the_worlds_size_on_one_time_axis_and_say_their_cost():
    run = merged([group((0,), [100.0], 5.0), group((1,), [300.0], 6.0), group((2,), [200.0], 4.0)], 1)
    assert run.result.world_size == 8 and run.result.simulated == (0, 1, 2)
    assert {r: p.mib for r, p in run.result.peaks.items()} == {0: 100.0, 1: 300.0, 2: 200.0}
    reading = gated_reading(run.result, "all")
    assert (reading.label, reading.mib) == ("rank 1 (largest)", 300.0)
    assert [t for t, _ in run.result.timeline] == [1.0, 6.0, 12.0]  # each group after the ones before
    assert run.result.duration_s == 15.0
    assert run.notes == ["same note", "nproc=8: its 3 simulated ranks ran 1 at a time (each alone on one of 1 "
                                      "GPU(s)), 3 launches one after another, 15.0 s in all"]
    one = group((0,), [100.0], 5.0)
    assert merged([one], 1) is one


def test_every_rank_runs_at_the_smallest_simulated_world_above_1_where_none_above_1_is_launched():
    """A rank other than the gated one that crashes or hangs must fail the test: at the cheapest world
    above 1 every rank runs; above it (and where a world above 1 runs for real) the gated rank alone."""
    fake = (1, 2, 8)  # a fake GPU: every size simulated, none launched
    assert [ranks_to_simulate(0, n, fake, ()) for n in fake] == [(0,), (0, 1), (0,)]
    assert [ranks_to_simulate(1, n, (2, 4), (1,)) for n in (2, 4)] == [(0, 1), (1,)]  # the gated rank above
    assert ranks_to_simulate(0, 8, (8,), (1, 2)) == (0,)  # 2 ran for real: every rank of it ran there
    assert ranks_to_simulate("all", 8, fake, ()) == tuple(range(8))
    assert ranks_to_simulate(0, 4, (4,), ()) == (0, 1, 2, 3)  # one size only: it is the smallest
    assert ranks_to_simulate(0, 2, fake, (), assumed=True) == (0,)  # assume=: the gated rank's assumption
