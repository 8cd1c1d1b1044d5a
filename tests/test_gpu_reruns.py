"""Issue 26, item 6: a real NCCL DDP job at nproc=1, refreshed, then rerun; every rerun must pass.

Without a blocking wait its allocator figure read 1601.28 or 1857.33 MiB between identical runs
(benchmarks/gpu/ddp_nccl_spread.py); the plugin's GPU ranks default to TORCH_NCCL_BLOCKING_WAIT=1.
Run on the GPU machine: ``python3 -m pytest -m gpu tests/test_gpu_reruns.py`` (RERUNS=20 by default).
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.slow]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

JOB = '''
import pytest


@pytest.mark.gpumem(nproc=1, device="gpu")
def test_ddp_nccl():
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 4096)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.Adam(ddp.parameters())
    for _ in range(3):
        ddp(torch.randn(256, 4096, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    dist.destroy_process_group()
'''


@pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU")
def test_an_unchanged_nccl_ddp_job_passes_every_rerun(pytester, launch_tag):
    pytester.makepyfile(test_job=JOB)
    args = ("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=off")
    pytester.runpytest(*args, "--gpumem-refresh").assert_outcomes(passed=1)
    figures = []
    for i in range(int(os.environ.get("RERUNS", "20"))):
        report = pytester.path / f"rerun{i}.json"
        result = pytester.runpytest(*args, f"--gpumem-report={report}")
        size = json.loads(report.read_text())["tests"][0]["sizes"][0]
        figures.append((size["gated_mib"], size["allocated_mib"]))
        print(f"rerun {i + 1}: device {size['gated_mib']:.1f} MiB, allocated {size['allocated_mib']:.2f} MiB, "
              f"{json.loads(report.read_text())['tests'][0]['status']}")
        result.assert_outcomes(passed=1)
    print(f"allocated MiB over {len(figures)} reruns: {sorted({a for _, a in figures})}; "
          f"device MiB: {min(d for d, _ in figures):.1f}-{max(d for d, _ in figures):.1f}")
