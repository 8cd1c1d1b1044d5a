"""The GPU-versus-host choice end to end on a machine without GPUs: real launches through the
runner, NVML faked at its boundary (the planner's ``nvml``), each scenario named after what it
reproduces. The real-GPU side of the same path is docs/gpu.md's evidence."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNvml, Snap, uuid

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.launching.gpus import GpuPlanner
from pytest_gpumem.launching.runner import Runner

pytestmark = pytest.mark.slow

JOB = "import time\ntime.sleep(0.6)\n"


def run(tmp_path: Path, nvml: FakeNvml, **marker: object):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    planner = GpuPlanner.for_this_machine(tmp_path / "leases", 5.0, 0.01, nvml=nvml)
    runner = Runner(cwd=tmp_path, rootdir=tmp_path, rank_pytest_args=lambda _: [], gpu_setup=planner)
    spec = parse_marker((), {"nproc": 1, "script": str(script), **marker}, Defaults())
    return runner.run("job.py::test_job", spec)


def busy_gpu() -> FakeGpu:
    """A GPU whose process list hides the rank (a container's PID namespace) while ``used`` grows."""
    return FakeGpu(uuid(1), snaps=[Snap(0.0), Snap(0.0), Snap(2048.0)])


def test_ranks_seen_on_a_gpu_are_gated_on_gpu_memory(tmp_path, launch_tag):
    test = run(tmp_path, FakeNvml([busy_gpu()]))
    assert not test.problems and test.skip_reason is None
    result = test.results[0]
    assert result.device == "gpu" and result.platform == "gpu:NVIDIA H200"
    assert result.peaks[0].mib == 2048.0 and result.peaks[0].method == "device sampled"
    assert result.host_peaks[0].method == "live allocations (memray)"  # recorded beside it
    assert test.provenance["nvidia_driver"] == "580.159.04"


def test_a_machine_without_a_driver_gates_host_memory(tmp_path, launch_tag):
    test = run(tmp_path, FakeNvml([], driver=False))
    result = test.results[0]
    assert result.device == "cpu" and result.peaks[0].method == "live allocations (memray)"
    assert "nvidia_driver" not in test.provenance


def test_device_cpu_never_touches_the_gpus(tmp_path, launch_tag):
    nvml = FakeNvml([busy_gpu()])
    test = run(tmp_path, nvml, device="cpu")
    assert test.results[0].device == "cpu"
    assert [c for c in nvml.calls if c.startswith("nvmlDeviceGetComputeRunningProcesses")] == []


def test_device_gpu_on_a_machine_without_gpus_is_skipped_naming_both_numbers(tmp_path):
    test = run(tmp_path, FakeNvml([], driver=False), device="gpu")
    assert test.skip_reason == "needs 1 GPU(s) for nproc=1 but this machine has 0"
