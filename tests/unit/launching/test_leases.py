"""GPU leases across processes: all-or-none, never shared, reclaimed when the holder dies."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.launching.gpus import GpuPlanner
from pytest_gpumem.launching.leases import GpuLeases, LeaseError, LeaseTimeout
from pytest_gpumem.sampling.nvml import GpuDevice

GPUS = [GpuDevice(index=i, uuid=f"GPU-{i:08x}-0000", name="NVIDIA H200", total_mib=143771.0, accounting=False)
        for i in range(2)]


def _hold(folder: str, count: int, seconds: float, owner: str) -> None:
    lease = GpuLeases(Path(folder), GPUS, wait_s=60).acquire(count, owner)
    time.sleep(seconds)
    lease.release()


def test_concurrent_holders_never_share_a_gpu(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hold, args=(str(tmp_path), 1 + i % 2, 0.3, f"test-{i}")) for i in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    events = [json.loads(line) for line in (tmp_path / "lease.log").read_text().splitlines()]
    assert len(events) == 12
    held: set[str] = set()
    for event in sorted(events, key=lambda e: e["t"]):
        for gpu in event["gpus"]:
            if event["event"] == "acquire":
                assert gpu not in held, f"{gpu} leased twice at once"
                held.add(gpu)
            else:
                held.discard(gpu)


def test_lease_of_a_killed_holder_is_reclaimed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=_hold, args=(str(tmp_path), 2, 600, "doomed"))
    holder.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "lease.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(LeaseTimeout, match="2 GPU\\(s\\) were not free within 0.3 s.*doomed"):
        GpuLeases(tmp_path, GPUS, wait_s=0.3).acquire(2, "waiting")
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    lease = GpuLeases(tmp_path, GPUS, wait_s=5).acquire(2, "after")
    assert [d.uuid for d in lease.devices] == [g.uuid for g in GPUS]
    lease.release()


def test_more_gpus_than_the_machine_has_is_a_skip_naming_both_numbers(tmp_path):
    planner = GpuPlanner(GpuLeases(tmp_path, GPUS, wait_s=1))
    spec = parse_marker((), {"nproc": 4}, Defaults())
    plan = planner(spec, 4, "t")
    assert plan.skip_reason == "needs 4 GPU(s) for nproc=4 but this machine has 2"


def test_plan_pins_ranks_to_leased_gpus_by_pci_bus_index(tmp_path):
    planner = GpuPlanner(GpuLeases(tmp_path, GPUS, wait_s=1))
    plan = planner(parse_marker((), {"nproc": 2}, Defaults()), 2, "t")
    try:
        assert plan.env == {"CUDA_VISIBLE_DEVICES": "0,1",  # integers: DeepSpeed's ZeRO-1/2 parses them
                            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert plan.gpu_name == "NVIDIA H200" and plan.sampler is not None
    finally:
        plan.release()


def test_cpu_device_and_gpu_less_machine_take_no_lease(tmp_path):
    assert GpuPlanner(GpuLeases(tmp_path, GPUS, wait_s=1))(
        parse_marker((), {"nproc": 2, "device": "cpu"}, Defaults()), 2, "t").env == {}
    none = GpuPlanner(None)
    assert none(parse_marker((), {"nproc": 2}, Defaults()), 2, "t").env == {}
    gpu = none(parse_marker((), {"nproc": 2, "device": "gpu"}, Defaults()), 2, "t")
    assert gpu.skip_reason == "needs 2 GPU(s) for nproc=2 but this machine has 0"


def test_lease_folder_is_made_at_the_first_lease_and_private(tmp_path):
    folder = tmp_path / "leases"
    leases = GpuLeases(folder, GPUS, wait_s=1)
    assert not folder.exists(), "a session that leases nothing creates nothing"
    leases.acquire(1, "t").release()
    assert folder.stat().st_mode & 0o077 == 0


def test_lease_folder_writable_by_others_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(LeaseError, match="writable by others; expected a folder of this user's alone"):
        GpuLeases(folder, GPUS, wait_s=1).acquire(1, "t")


def test_lease_folder_that_cannot_exist_is_an_error_naming_the_setting(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(LeaseError, match="gpumem_lease_dir .*file/leases' cannot be used"):
        GpuLeases(tmp_path / "file" / "leases", GPUS, wait_s=1).acquire(1, "t")
    plan = GpuPlanner(GpuLeases(tmp_path / "file" / "leases", GPUS, wait_s=1))(
        parse_marker((), {"nproc": 1}, Defaults()), 1, "t")
    assert "gpumem_lease_dir" in plan.error
