"""Every rank that can differ runs on a fake GPU by default (issue 64, item 2).

A fake GPU's sizes are a simulated world: above the smallest world above 1 the gated rank runs alone,
but at that world every rank runs (``rank_groups.ranks_to_simulate``), so a job whose rank 1 raises or
hangs fails. A two-rank DDP job written for CUDA, healthy, with rank 1 raising, and with rank 1
sleeping past the launch's timeout: real pytest sessions in a subprocess, on the machine's fake GPU,
each rank forked from the fake GPU's warm server (the report says ``serve``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import SUBPROCESS_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.torch,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")]

# The hang's launch timeout, counted from the ranks' fork: a served size of a tiny DDP job took 1.1-1.5 s
# on the 2-core machine at a load average of 17, an exec'd one 11-15 s (benchmarks/results/fake_size_cost.txt,
# tiny rows): 30 s leaves a healthy size room even exec'd.
HANG_TIMEOUT_S = 30

BODY = '''
import os
import time

import pytest
import torch
import torch.distributed as dist

FAULT = os.environ.get("FAULT", "")


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", fake_gpu="on", timeout={timeout})
def test_ddp():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).cuda())
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(32, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 1 and FAULT == "raise":
        raise RuntimeError("rank one lost its bucket")
    if dist.get_rank() == 1 and FAULT == "hang":
        time.sleep(3600)  # a peer that never reaches the next collective
    dist.destroy_process_group()
'''


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fault: str) -> tuple[pytest.RunResult, dict]:
    monkeypatch.setenv("FAULT", fault)
    pytester.makepyfile(test_job=BODY.format(timeout=HANG_TIMEOUT_S))
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "-W", "ignore",
                                           f"--gpumem-report={report}", timeout=SUBPROCESS_TIMEOUT_S + HANG_TIMEOUT_S)
    sizes = {s["nproc"]: s for s in json.loads(report.read_text())["tests"][0]["sizes"]} if report.exists() else {}
    return result, sizes


def test_healthy_two_rank_ddp_passes_with_every_rank_run_at_2_and_rank_0_alone_at_8(pytester, monkeypatch,
                                                                                      launch_tag):
    result, sizes = run(pytester, monkeypatch, "")
    result.assert_outcomes(passed=1)
    assert {n: s["simulated"] for n, s in sizes.items()} == {1: [0], 2: [0, 1], 8: [0]}
    assert {s["start"] for s in sizes.values()} == {"serve"}, "forked from the fake GPU's warm server"
    assert sizes[2]["allocated_ranks"].keys() == {"0", "1"}
    result.stdout.fnmatch_lines(["*test_job.py::test_ddp*2 * (rank 0, fake NVIDIA H200, every rank ran)*passed*",
                                 "*test_job.py::test_ddp*8 * (rank 0, fake NVIDIA H200, rank 0 ran alone)*passed*"])


def test_rank_1_raising_fails_naming_rank_1_and_its_exception(pytester, monkeypatch, launch_tag):
    result, _ = run(pytester, monkeypatch, "raise")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 2 (simulated) failed: RuntimeError: rank one lost its bucket*"])


@pytest.mark.long  # its launch waits out the timeout; test_fork_start's forked hang covers the stack in make test
def test_rank_1_hanging_fails_at_the_timeout_with_rank_1_s_stack(pytester, monkeypatch, launch_tag):
    result, _ = run(pytester, monkeypatch, "hang")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*rank 1 of 2 (simulated) hung: no result when the launch timed out after "
                                 f"{HANG_TIMEOUT_S} s at nproc=2*",
                                 "*rank 1 Python stack when the timeout hit*",
                                 '*File "*test_job.py", line * in test_ddp*'])


# A rank of a simulated world on the fake GPU, as a launch starts it: the world, then the fake GPU, then torch.
CURRENT_DEVICE = """
import json, os
from pytest_gpumem.rankside import fakegpu, simulate
simulate.install_world(simulate.world())
fakegpu.install("NVIDIA H200")
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
with torch.device("cuda"):
    built = torch.nn.Linear(8, 8)
found = {"cuda()": torch.ones(2).cuda(), "device='cuda'": torch.ones(2, device="cuda"),
         "to('cuda')": torch.ones(2).to("cuda"), "with torch.device": built.weight,
         "module.cuda()": torch.nn.Linear(8, 8).cuda().weight}
dist.init_process_group("nccl")
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(4, 64, device="cuda")).sum().backward()
found["FSDP2's parameter"] = next(model.parameters()).to_local()
print(json.dumps({name: str(tensor.device) for name, tensor in found.items()}), flush=True)
dist.destroy_process_group()
os._exit(0)  # as a rank ends (fast exit): the interpreter's teardown aborted at random here
"""


def test_cuda_without_an_index_is_the_current_device_so_fsdp2_runs_at_rank_1():
    """``.cuda()`` and ``device="cuda"`` after ``set_device(1)`` are cuda:1, as on a GPU: they were cuda:0,
    and FSDP2 at rank 1 failed 'Expects the parameter to already be moved to device cuda:1 but got cuda:0'."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "GPUMEM_SIMULATED_RANK": "1/2", "RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "GPUMEM_FAKE_GPU": "on"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CURRENT_DEVICE], env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    devices = json.loads(done.stdout.strip().splitlines()[-1])
    assert devices == dict.fromkeys(devices, "cuda:1") and len(devices) == 6
