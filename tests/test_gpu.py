"""The GPU tier (``make test-gpu``): real CUDA + NCCL launches on a machine with NVIDIA GPUs.

Skipped elsewhere, saying why; ``make test-gpu`` sets GPUMEM_FORBID_SKIPS, so there a skip fails
the run. Each test reads the plugin's JSON report (``--gpumem-report``) and compares it with what
the ranks themselves read from NVML while holding their memory. The results of the last run on the
GPU machine are in benchmarks/results/test_gpu.txt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

# torch.cuda.is_available() below, run by this pytest at import, would initialise CUDA here, after
# which no forked rank can use it (launching/forking.py): the NVML-based check leaves it alone.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.slow]


def _gpus() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


GPUS = _gpus()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU that torch can use (make test-gpu there)")


def needs_framework(name: str) -> None:
    """Skip unless ``name`` is installed, without importing it here: pytester drops the modules a test
    imported when it ends, and torch's operator registry refuses a second import of
    torch.distributed._functional_collectives (torchtitan and Megatron-Core both import it)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"needs {name} (make gpu-wheels carries it to the GPU machine)")

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
        mine = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ.get("LOCAL_RANK", "0"))]
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(mine)) if mine.isdigit()  # PCI bus order, as NVML's
                  else pynvml.nvmlDeviceGetHandleByUUID(mine))
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


def _run_job(pytester: pytest.Pytester, module: str, source: str) -> tuple[Any, dict[str, Any]]:
    """``source`` as ``module`` under ``pytest --gpumem``, no baselines: its output printed, its records."""
    pytester.makepyfile(**{module: source})
    report = pytester.path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore",
                                f"--gpumem-report={report}")
    print(result.stdout.str())
    return result, {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}


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
def test_forked_and_execd_ranks_read_the_same_gpu_figures(pytester, launch_tag, tmp_path):
    """--gpumem-start (issue 20): a rank forked from this pytest holds the same GPU memory as one
    exec'd afresh: the same device figure (CUDA context and tensors) and allocator figure."""
    out = tmp_path / "own"
    out.mkdir()
    body = '''
@pytest.mark.gpumem(nproc=1, device="gpu", env={"OUT": OUT_DIR})
def test_hold():
    block = hold(1024)
    note(own=own_mib())
    del block
'''
    figures = {}
    for start in ("fork", "exec"):
        result, records = _run(pytester, out, body, f"--gpumem-start={start}", "--gpumem-floor=off")
        result.assert_outcomes(passed=1)
        size = _size(records["test_hold"], 1)
        assert size["start"] == start, size["start"]
        figures[start] = (size["gated_mib"], size["allocated_mib"], _own(out, 1, 0)["own"])
        print(f"ranks {start}ed: device {figures[start][0]:.1f} MiB, allocated {figures[start][1]:.2f} MiB, "
              f"the rank's own NVML figure {figures[start][2]:.1f} MiB")
    assert figures["fork"][1] == figures["exec"][1]
    assert abs(figures["fork"][0] - figures["exec"][0]) <= 2.0, figures


@needs_gpu
def test_a_pytest_that_initialised_cuda_execs_its_ranks(pytester, launch_tag, monkeypatch):
    """torch.cuda.is_available() at import (not NVML-based) initialises CUDA in pytest; a forked rank
    could not use CUDA, so the ranks are exec'd and the test runs as before, the record saying why."""
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    pytester.makepyfile(test_driver='''
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.gpumem(nproc=1, device="gpu")
def test_on_gpu():
    x = torch.ones(256 * 2**20 // 4, device="cuda")
    torch.cuda.synchronize()
''')
    report = pytester.path / "driver.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=off",
                                           f"--gpumem-report={report}", timeout=300)
    result.assert_outcomes(passed=1)
    start = json.loads(report.read_text())["tests"][0]["sizes"][0]["start"]
    print(f"pytest with CUDA initialised: {start}")
    assert start.startswith("exec (CUDA is initialised in pytest"), start


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
def test_nccl_job_that_inflates_at_two_ranks_fails_and_a_healthy_one_passes(pytester, launch_tag, tmp_path):
    """The product's promise on real GPUs: 4 GiB of activations per rank at nproc 1 and 2 passes
    ``max_ratio=1.3``; keeping the gathered global batch on every rank (8 GiB more at nproc=2)
    fails it, naming rank 0, nproc=2 and the GPU figure. Each rank's gated figure is its own NVML
    figure at the peak, and the floor (CUDA context + NCCL communicator) is split out. On one GPU
    nproc=2 runs as a simulated world (rank 0 alone, a stand-in communicator): same verdicts."""
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
    # the ratio reads the allocator's figure (the communicator's buffers are no tensors): 4 -> 12 GiB
    result.stdout.fnmatch_lines(
        ["*rank 0 at nproc=2 (gpu, allocated*): peak * MiB > 1.30 x * MiB (nproc=1) + 0 MiB = *"])
    healthy = records["test_healthy"]
    for name, rec in records.items():
        for size in rec["sizes"]:
            ratio = "" if size["ratio"] is None else f", {size['ratio']:.2f}x nproc=1"
            floor = "simulated, no floor" if size["floor"] is None else f"floor {size['floor']['ranks']} " \
                f"({size['floor']['what']})"
            print(f"{name} nproc={size['nproc']}: ranks {size['ranks']} MiB, allocated {size['allocated_mib']} "
                  f"MiB{ratio}; {floor}")
    assert bool(_size(healthy, 2)["simulated"]) == (GPUS < 2)
    for world in (1, 2) if GPUS >= 2 else (1,):
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



# ------------------------------------------------------------------------------------ the allocator figure

# The FSDP job of docs/gpu.md: an 8-layer, 2048-wide TransformerEncoder, Adam, 3 steps. EXTRA_MIB keeps
# one more tensor alive (the regression); SHARDING switches FULL_SHARD to NO_SHARD (declared config).
FSDP = '''
import os
import pytest


def train():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True)
    model = FSDP(torch.nn.TransformerEncoder(layer, 8).cuda(), device_id=torch.cuda.current_device(),
                 sharding_strategy=getattr(ShardingStrategy, os.environ.get("SHARDING", "FULL_SHARD")))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, 2048, device="cuda")
    kept = None
    extra = float(os.environ.get("EXTRA_MIB", "0"))
    if extra:
        kept = torch.empty(int(extra * 2**20), dtype=torch.uint8, device="cuda")  # the regression
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return kept


@pytest.mark.gpumem(nproc=NPROC, device="gpu", config={"sharding": os.environ.get("SHARDING", "FULL_SHARD")})
def test_fsdp():
    train()
'''


def _fsdp_run(pytester: pytest.Pytester, nproc: str, label: str, *args: str, **env: str) -> tuple[Any, dict]:
    pytester.makepyfile(test_fsdp=FSDP.replace("NPROC", nproc))
    report = pytester.path / f"{label}.json"
    for key in ("EXTRA_MIB", "SHARDING"):
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                    "--gpumem-floor=off", *args)
    finally:
        for key in env:
            os.environ.pop(key, None)
    record = json.loads(report.read_text())["tests"][0]
    for size in record["sizes"]:
        alloc = size["allocated_ranks"].get("0") or {}
        print(f"{label}: nproc={size['nproc']} rank 0: device (NVML) {size['gated_mib']:.1f} MiB, "
              f"allocated {alloc.get('allocated_mib', float('nan')):.2f} MiB, "
              f"reserved {alloc.get('reserved_mib') or float('nan'):.2f} MiB -> {record['status']}")
    return result, record


def _fsdp_reruns(pytester: pytest.Pytester, nproc: str) -> dict[str, Any]:
    """Refresh, then 3 reruns at the allocator's tight tolerance; the allocator figure to the MiB."""
    first, base = _fsdp_run(pytester, nproc, "refresh", "--gpumem-refresh")
    first.assert_outcomes(passed=1)
    figures = {s["nproc"]: s["allocated_mib"] for s in base["sizes"]}
    assert all(figures.values()), figures
    for i in range(3):
        rerun, rec = _fsdp_run(pytester, nproc, f"rerun {i + 1}")
        rerun.assert_outcomes(passed=1)
        for size in rec["sizes"]:
            assert round(size["allocated_mib"]) == round(figures[size["nproc"]]), (size, figures)
    return base


@needs_gpu
def test_fsdp_allocator_figure_holds_to_the_mib_and_a_1_percent_tensor_fails_at_one_gpu(pytester, launch_tag):
    """The part of docs/gpu.md's FSDP evidence one GPU can run: nproc=1."""
    base = _fsdp_reruns(pytester, "1")
    one_percent = round(_size(base, 1)["gated_mib"] / 100, 1)  # 1% of what nvidia-smi shows
    grown, rec = _fsdp_run(pytester, "1", f"+{one_percent} MiB tensor", EXTRA_MIB=str(one_percent))
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(
        ["*rank 0 at nproc=1 (gpu, allocated): peak * MiB > baseline * MiB + max(0.5% = *, 16) MiB = *"])
    first = rec["grown_sites"][0]
    print(f"the failure's first site: {first['site']} +{first['new_mib'] - first['old_mib']:.1f} MiB")
    assert first["site"].startswith("test_fsdp.py:") and "train" in first["site"]
    assert abs(first["new_mib"] - first["old_mib"] - one_percent) <= 2.0


@needs_gpu
def test_fsdp_at_1_2_8_holds_and_no_shard_fails_at_2_and_8_naming_the_config(pytester, launch_tag):
    """docs/gpu.md's FSDP evidence at nproc=[1, 2, 8] on the GPUs present: sizes above them run as a
    simulated world (rank 0 alone with a stand-in communicator; its allocator figure is the real one,
    measured equal to real NCCL at 2); refreshed, 3 reruns, +1% fails, NO_SHARD fails at 2 and 8,
    the declared config change listed first."""
    base = _fsdp_reruns(pytester, "[1, 2, 8]")
    assert _size(base, 8)["simulated"] == [0] and bool(_size(base, 2)["simulated"]) == (GPUS < 2)
    one_percent = round(_size(base, 1)["gated_mib"] / 100, 1)
    grown, _ = _fsdp_run(pytester, "[1, 2, 8]", f"+{one_percent} MiB tensor", EXTRA_MIB=str(one_percent))
    grown.assert_outcomes(failed=1)
    grown.stdout.fnmatch_lines(["*(gpu, allocated): peak * MiB > baseline * MiB + max(0.5% = *, 16) MiB = *"])
    switched, rec = _fsdp_run(pytester, "[1, 2, 8]", "NO_SHARD", SHARDING="NO_SHARD")
    switched.assert_outcomes(failed=1)
    assert all(c["ok"] for c in _size(rec, 1)["checks"]), "one rank holds everything either way"
    assert not all(c["ok"] for c in _size(rec, 2)["checks"])
    assert not all(c["ok"] for c in _size(rec, 8)["checks"])
    lines = switched.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert lines[headline + 1] == "  changed since the baseline: config.sharding: FULL_SHARD -> NO_SHARD"


# A DDP job (NCCL) whose inflating twin all-gathers the batch: at [1, 2, 8] on two GPUs the size 8 is
# predicted from 1 and 2, which cannot be validated, so it is shown and never fails.
DDP = '''
import os
import pytest

MiB = 2**20


def train(gather, keep=False):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda())
    x = torch.randn(65536, 4096, device="cuda")  # 1 GiB of batch per rank
    kept = x.clone() if keep else None  # the regression at one GPU: a copy of the batch kept alive
    if gather:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]  # the bug: every rank's batch
        dist.all_gather(parts, x)
        x = torch.cat(parts)
    for _ in range(3):
        model(x).sum().backward()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return kept


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.05, allow_mib=900)
def test_ddp():
    train(False)


@pytest.mark.gpumem(nproc=1, device="gpu")
def test_ddp_one_gpu():
    kept = train(False, keep=os.environ.get("KEEP_COPY") == "1")


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.05, allow_mib=900)
def test_ddp_inflating():
    train(True)
'''


@needs_gpu
def test_ddp_at_1_2_8_passes_and_its_inflating_twin_fails_at_2_and_8_naming_the_line(pytester, launch_tag):
    """DDP at [1, 2, 8] on the GPUs present, the sizes above them a simulated world: the healthy job
    passes everywhere; its twin, gathering every rank's batch, fails at 2 and 8 on the allocator's
    ratio, and the failure names the line of the gathered batch."""
    pytester.makepyfile(test_ddp=DDP)
    report = pytester.path / "ddp.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                "-k", "not one_gpu", "-W", "default")
    print(result.stdout.str()[-4000:])
    result.assert_outcomes(passed=1, failed=1)
    records = {r["test"].split("::")[-1]: r for r in json.loads(report.read_text())["tests"]}
    for name, rec in records.items():
        for size in rec["sizes"]:
            print(f"{name} nproc={size['nproc']}{' simulated' if size['simulated'] else ''}: rank 0 device "
                  f"{size['gated_mib']:.1f} MiB, allocated {size['allocated_mib']:.2f} MiB")
    healthy8 = _size(records["test_ddp"], 8)
    assert healthy8["simulated"] == [0] and all(c["ok"] for c in healthy8["checks"])
    for n in (2, 8):
        failing = [c for c in _size(records["test_ddp_inflating"], n)["checks"] if not c["ok"]]
        assert failing and failing[0]["kind"] == "max_ratio" and failing[0]["figure"] == "allocated", failing
    first = records["test_ddp_inflating"]["grown_sites"][0]
    gather = [i for i, text in enumerate(DDP.splitlines()) if "dist.all_gather(parts, x)" in text
              or "torch.cat(parts)" in text or "parts = [" in text]
    print(f"the twin's first grown site: {first}")
    assert first["site"].startswith("test_ddp.py:") and int(first["site"].split(":")[1].split()[0]) in gather


@needs_gpu
def test_ddp_at_one_gpu_a_kept_copy_of_the_batch_fails_naming_its_line(pytester, launch_tag):
    """What one GPU can run of the DDP sites: a baseline, then the same job keeping a copy of its
    1 GiB batch: the allocator figure fails and the first site is the line of the copy."""
    pytester.makepyfile(test_ddp=DDP)
    args = ("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=off", "test_ddp.py::test_ddp_one_gpu")
    pytester.runpytest(*args, "--gpumem-refresh").assert_outcomes(passed=1)
    report = pytester.path / "kept.json"
    os.environ["KEEP_COPY"] = "1"
    try:
        result = pytester.runpytest(*args, f"--gpumem-report={report}")
    finally:
        del os.environ["KEEP_COPY"]
    result.assert_outcomes(failed=1)
    record = json.loads(report.read_text())["tests"][0]
    first = record["grown_sites"][0]
    print(f"DDP, one GPU, a kept copy of the batch: first site {first['site']} "
          f"+{first['new_mib'] - first['old_mib']:.1f} MiB; device {_size(record, 1)['gated_mib']:.1f} MiB, "
          f"allocated {_size(record, 1)['allocated_mib']:.1f} MiB")
    line = next(i for i, text in enumerate(DDP.splitlines()) if "kept = x.clone()" in text)  # 1-based after strip
    assert first["site"].startswith(f"test_ddp.py:{line} train"), first
    assert abs(first["new_mib"] - first["old_mib"] - 1024.0) <= 2.0


# A TP=2 job on a (dp, tp) mesh with NCCL (ColwiseParallel/RowwiseParallel on "tp", fully_shard on
# "dp"): its smallest world is 2, so its ratio is taken against nproc=2 (reference=2); its twin
# all-gathers every dp rank's 512 MiB activation.
TP = '''
import os
import pytest

MiB = 2**20


def tp_job(gather_over_dp):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                         "2": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(net, mesh=mesh["dp"])
    local = torch.ones(512 * MiB // 4, device="cuda")
    kept = []
    if gather_over_dp:  # the regression: every dp rank keeps every dp rank's activation
        kept = [torch.empty_like(local) for _ in range(mesh["dp"].size())]
        dist.all_gather(kept, local, group=mesh["dp"].get_group())
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(3):
        net(torch.ones(1024, 4096, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return kept


@pytest.mark.gpumem(nproc=[2, 8], device="gpu", max_ratio=1.1, reference=2)
def test_tp():
    tp_job(False)


@pytest.mark.gpumem(nproc=[2, 8], device="gpu", max_ratio=1.1, reference=2)
def test_tp_gathers_over_dp():
    tp_job(True)
'''


@needs_gpu
def test_a_tp2_job_is_gated_2_to_8_against_its_reference_and_its_gathering_twin_fails(pytester, launch_tag):
    """TP=2 at nproc=[2, 8], reference=2, on the GPUs present (sizes above them a simulated world):
    no nproc=1 is launched, the healthy job passes and its twin, gathering over dp, fails at 8."""
    pytester.makepyfile(test_tp=TP)
    report = pytester.path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "warn",
                                f"--gpumem-report={report}")
    print(result.stdout.str())
    records = {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}
    for name, rec in records.items():
        assert [s["nproc"] for s in rec["sizes"]] == [2, 8], name
        for size in rec["sizes"]:
            print(f"{name} nproc={size['nproc']}: {size['gated_mib']} MiB device, "
                  f"allocated {size['allocated_mib']}, ratio {size['ratio']}, simulated {size['simulated']}")
    result.assert_outcomes(passed=1, failed=1)
    healthy, twin = _size(records["test_tp"], 8), _size(records["test_tp_gathers_over_dp"], 8)
    assert healthy["ratio"] <= 1.1 < twin["ratio"]
    result.stdout.fnmatch_lines(["*1.10 x * MiB (nproc=2) + 0 MiB = * MiB (ratio *x)*"])


# rank="all" at world 8 of a job whose ranks each hold more than an eighth of the GPU (and rank r
# holds r GiB more than rank 0): the eight simulated ranks do not fit on one GPU together.
ALL_RANKS = '''
import os
import pytest

GiB = 2**30


def hold():
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    _, total = torch.cuda.mem_get_info()
    block = torch.empty(total // 8 + dist.get_rank() * GiB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=8, device="gpu", rank="all", max_mib=1e6)
def test_all_ranks():
    hold()
'''


@needs_gpu
def test_rank_all_at_8_of_ranks_that_do_not_fit_together_runs_them_in_turn_and_names_the_largest(pytester,
                                                                                                 launch_tag):
    """Every simulated rank of world 8 measured, each alone, as many at a time as there are GPUs: the
    largest (rank 7, 7 GiB above rank 0) gates, each rank's figure is in the record, the cost in a note."""
    if GPUS >= 8:
        pytest.skip("eight GPUs launch world 8 for real; this is the one-GPU path")
    pytester.makepyfile(test_all=ALL_RANKS)
    report = pytester.path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "warn",
                                f"--gpumem-report={report}", "-rA")
    print(result.stdout.str())
    result.assert_outcomes(passed=1)
    size = _size(json.loads(report.read_text())["tests"][0], 8)
    allocated = {int(r): a["allocated_mib"] for r, a in size["allocated_ranks"].items()}
    print("allocated MiB per rank:", allocated, "gated:", size["gated_label"], size["gated_mib"])
    assert size["simulated"] == list(range(8)) and sorted(allocated) == list(range(8))
    assert size["gated_label"] == "rank 7 (largest)"
    steps = [allocated[r + 1] - allocated[r] for r in range(7)]
    assert all(abs(step - 1024) <= 1 for step in steps), steps  # each rank's own figure, measured alone
    assert any(f"its 8 simulated ranks ran {GPUS} at a time" in note for note in
               json.loads(report.read_text())["tests"][0]["notes"])


# A pipeline (tests/jobs.py TORCH_PP: 8 layers over the world's stages, 32 microbatches of 16 MiB a
# layer): 1F1B keeps at most a world's worth of microbatches in flight, GPipe all 32 and the gradients
# it sends back (864 MiB and more above 1F1B at 8 on every stage but the last, measured on one H100),
# and the regression keeps every microbatch's output (384 MiB and more there). STAGES picks the
# schedule of one test id, so each runs against 1F1B's baseline.
PIPELINE = '''
@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", rank="all")
def test_stages():
    schedule = os.environ.get("STAGES", "1f1b")
    pp_job("gpipe" if schedule == "gpipe" else "1f1b", keep_outputs=schedule == "keep")
'''


@needs_gpu
def test_pipeline_stages_at_1_2_8_find_the_largest_rank_and_each_stage_is_held_to_its_baseline(
        pytester, launch_tag, monkeypatch):
    """torch.distributed.pipelining (PipelineStage, Schedule1F1B, ScheduleGPipe) on NCCL, nproc=1 real,
    2 and 8 a simulated world, every rank measured alone. The stages are not alike, and the largest is
    the one measured largest (not rank 0: the last stage holds the targets besides its receive
    buffers). 1F1B's baseline refreshed, GPipe and the job keeping its outputs fail it at 8 too, where
    they grow the middle stages and not the largest: each rank is held to its own stored figure, and
    the kept outputs' failure leads with the line that allocates them."""
    from jobs import TORCH_PP

    pytester.makepyfile(test_pp=TORCH_PP + PIPELINE)

    def run(schedule: str, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
        monkeypatch.setenv("STAGES", schedule)
        report = pytester.path / f"{schedule}.json"
        result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}", *args)
        print(result.stdout.str())
        record = json.loads(report.read_text())["tests"][0]
        for size in record["sizes"]:
            ranks = {int(r): round(a["allocated_mib"], 2) for r, a in size["allocated_ranks"].items()}
            print(f"{schedule} nproc={size['nproc']} {size['gated_label']}: allocated per rank {ranks}, "
                  f"simulated {size['simulated']}")
        return result, record

    result, healthy = run("1f1b", "--gpumem-refresh")
    result.assert_outcomes(passed=1)
    assert _size(healthy, 1)["simulated"] == [] and _size(healthy, 8)["simulated"] == list(range(8))
    for n in (2, 8):
        ranks = {int(r): a["allocated_mib"] for r, a in _size(healthy, n)["allocated_ranks"].items()}
        largest = max(ranks, key=ranks.__getitem__)
        assert _size(healthy, n)["gated_label"] == f"rank {largest} (largest)"
        assert _size(healthy, n)["allocated_mib"] == ranks[largest] > min(ranks.values()) + 256  # not alike
    healthy_8 = {int(r): a["allocated_mib"] for r, a in _size(healthy, 8)["allocated_ranks"].items()}
    kept = next(n for n, text in enumerate(TORCH_PP.lstrip("\n").splitlines(), 1) if "y = self.linear(x)" in text)
    for schedule in ("gpipe", "keep"):
        result, record = run(schedule)
        result.assert_outcomes(failed=1)
        grown = {int(r): a["allocated_mib"] - healthy_8[int(r)] for r, a in _size(record, 8)["allocated_ranks"].items()}
        failed = {c["text"].split(" at nproc=")[0] for c in _size(record, 8)["checks"] if not c["ok"]}
        print(f"{schedule} at 8, growth per rank over 1F1B (MiB): {grown}; failed: {sorted(failed)}")
        assert all(grown[r] >= 300 for r in range(1, 7)), (schedule, grown)  # the middle stages grow...
        assert {f"rank {r}" for r in range(1, 7)} <= failed  # ...and each fails at its own figure
        if schedule == "keep":
            lines = result.stdout.lines
            headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
            # the headline's size is the one furthest over its limit: nproc=1 here, where one stage keeps them all
            assert re.fullmatch(r"  peak sites of rank \d at nproc=\d that grew since its baseline:",
                                lines[headline + 1]), lines[headline:headline + 3]
            assert f"test_pp.py:{kept} forward" in lines[headline + 2], lines[headline:headline + 3]


# Context parallel (tests/jobs.py TORCH_CP): the sequence sharded over the world, so rank 0's allocator
# figure falls with N; the twin leaves the input out of context_parallel's buffers.
CP_TESTS = '''
@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.1)
def test_cp():
    cp_job()


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.1)
def test_cp_unsharded():
    cp_job(shard=False)
'''


@needs_gpu
def test_context_parallel_shards_the_sequence_and_an_unsharded_input_fails_its_ratio(pytester, launch_tag):
    """Ring attention over a sharded sequence at nproc=1 real, 2 and 8 simulated: rank 0's allocator
    figure falls with the world; an input left out of context_parallel's buffers (every rank holds the
    whole sequence and gathers every rank's keys and values) fails max_ratio. Its growth is allocated
    where the stacks hold no frame of the job: the failure sums it as framework internals and names no
    line (measured: +1216 MiB at 8, benchmarks/results/gpu_context_parallel.txt)."""
    from jobs import TORCH_CP

    result, records = _run_job(pytester, "test_cp", TORCH_CP + CP_TESTS)
    for name, rec in records.items():
        for size in rec["sizes"]:
            print(f"{name} nproc={size['nproc']}: allocated {size['allocated_mib']} MiB, ratio {size['ratio']}, "
                  f"simulated {size['simulated']}")
    assert {name: rec["status"] for name, rec in records.items()} == {"test_cp": "passed",
                                                                      "test_cp_unsharded": "failed"}
    healthy, unsharded = records["test_cp"], records["test_cp_unsharded"]
    assert _size(healthy, 8)["simulated"] == [0] and not _size(healthy, 1)["simulated"]
    assert _size(healthy, 8)["allocated_mib"] < _size(healthy, 2)["allocated_mib"] < _size(healthy, 1)["allocated_mib"]
    assert _size(unsharded, 8)["ratio"] > _size(unsharded, 2)["ratio"] > 1.1
    print(f"the twin's sites: {unsharded['grown_sites']} ({unsharded['sites_summary']})")
    assert "framework internals" in unsharded["sites_summary"]


# A mixture-of-experts layer (tests/jobs.py TORCH_MOE: the token counts through all_to_all_single,
# then .tolist() as split sizes), 256 MiB of tokens a rank.
MOE_TESTS = '''
@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.1, assume="alike")
def test_balanced():
    moe_job("balanced")


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.1, assume="alike")
def test_collapsed():
    moe_job("collapsed")


@pytest.mark.gpumem(nproc=[1, 2], device="gpu")
def test_unassumed():
    moe_job("balanced")
'''


@needs_gpu
def test_expert_routing_under_the_alike_assumption_passes_balanced_and_fails_collapsed(pytester, launch_tag):
    """nproc=1 real, 2 and 8 simulated: balanced routing holds its ratio, a router sending every token
    to expert 0 fails it; without assume= the simulated rank stops at the line reading the counts."""
    from jobs import TORCH_MOE, moe_expert_lines

    result, records = _run_job(pytester, "test_moe", TORCH_MOE + MOE_TESTS)
    for name, rec in records.items():
        for size in rec["sizes"]:
            print(f"{name} nproc={size['nproc']}: allocated {size['allocated_mib']} MiB, ratio {size['ratio']}, "
                  f"simulated {size['simulated']}")
    assert {name: rec["status"] for name, rec in records.items()} == {
        "test_balanced": "passed", "test_collapsed": "failed", "test_unassumed": "failed"}
    assert _size(records["test_collapsed"], 2)["ratio"] > 1.1 >= _size(records["test_balanced"], 8)["ratio"]
    result.stdout.fnmatch_lines(["*tolist() at test_moe.py:* reads values that other ranks send*"])
    first = records["test_collapsed"]["grown_sites"][0]
    print(f"collapsed routing: first grown site {first['site']} +{first['new_mib'] - first['old_mib']:.1f} MiB "
          f"since {records['test_collapsed']['grown_against']}")
    assert first["site"].split()[0] in moe_expert_lines(), first



# DeepSpeed ZeRO (tests/jobs.py TORCH_ZERO, 128 MiB of weights; ZERO_STAGE picks the stage). The
# simulated ranks under assume="alike": ZeRO-3 broadcasts rank 0's parameter lists and reads them
# back, to check that the ranks agree.
ZERO_TESTS = '''
@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", assume="alike", config={"zero_stage": STAGE})
def test_zero():
    zero_job()
'''


@needs_gpu
def test_deepspeed_zero3_to_zero1_fails_its_baseline_at_8_naming_the_config_change(pytester, launch_tag, monkeypatch):
    """nproc=1 real, 2 and 8 simulated: ZeRO-3's allocator figure falls with the world; ZeRO-1 keeps
    the whole model and its gradients on every rank and fails ZeRO-3's baseline at 8."""
    needs_framework("deepspeed")
    from jobs import TORCH_ZERO

    pytester.makepyfile(test_zero=TORCH_ZERO + ZERO_TESTS)

    def run(stage: str, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
        monkeypatch.setenv("ZERO_STAGE", stage)
        report = pytester.path / f"zero{stage}.json"
        result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                               *args, timeout=900)
        print(result.stdout.str())
        record = json.loads(report.read_text())["tests"][0]
        print(f"ZeRO-{stage}:", record["status"], [(s["nproc"], s["allocated_mib"], s["simulated"])
                                                   for s in record["sizes"]])
        return result, record

    first, zero3 = run("3", "--gpumem-refresh")
    first.assert_outcomes(passed=1)
    assert _size(zero3, 8)["allocated_mib"] < _size(zero3, 2)["allocated_mib"] < _size(zero3, 1)["allocated_mib"]
    switched, zero1 = run("1")
    switched.assert_outcomes(failed=1)
    failed = [s["nproc"] for s in zero1["sizes"] if any(not c["ok"] for c in s["checks"])]
    assert 8 in failed and 1 not in failed, failed  # at 1 ZeRO-1 holds less: no partitioning bookkeeping
    lines = switched.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert lines[headline + 1].endswith("config.zero_stage: 3 -> 1"), lines[headline:headline + 2]



# torchtitan's Llama 3 (tests/jobs.py TORCH_TITAN, 0.54 B parameters, bf16 FSDP2 x TP=2): gated 2 -> 8
# against reference=2, both simulated on one GPU; torchtitan's FSDP2 alone (tp=1) real at nproc=1.
TITAN_TESTS = '''
@pytest.mark.gpumem(nproc=[2, 8], device="gpu", reference=2, max_ratio=1.0,
                    config={"loss_parallel": LOSS_PARALLEL})
def test_titan_tp2():
    titan_job()


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.0)
def test_titan_fsdp():
    titan_job(tp=1)
'''


@needs_gpu
def test_torchtitan_fsdp2_tp2_holds_2_to_8_and_replicated_logits_fail_its_baseline_naming_the_flag(
        pytester, launch_tag, monkeypatch):
    """FSDP2 x TP: dp 1 -> 4 shards the parameters, gradients and optimizer state, so rank 0's allocator
    figure falls 2 -> 8 and no nproc=1 is launched. parallelism.disable_loss_parallel replicates the
    logits (batch x seq x vocab) on both TP ranks: it fails the baseline at 2 and 8, the headline naming
    the config change."""
    needs_framework("torchtitan")
    from jobs import TORCH_TITAN

    pytester.makepyfile(test_titan=TORCH_TITAN + TITAN_TESTS)

    def run(loss_parallel: str, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
        monkeypatch.setenv("TITAN_LOSS_PARALLEL", loss_parallel)
        report = pytester.path / f"titan{loss_parallel}.json"
        result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                               *args, timeout=900)
        print(result.stdout.str())
        records = {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}
        for name, rec in records.items():
            print(name, rec["status"], [(s["nproc"], s["gated_mib"], s["allocated_mib"], s["ratio"], s["simulated"])
                                        for s in rec["sizes"]])
        return result, records

    first, healthy = run("1", "--gpumem-refresh")
    first.assert_outcomes(passed=2)
    tp2, fsdp = healthy["test_titan_tp2"], healthy["test_titan_fsdp"]
    assert [s["nproc"] for s in tp2["sizes"]] == [2, 8]  # no nproc=1 launch
    assert _size(tp2, 8)["allocated_mib"] < _size(tp2, 2)["allocated_mib"]
    assert not _size(fsdp, 1)["simulated"] and _size(fsdp, 8)["simulated"]
    assert _size(fsdp, 8)["allocated_mib"] < _size(fsdp, 2)["allocated_mib"] < _size(fsdp, 1)["allocated_mib"]
    replicated, twin = run("0", "-k", "tp2")
    replicated.assert_outcomes(failed=1)
    failed = [s["nproc"] for s in twin["test_titan_tp2"]["sizes"] if any(not c["ok"] for c in s["checks"])]
    assert failed == [2, 8], failed
    lines = replicated.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert lines[headline + 1].endswith("config.loss_parallel: True -> False"), lines[headline:headline + 2]


# Megatron-Core GPT at TP=2 x PP=2 (tests/jobs.py TORCH_MEGATRON): world 4 is one model, 8 two
# replicas, both simulated on one GPU, every rank measured in turn (rank="all"), the ratio against
# reference=4: nothing smaller is launched.
MEGATRON_TESTS = '''
@pytest.mark.gpumem(nproc=[4, 8], device="gpu", rank="all", reference=4, max_ratio=1.05)
def test_megatron():
    megatron_job()


@pytest.mark.gpumem(nproc=[4, 8], device="gpu", rank="all", reference=4, max_ratio=1.05)
def test_megatron_gathering_grads():
    megatron_job(gather=True)
'''


@needs_gpu
def test_megatron_tp2_pp2_holds_its_ratio_from_4_to_8_and_a_gradient_gather_over_dp_fails_it(pytester, launch_tag):
    """The largest rank is found, not assumed: the first pipeline stage (embedding, more microbatches
    in flight under 1F1B). Healthy, its allocator figure is the same at 4 and 8 (dp 1 -> 2 shards
    nothing here: no distributed optimizer); keeping every dp rank's gradients grows it (1.07x)."""
    needs_framework("megatron.core")
    from jobs import TORCH_MEGATRON

    result, records = _run_job(pytester, "test_megatron", TORCH_MEGATRON + MEGATRON_TESTS)
    for name, rec in records.items():
        for size in rec["sizes"]:
            print(f"{name} nproc={size['nproc']}: {size['gated_label']}, allocated {size['allocated_mib']} MiB, "
                  f"ratio {size['ratio']}, simulated {size['simulated']}, every rank (allocated) "
                  f"{ {r: a['allocated_mib'] for r, a in size['allocated_ranks'].items()} }")
    assert {name: rec["status"] for name, rec in records.items()} == {
        "test_megatron": "passed", "test_megatron_gathering_grads": "failed"}
    healthy, gathering = records["test_megatron"], records["test_megatron_gathering_grads"]
    assert [s["nproc"] for s in healthy["sizes"]] == [4, 8]  # no nproc=1 launch
    assert all(s["simulated"] == list(range(s["nproc"])) for s in healthy["sizes"])
    top = _size(healthy, 8)
    largest = max(top["allocated_ranks"].items(), key=lambda item: item[1]["allocated_mib"])
    first_stage = {str(r) for r in range(4)}  # Megatron's order tp-dp-pp: ranks 0-3 are stage 0 at 8
    assert largest[0] in first_stage and top["gated_rank"] in {int(r) for r in first_stage}, top["gated_label"]
    assert _size(healthy, 8)["ratio"] <= 1.05 < _size(gathering, 8)["ratio"]
    result.stdout.fnmatch_lines(["*rank * (largest) at nproc=8 *: peak * MiB > 1.05 x * MiB (nproc=4)*"])
    # The line that grew, between the largest rank at 8 and the reference's largest at 4.
    result.stdout.fnmatch_lines([
        "*peak sites of rank * (largest) at nproc=8 that grew since rank * (largest) at nproc=4:*",
        "*MiB  test_megatron.py:* megatron_job*"])
    assert "(__torch_function__)" not in result.stdout.str()  # the stand-in's mode is not the call



# The same GPT data parallel only (TP=1, PP=1): nproc=1 real, 2 and 8 simulated, for the table of real and
# simulated figures (benchmarks/results/gpu_megatron.txt); the job reduces no gradients (no DDP wrapper), so
# its allocator figure is the same at each size.
MEGATRON_DP = '''
@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu", max_ratio=1.05)
def test_megatron_dp():
    megatron_job(tp=1, pp=1)
'''


@needs_gpu
def test_megatron_data_parallel_runs_real_at_1_and_simulated_at_2_and_8_within_its_ratio(pytester, launch_tag):
    needs_framework("megatron.core")
    from jobs import TORCH_MEGATRON

    result, records = _run_job(pytester, "test_megatron_dp", TORCH_MEGATRON + MEGATRON_DP)
    rec = records["test_megatron_dp"]
    for size in rec["sizes"]:
        print(f"megatron dp nproc={size['nproc']}: device {size['gated_mib']} MiB, allocated "
              f"{size['allocated_mib']} MiB, ratio {size['ratio']}, simulated {size['simulated']}")
    assert rec["status"] == "passed", rec["messages"]
    assert not _size(rec, 1)["simulated"] and _size(rec, 2)["simulated"] and _size(rec, 8)["simulated"]


# Ranks of more than an eighth of the GPU each: world 8 does not fit on it at once, so its simulated
# ranks run one after another, each measured alone (24 layers, hidden 4096: 1.2 B parameters a rank).
MEGATRON_LARGE = '''
@pytest.mark.gpumem(nproc=8, device="gpu", rank="all", timeout=900)
def test_megatron_large():
    megatron_job(layers=24, hidden=4096, heads=32, steps=1)
'''


@needs_gpu
def test_megatron_rank_all_at_8_measures_ranks_over_an_eighth_of_the_gpu_one_at_a_time(pytester, launch_tag):
    """Issue 35: rank="all" at world 8 of a job whose every rank takes over 1/8 of the GPU runs on one
    GPU (eight launches, one after another) and names the largest rank, a first-stage one."""
    needs_framework("megatron.core")
    import torch
    from jobs import TORCH_MEGATRON

    total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
    result, records = _run_job(pytester, "test_megatron_large", TORCH_MEGATRON + MEGATRON_LARGE)
    rec = records["test_megatron_large"]
    size = _size(rec, 8)
    device = {int(r): mib for r, mib in size["ranks"].items()}
    allocated = {int(r): a["allocated_mib"] for r, a in size["allocated_ranks"].items()}
    print(f"GPU {total_mib:.0f} MiB, an eighth {total_mib / 8:.0f}; {size['gated_label']}; device {device}; "
          f"allocated {allocated}; duration {size['duration_s']} s; notes {rec['notes']}")
    assert rec["status"] == "passed", rec["messages"]
    assert size["simulated"] == list(range(8)) and sorted(device) == list(range(8))
    assert min(device.values()) > total_mib / 8 and sum(device.values()) > total_mib  # not at once
    assert size["gated_rank"] in range(4) and size["gated_label"] == f"rank {size['gated_rank']} (largest)"
    assert device[size["gated_rank"]] == max(device.values())


@needs_gpu
def test_gpumem_calibrate_measures_each_part_outside_the_allocator(tmp_path):
    """The parts a fake GPU adds to its reserved peak to predict the device figure (issue 66), measured
    here: the context at least the hundreds of MiB every CUDA process holds, each library's part >= 0."""
    import subprocess
    import sys

    from pytest_gpumem.rankside.fakegpu.models import OUTSIDE, read_calibration

    out = tmp_path / "gpumem-calibration.json"
    done = subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "calibrate", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (model,) = read_calibration(out).values()
    assert set(model.outside) == set(OUTSIDE), model.outside
    assert model.outside["context"] >= 100 * 2**20 and min(model.outside.values()) >= 0, model.outside
