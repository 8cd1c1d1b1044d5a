"""A fake GPU predicts the device figure, says whether each size fits the GPU it emulates, and a
``max_mib`` (which reads the device figure) gates it (issue 66). The calibration here is a stand-in
GPU model's, written as ``gpumem calibrate`` writes one; the figures of a real H100 are checked
against the GPU in benchmarks/results/device_figure.txt."""

from __future__ import annotations

import json

import pytest

from pytest_gpumem.rankside.fakegpu.models import CALIBRATION_FILE, GpuModel, write_calibration

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

MiB = 2**20
OUTSIDE = {"context": 500 * MiB, "cublas": 100 * MiB, "cudnn": 200 * MiB, "attention": 30 * MiB, "nccl": 300 * MiB}

JOB = '''
import pytest
import torch.distributed as dist


def matmul(mib):
    import torch

    a = torch.ones(mib * 1024 * 1024 // 4, device="cuda").view(-1, 1024)
    return a @ a[:1024]


@pytest.mark.gpumem(nproc=1, device="gpu", fake_gpu="on", max_mib=1200)
def test_fits():
    import torch

    matmul(16)
    torch.nn.Conv2d(3, 8, 3).cuda()(torch.ones(2, 3, 32, 32, device="cuda"))  # cuDNN's kernels


@pytest.mark.gpumem(nproc=1, device="gpu", fake_gpu="on", max_mib=400)
def test_capped():
    import torch

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))  # NCCL's communicator made at once
    matmul(16)  # its allocator figure is under 400 MiB, its device figure is not


@pytest.mark.gpumem(nproc=1, device="gpu", fake_gpu="on")
def test_over():
    import torch

    dist.init_process_group("nccl")
    dist.all_reduce(torch.ones(1, device="cuda"))  # a communicator of one rank: NCCL's part counted
    matmul(7 * 1024)
'''


def test_each_fake_size_carries_its_predicted_device_figure_its_fit_and_max_mib_gates_it(pytester, tmp_path):
    write_calibration(pytester.mkdir("baselines") / CALIBRATION_FILE, GpuModel(
        "NVIDIA H200", 9, 0, 8 * 1024 * MiB, 132, 32 * MiB, MiB, outside=OUTSIDE))
    pytester.makepyfile(test_device=JOB)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                           timeout=600)
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    tests = {t["test"].split("::")[1]: t for t in json.loads(report.read_text())["tests"]}
    for name, parts in (("test_fits", ("context", "cublas", "cudnn")), ("test_capped", ("context", "cublas", "nccl")),
                        ("test_over", ("context", "cublas", "nccl"))):
        (size,) = tests[name]["sizes"]
        rank0 = size["allocated_ranks"]["0"]
        expected = {"reserved": rank0["reserved_mib"], **{p: OUTSIDE[p] / MiB for p in parts}}
        assert rank0["predicted_device_parts_mib"] == expected, name
        assert rank0["predicted_device_mib"] == pytest.approx(sum(expected.values()), abs=0.02)
        assert rank0["predicted_for_gpu"] == "NVIDIA H200" and rank0["gpu_capacity_mib"] == 8192.0
        assert size["gated_mib"] == pytest.approx(rank0["predicted_device_mib"], abs=0.05), name  # max_mib's figure
        fit = f"{rank0['predicted_device_mib'] / 1024:.1f} of 8.0 GiB"
        assert fit in out, name
        assert rank0["fits"] is (name != "test_over"), name
    capped = tests["test_capped"]["sizes"][0]
    assert capped["allocated_mib"] < 400 < capped["gated_mib"]
    assert [(c["kind"], c["ok"], c["figure"]) for c in capped["checks"]] == [("max_mib", False, "device")]
    assert "does not fit NVIDIA H200" in out and "fits NVIDIA H200" in out
    assert "its device figure is predicted" in out
    assert f"rank 0 at nproc=1 (gpu, device figure predicted, fake GPU): peak {capped['gated_mib']:.1f} MiB > max_mib" \
        in out
