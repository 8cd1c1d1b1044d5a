"""The GPU tier (``make test-gpu``): real CUDA + NCCL launches on a machine with NVIDIA GPUs.

Skipped elsewhere, saying why; ``make test-gpu`` sets GPUMEM_FORBID_SKIPS, so there a skip fails
the run. Each test reads the plugin's JSON report (``--gpumem-report``) and compares it with what
the ranks themselves read from NVML while holding their memory. The results of the last run on the
GPU machine are in benchmarks/results/test_gpu.txt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.slow]


def _gpus() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


GPUS = _gpus()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU that torch can use (make test-gpu there)")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for an NCCL launch at nproc=2; {GPUS} here")

# What the rank itself reads from NVML for its own PID while it holds its memory: the figure the
# plugin's parent-side (or in-rank) sampler must reproduce.
OWN = '''
import json, os, time
import pytest
import pynvml
import torch
import torch.distributed as dist

MiB = 1024 * 1024


def own_mib():
    """NVML's per-process figure for this PID on this rank's GPU."""
    pynvml.nvmlInit()
    try:
        uuid = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ.get("LOCAL_RANK", "0"))]
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return max((p.usedGpuMemory or 0) / MiB for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                   if p.pid == os.getpid())
    finally:
        pynvml.nvmlShutdown()


def note(**values):
    """One JSON line per rank and world size, for the outer test to compare with the report."""
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    with open(os.path.join(os.environ["OUT"], f"{world}-{rank}.json"), "w") as fh:
        json.dump(values, fh)


def hold(mib):
    block = torch.ones(mib * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.3)                       # several sampler periods at the held peak
    return block
'''


def _run(pytester: pytest.Pytester, out: Path, body: str, *args: str) -> tuple[Any, dict[str, Any]]:
    pytester.makepyfile(OWN + body.replace("OUT_DIR", repr(str(out))))
    report = pytester.path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}", *args)
    records = {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}
    return result, records


def _size(record: dict[str, Any], nproc: int) -> dict[str, Any]:
    return next(s for s in record["sizes"] if s["nproc"] == nproc)


def _own(out: Path, world: int, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{world}-{rank}.json").read_text())


@needs_gpu
@pytest.mark.parametrize("sampler", ["parent", "rank"])
def test_gated_gpu_peak_is_what_nvml_shows_for_the_rank(pytester, launch_tag, tmp_path, sampler):
    """1 GiB held on the GPU: the gated figure is the rank's own NVML figure at its peak (within
    2 MiB: the CUDA allocator's rounding), from either sampler, and gated as GPU memory."""
    out = tmp_path / "own"
    out.mkdir()
    result, records = _run(pytester, out, '''
@pytest.mark.gpumem(nproc=1, device="gpu", env={"OUT": OUT_DIR})
def test_hold():
    block = hold(1024)
    note(own=own_mib())
    del block
''', f"--gpumem-gpu-sampler={sampler}")
    result.assert_outcomes(passed=1)
    size = _size(records["test_hold"], 1)
    own = _own(out, 1, 0)["own"]
    print(f"sampler in the {sampler}: gated {size['gated_mib']:.1f} MiB [{size['methods']['0']}], "
          f"the rank's own NVML figure {own:.1f} MiB")
    assert size["device"] == "gpu"
    assert own >= 1024
    assert abs(size["gated_mib"] - own) <= 2.0, (size["gated_mib"], own, size["methods"])


@needs_gpu
def test_a_2_gib_spike_held_5_ms_is_caught(pytester, launch_tag, tmp_path):
    """The figure is a peak, not the last value: 2 GiB allocated for 5 ms on top of 512 MiB."""
    out = tmp_path / "own"
    out.mkdir()
    result, records = _run(pytester, out, '''
@pytest.mark.gpumem(nproc=1, device="gpu", env={"OUT": OUT_DIR})
def test_spike():
    steady = hold(512)
    note(steady=own_mib())
    spike = torch.ones(2048 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.005)
    del spike
    torch.cuda.synchronize()
    time.sleep(0.3)
''')
    result.assert_outcomes(passed=1)
    steady = _own(out, 1, 0)["steady"]
    print(f"steady {steady:.1f} MiB (the rank's own NVML figure), 2048 MiB held 5 ms on top: "
          f"gated {_size(records['test_spike'], 1)['gated_mib']:.1f} MiB")
    assert _size(records["test_spike"], 1)["gated_mib"] >= steady + 2048 - 2.0


@needs_gpu
@needs_two
def test_nccl_job_that_inflates_at_two_ranks_fails_and_a_healthy_one_passes(pytester, launch_tag, tmp_path):
    """The product's promise on real GPUs: 4 GiB of activations per rank at nproc 1 and 2 passes
    ``max_ratio=1.3``; keeping the gathered global batch on every rank (8 GiB more at nproc=2)
    fails it, naming rank 0, nproc=2 and the GPU figure. Each rank's gated figure is its own NVML
    figure at the peak, and the floor (CUDA context + NCCL communicator) is split out."""
    out = tmp_path / "own"
    out.mkdir()
    result, records = _run(pytester, out, '''
def step(keep_global_batch, tag):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    local = torch.ones(4096 * MiB // 4, device="cuda")
    kept = None
    if keep_global_batch:                   # the bug: every rank gathers every rank's batch
        kept = torch.empty(world * local.numel(), device="cuda")
        dist.all_gather_into_tensor(kept, local)
    grad = torch.ones(1024, device="cuda")
    dist.all_reduce(grad)
    torch.cuda.synchronize()
    time.sleep(0.3)
    if tag:
        note(own=own_mib())
    del kept
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=[1, 2], device="gpu", max_ratio=1.3, env={"OUT": OUT_DIR})
def test_healthy():
    step(False, True)


@pytest.mark.gpumem(nproc=[1, 2], device="gpu", max_ratio=1.3)
def test_inflating():
    step(True, False)
''', "--gpumem-floor=on")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=2 (gpu): peak * MiB > 1.30 x * MiB (nproc=1) + 0 MiB = *"])
    healthy = records["test_healthy"]
    for name, rec in records.items():
        for size in rec["sizes"]:
            ratio = "" if size["ratio"] is None else f", {size['ratio']:.2f}x nproc=1"
            print(f"{name} nproc={size['nproc']}: ranks {size['ranks']} MiB{ratio}; floor {size['floor']['ranks']} "
                  f"({size['floor']['what']})")
    for world in (1, 2):
        size = _size(healthy, world)
        assert size["device"] == "gpu"
        for rank in range(world):
            own = _own(out, world, rank)["own"]
            print(f"test_healthy nproc={world} rank {rank}: the rank's own NVML figure {own:.1f} MiB")
            assert abs(size["ranks"][str(rank)] - own) <= 2.0, (world, rank, size["ranks"], own)
        floor = size["floor"]["ranks"]
        assert 0 < floor["0"] < size["gated_mib"], (floor, size["gated_mib"])
    inflating = records["test_inflating"]
    assert _size(inflating, 2)["gated_mib"] - _size(healthy, 2)["gated_mib"] >= 8192 - 64
