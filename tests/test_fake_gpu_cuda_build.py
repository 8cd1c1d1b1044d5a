"""The fake GPU under torch's CUDA build on a machine without a CUDA driver: a CPU runner that installed
torch's default wheel (the vision venv's torch 2.14.1 is one; marked vision). The build's own device
guard and hooks ask the driver; the shim replaces them, and the example's figures are the CPU build's
baselines (torch 2.13.0+cpu), within their tolerance.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.vision,
              pytest.mark.skipif(torch.version.cuda is None, reason="torch's CPU build: make test's other runs"),
              pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU node: the build's own guard works")]

ROOT = Path(__file__).resolve().parent.parent


def test_a_cuda_job_on_torchs_cuda_build_without_a_driver_reads_the_cpu_builds_baselines(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpumem",
                           "examples/test_torch_cuda_fake.py::test_fsdp2_cuda", f"--junitxml={junit}"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    (case,) = ET.parse(junit).getroot().iter("testcase")
    found = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert found["gpumem_status"] == "passed"
    for nproc in (1, 2, 8):
        gated = float(found[f"gpumem_nproc{nproc}_gated_mib"])
        stored = float(found[f"gpumem_nproc{nproc}_baseline_mib"])
        assert abs(gated - stored) <= 0.005 * stored, (nproc, gated, stored)


# What a CUDA build's Python side and its C++ kernel choice would ask the driver: an LSTM asks cuDNN's
# version (timm's Sequencer), and attention the fake GPU sends to the math kernel (fp32 with a mask of
# strides no fused kernel takes; timm's Twins, NesT, SAM-ViT) went through the build's own choice.
JOB = """
import sys
sys.path.insert(0, {root!r})
from pytest_gpumem.rankside import fakegpu
fakegpu.install("NVIDIA H200", None)
import torch
lstm = torch.nn.LSTM(16, 16, batch_first=True).cuda()
out, _ = lstm(torch.randn(2, 5, 16, device="cuda"))
q = torch.randn(2, 4, 8, 12, device="cuda", requires_grad=True)
mask = torch.randn(2, 4, 8, 8, device="cuda").transpose(-1, -2)
attended = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
(out.sum() + attended.sum()).backward()
print("peak", torch.cuda.max_memory_allocated(), flush=True)
import os
os._exit(0)  # as a rank ends: the interpreter's teardown can abort on autograd's device threads
"""


def test_an_lstm_and_math_attention_run_on_the_cuda_build_without_a_driver() -> None:
    done = subprocess.run([sys.executable, "-c", JOB.format(root=str(ROOT))], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("peak ")


DDP_JOB = """
import pytest


@pytest.mark.gpumem(nproc=[1, 2], device="gpu", fake_gpu="on")
def test_ddp():
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).cuda(), device_ids=[0])
    for _ in range(2):
        model(torch.randn(64, 256, device="cuda")).sum().backward()
"""


def test_ddp_times_its_iterations_on_the_host_on_the_cuda_build_without_a_driver(tmp_path: Path) -> None:
    """DDP's reducer timed its first iterations with CUDA events, which asked the driver: every DDP job
    on the CUDA build stopped at its first forward ("CUDA driver version is insufficient")."""
    (tmp_path / "test_ddp.py").write_text(DDP_JOB)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpumem", "test_ddp.py"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "every rank ran" in done.stdout  # rank 1 of 2 ran its DDP too
