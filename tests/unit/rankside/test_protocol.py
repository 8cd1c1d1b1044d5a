"""The rank-to-parent files: every kind written and read through one module, absent or torn files read as None."""

from __future__ import annotations

import os

from pytest_gpumem.rankside import protocol


def test_exit_report_round_trip_and_unknown_keys(tmp_path):
    report = protocol.ExitReport(pid=42, maxrss_kib=2048.0, alloc_peak_mib=150.2,
                                 alloc_method="live allocations (memray)", gpu_peak_mib=2914.0,
                                 gpu_method="per-pid sampled, in the rank", gpu_name="NVIDIA H200",
                                 provenance={"torch": "2.13.0"})
    protocol.write_exit(tmp_path, 3, report)
    assert protocol.read_exit(tmp_path, 3) == report
    # a newer rank may say more: what this parent does not know is left out, not an error
    protocol.write_json_atomic(protocol.rank_file(tmp_path, 4, "exit"), {"pid": 7, "something_new": 1})
    assert protocol.read_exit(tmp_path, 4) == protocol.ExitReport(pid=7)


def test_absent_or_torn_files_read_as_nothing(tmp_path):
    assert protocol.read_exit(tmp_path, 0) is None
    assert protocol.read_result(tmp_path, 0) is None
    assert protocol.read_hello_pid(tmp_path, 0) is None
    assert protocol.read_config(tmp_path, 0) == {}
    protocol.rank_file(tmp_path, 0, "exit").write_text('{"pid": 1, "maxrss')  # a rank killed mid-write
    protocol.rank_file(tmp_path, 0, "result").write_text("[]")
    assert protocol.read_exit(tmp_path, 0) is None
    assert protocol.read_result(tmp_path, 0) is None


def test_result_hello_config_and_task(tmp_path):
    protocol.write_result(tmp_path, 1, protocol.RankResult("failed", "Traceback ..."))
    assert protocol.read_result(tmp_path, 1) == protocol.RankResult("failed", "Traceback ...")
    protocol.write_hello(tmp_path, 1)
    assert protocol.read_hello_pid(tmp_path, 1) == os.getpid()
    protocol.update_config(tmp_path, 0, {"micro_batch": 4})
    protocol.update_config(tmp_path, 0, {"ckpt": object})  # merged; a non-JSON value as its text
    assert protocol.read_config(tmp_path, 0) == {"micro_batch": 4, "ckpt": str(object)}
    protocol.write_task(tmp_path, 2, {"node": "n2", "returncode": None})
    assert protocol.read_task(tmp_path, 2) == {"node": "n2", "returncode": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank-0.config", "rank-1.hello", "rank-1.result", "rank-2.task"]  # no temp file left
