"""The GPU-versus-host choice end to end on a machine without GPUs: real launches through the
runner, NVML faked at its boundary (the planner's ``nvml``), each scenario named after what it
reproduces. The real-GPU side of the same path is docs/gpu.md's evidence."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNvml, Snap, uuid

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging.assemble import build
from pytest_gpumem.judging.verdict import judge
from pytest_gpumem.launching.driver import TestDriver
from pytest_gpumem.launching.gpus import GpuPlanner
from pytest_gpumem.launching.rank_setup import RankSetup

pytestmark = pytest.mark.slow

JOB = "import time\ntime.sleep(0.6)\n"


def run(tmp_path: Path, nvml: FakeNvml, track_host: str = "auto", **marker: object):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    planner = GpuPlanner.for_this_machine(tmp_path / "leases", 5.0, 0.01, nvml=nvml)
    runner = TestDriver(cwd=tmp_path, setup=RankSetup(rootdir=tmp_path, rank_pytest_args=lambda _: [],
                                                  track_host=track_host), gpu_setup=planner)
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
    assert result.host_peaks[0].method == "high-water mark (no allocation peak reported)"  # not tracked
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


TRACKED, UNTRACKED = "live allocations (memray)", "high-water mark (no allocation peak reported)"


def test_host_allocations_are_tracked_where_the_host_figure_is_gated_or_asked_for(tmp_path, launch_tag):
    """memray hooks every Python call and allocation of a rank (1.1-2x its time): a launch whose ranks
    have GPUs, and so a GPU figure, runs without it unless the option or the marker asks for it."""
    cases = {
        "GPU leased, device auto": ({}, {}, UNTRACKED),
        "GPU leased, device gpu": ({}, {"device": "gpu"}, UNTRACKED),
        "device cpu on a GPU machine": ({}, {"device": "cpu"}, TRACKED),
        "--gpumem-track-host=on": ({"track_host": "on"}, {}, TRACKED),
        "the marker's env asks": ({}, {"env": {"GPUMEM_TRACK_ALLOCATIONS": "1"}}, TRACKED),
    }
    for name, (option, marker, method) in cases.items():
        test = run(tmp_path, FakeNvml([busy_gpu()]), **option, **marker)
        assert not test.problems, name
        assert test.results[0].host_peaks[0].method == method, name
        size = build(test, judge(test.spec, test.results), "passed").to_json()["sizes"][0]
        assert size["host_methods"]["0"] == method, name  # the report says how the host figure was taken
        assert size["rss_ranks"]["0"] > 0, name  # VmHWM, information, always
    # and where no GPU was leased, the host figure is gated: tracked unless switched off
    assert run(tmp_path, FakeNvml([], driver=False)).results[0].peaks[0].method == TRACKED
    assert run(tmp_path, FakeNvml([], driver=False), track_host="off").results[0].peaks[0].method == UNTRACKED


def test_ranks_with_a_gpu_not_seen_on_it_say_why_their_host_figure_is_resident_memory(tmp_path, launch_tag):
    """device="auto" falls back to the host figure when no rank was seen on its GPU; the decision to
    skip the tracker was taken before the launch, so the report says what the figure is and how to
    gate live allocations instead."""
    idle = FakeGpu(uuid(1), snaps=[Snap(0.0)], fail={"memory": FakeNvml.NVMLError_NotSupported})
    test = run(tmp_path, FakeNvml([idle]))
    result = test.results[0]
    assert result.device == "cpu" and result.peaks[0].method == UNTRACKED
    assert any("host allocations were not tracked" in note and "--gpumem-track-host=on" in note
               for run_ in test.runs for note in run_.notes), [n for r in test.runs for n in r.notes]
