"""The eager boxing audit's plain parts: OneFlow's log lines, what a conversion costs a rank, and
what a failure lists against a smaller size (recorded data; no OneFlow needed)."""

from __future__ import annotations

import json

from pytest_gpumem.oneflow import conversions
from pytest_gpumem.oneflow.conversions import Conversion

PLACE = 'oneflow.placement(type="cpu", ranks=[0, 1])'
ONE = 'oneflow.placement(type="cpu", ranks=[0])'

# OneFlow 0.9's eager boxing logger, from a 2-rank run (glog's prefix shortened, other lines kept).
LOG = f"""I20261206 06:18:53.162521  7915 env_global_objects_scope.cpp:168] Using rpc backend: gRPC
I20261206 06:18:53.162521  7915 eager_boxing_logger.cpp:42] Boxing route: identity -> ccl-s-to-b
I20261206 06:18:53.162552  7915 eager_boxing_logger.cpp:43] Logical shape: (64,32)
I20261206 06:18:53.162559  7915 eager_boxing_logger.cpp:44] Altered state of sbp: (S(0)) -> (S(0)) -> (B)
I20261206 06:18:53.162567  7915 eager_boxing_logger.cpp:45] Altered state of placement: {PLACE} -> {PLACE} -> {PLACE}
I20261206 06:18:53.194692  7915 eager_boxing_logger.cpp:42] Boxing route: identity
I20261206 06:18:53.194725  7915 eager_boxing_logger.cpp:43] Logical shape: (32,32)
I20261206 06:18:53.194731  7915 eager_boxing_logger.cpp:44] Altered state of sbp: (B) -> (B)
I20261206 06:18:53.194744  7915 eager_boxing_logger.cpp:45] Altered state of placement: {PLACE} -> {PLACE}
I20261206 06:18:53.195070  7915 eager_boxing_logger.cpp:42] Boxing route: ccl-s-to-s
I20261206 06:18:53.195077  7915 eager_boxing_logger.cpp:43] Logical shape: (32,64)
I20261206 06:18:53.195080  7915 eager_boxing_logger.cpp:44] Altered state of sbp: (S(0)) -> (S(1))
I20261206 06:18:53.195086  7915 eager_boxing_logger.cpp:45] Altered state of placement: {PLACE} -> {PLACE}
I20261206 06:18:53.195730  7915 eager_boxing_logger.cpp:42] Boxing route: naive-1-to-n
I20261206 06:18:53.195741  7915 eager_boxing_logger.cpp:43] Logical shape: (8,)
I20261206 06:18:53.195745  7915 eager_boxing_logger.cpp:44] Altered state of sbp: (B) -> (B)
I20261206 06:18:53.195748  7915 eager_boxing_logger.cpp:45] Altered state of placement: {ONE} -> {PLACE}
"""


def test_the_loggers_lines_become_conversions_and_identities_are_left_out():
    assert conversions.parse_log(LOG) == [
        ("S(0)", "B", (64, 32), "cpu:0-1", "cpu:0-1"),
        ("S(0)", "S(1)", (32, 64), "cpu:0-1", "cpu:0-1"),
        ("B", "B", (8,), "cpu:0", "cpu:0-1"),
    ]
    assert conversions.parse_log(LOG.splitlines()[0]) == []
    two_d = 'oneflow.placement(type="cuda", ranks=[[0, 1], [2, 3]], hierarchy=(2, 2))'
    assert conversions.placement_str(two_d) == "cuda:0-3"


def _c(src, dst, line="model.py:25 forward", shape=(2048, 16384), world=2, how="to_global", count=1,
       placement="cpu:0-1", dtype="float32"):
    return Conversion(src, dst, line, shape, dtype, placement, world, how, count)


def test_what_a_conversion_adds_to_a_rank():
    mib = 1 << 20
    assert _c("S(0)", "B").added_bytes() == 64 * mib            # 128 MiB logical: half was there
    assert _c("S(0)", "B", world=1, placement="cpu:0").added_bytes() == 0  # one rank: nothing moves
    assert _c("P", "B").added_bytes() == 0                       # an all-reduce: same size
    assert _c("B", "S(0)").added_bytes() == -64 * mib
    assert _c("B", "B", placement="cpu:0 -> cpu:0-1").added_bytes() == 0  # rank 0 had it already
    assert _c("S(0)", "B", dtype="").added_bytes() is None       # dtype unknown: no guess
    assert _c("S(0)", "B", placement="cpu:0 -> cpu:0-1").kind == "S(0)->B [cpu:0 -> cpu:0-1]"
    raw = json.loads(json.dumps(_c("S(0)", "B", count=3).as_dict()))
    assert Conversion.from_dict(raw) == _c("S(0)", "B", count=3)


def test_a_failure_names_the_new_conversion_its_line_and_what_it_adds():
    one = [_c("S(0)", "B", shape=(1024, 16384), world=1, placement="cpu:0", count=3)]
    two = [
        _c("S(0)", "B", count=3),                                                  # grew: 0 -> 64 MiB a rank
        _c("S(1)", "B", line="model.py:18 forward", shape=(1024, 2048), how="inferred", count=3),
        _c("P", "B", line="train.py:9 step", shape=(1024, 16384), how="inferred", count=12),  # gradients
        _c("B", "B", line="train.py:3 setup", shape=(1,), placement="cpu:0 -> cpu:0-1", how="inferred"),
    ]
    lines = conversions.compare(two, 2, one, 1)
    assert lines == [
        "S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); "
        "to_global of (2048, 16384) float32, x3",
        "S(1)->B at model.py:18 forward: +4.0 MiB at nproc=2 (not at nproc=1); inferred of (1024, 2048) float32, x3",
    ]
    section = conversions.scaling_lines(2, two, [(1, one)])
    assert section[0] == "  eager boxing (SBP conversions) at nproc=2 against nproc=1:"
    assert section[1] == "    " + lines[0]
    assert conversions.scaling_lines(2, two, []) == []  # nothing to compare with


def test_a_healthy_data_parallel_job_lists_nothing_new():
    one: list[Conversion] = []
    two = [_c("P", "B", line="train.py:9 step", how="inferred", count=12),
           _c("P", "S(0)", line="train.py:9 step", how="inferred", count=2)]
    assert conversions.compare(two, 2, one, 1) == []
    assert conversions.scaling_lines(2, two, [(1, one)], problem="another tracer runs") == [
        "  eager boxing (SBP conversions) at nproc=2 against nproc=1: no new conversions, "
        "none that holds more memory a rank",
        "    (another tracer runs)"]


def test_the_same_conversion_from_many_calls_is_one_line_and_tiny_moves_are_left_out():
    merged = conversions.by_key([_c("S(0)", "B", count=2), _c("S(0)", "B", count=1)])
    assert list(merged.values()) == [_c("S(0)", "B", count=3)]
    lr = _c("B", "B", line="opt.py:1 step", shape=(1,), placement="cpu:0 -> cpu:0-1", how="inferred")
    weight = _c("B", "B", line="opt.py:2 step", shape=(4096, 4096), placement="cpu:0 -> cpu:0-1")
    assert conversions.compare([lr, weight], 2, [], 1) == [
        "B->B [cpu:0 -> cpu:0-1] at opt.py:2 step: none at nproc=2 (not at nproc=1); "
        "to_global of (4096, 4096) float32, x1"]


def test_against_a_baseline_the_kinds_it_had_fewer_of_are_listed(tmp_path):
    path = tmp_path / "rank-0.eager"
    grads = _c("P", "B", line="train.py:9 step", how="inferred", count=4)
    path.write_text(json.dumps({"conversions": [_c("S(0)", "B", count=2).as_dict(), grads.as_dict()]}))
    stored = conversions.eager_provenance(path)
    assert stored == {"eager_boxing.P->B (inferred)": "4", "eager_boxing.S(0)->B (to_global)": "2"}
    assert conversions.stored_counts(stored) == {("P->B", "inferred"): 4, ("S(0)->B", "to_global"): 2}
    now = [_c("S(0)", "B", count=2), grads,
           _c("S(1)", "B", line="model.py:18 forward", how="inferred", shape=(1024, 2048), count=2)]
    against, lines = conversions.news(2, now, [(1, [])], stored)
    assert against == "the baseline"
    assert lines == ["S(1)->B at model.py:18 forward: +4.0 MiB at nproc=2 (S(1)->B inferred x0 in the baseline, "
                     "x2 now); inferred of (1024, 2048) float32, x2"]
    assert conversions.news(2, now, [], {"oneflow": "0.9.0"}) is None  # an older baseline, no smaller size
