"""The fake GPU on the code teams write (issue 54): the coverage matrix of a training loop's idioms,
and a figure the job's own allocator calls cannot corrupt.

The matrix (``tests/idioms.py``) runs every idiom in one fresh interpreter on a fake GPU and compares
each with the real GPU's figure committed in ``benchmarks/results/fake_gpu_idioms_gpu.json`` (the
command that made it is in ``fake_gpu_idioms.txt`` beside it). Every idiom must run; each must read
within ``GOAL`` of the GPU, except the ones listed in ``APART`` with the reason measured, which
docs/fake-gpu.md lists too. What the fake GPU supplied (values read, sizes assumed, compiled code
run eagerly) is listed with the job's line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # no CUDA initialised in this pytest
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GPU_FIGURES = RESULTS / "fake_gpu_idioms_gpu.json"
CALIBRATION = RESULTS / "fake_gpu_idioms_calibration.json"
GOAL = 0.01  # each idiom's fake figure within 1% of the GPU's (or 0.1 MiB, for the tiny ones)
# Idioms whose fake figure is not the GPU's, with what was measured (fake_gpu_idioms.txt; docs/fake-gpu.md,
# "What it cannot see"). One that comes within the goal fails the test, so that the list stays true.
APART: dict[str, str] = {
    "conv1d": "cuDNN's convolution workspace", "conv3d": "cuDNN's convolution workspace",
    "lstm": "cuDNN's fused RNN on the GPU, the per-step cell here", "gru": "the same", "rnn_tanh": "the same",
    "unique_and_sort": "the CUDA sort's scratch",
    "sdpa_with_mask_fp32": "memory-efficient attention's fp32 backward buffers",
    "flex_attention": "compiled kernels on the GPU",
    "lbfgs": "its line search on loss values, supplied as 0", "boolean_mask_select": "a mask taken as all True",
    "embedding_bag": "a kernel's scratch", "sync_batch_norm_ddp": "a kernel's scratch",
    "ema_copy": "a temporary (not identified)",
}
on_fake = pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU here: the fake GPU is for machines without")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    gpu = json.loads(GPU_FIGURES.read_text())
    out = tmp_path_factory.mktemp("idioms") / "fake.json"
    command = [sys.executable, str(ROOT / "tests" / "idioms.py"), "--out", str(out), "--model", gpu["device"]]
    if CALIBRATION.exists():
        command += ["--calibration", str(CALIBRATION)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"gpu": gpu, "fake": json.loads(out.read_text())}


@on_fake
def test_at_least_40_idioms_each_run_on_the_fake_gpu(matrix: dict[str, Any]) -> None:
    fake = matrix["fake"]["idioms"]
    stopped = {name: figure["error"] for name, figure in fake.items() if "error" in figure}
    assert len(fake) >= 40
    assert stopped == {}


@on_fake
def test_each_idiom_reads_the_gpus_figure(matrix: dict[str, Any]) -> None:
    gpu, fake = matrix["gpu"]["idioms"], matrix["fake"]["idioms"]
    assert set(gpu) == set(fake), "the GPU figures are those of another idioms.py: rerun it on the GPU"
    rows, off, now_near = [], {}, []
    for name in gpu:
        real, mine = gpu[name]["mib"], fake[name]["mib"]
        rows.append(f"{name:40s} gpu {real:9.2f}  fake {mine:9.2f}  {mine - real:+8.2f} MiB")
        near = abs(mine - real) <= max(GOAL * real, 0.1)
        if not near and name not in APART:
            off[name] = (real, mine)
        if near and name in APART:
            now_near.append(name)
    print("\n".join(rows))
    assert off == {}
    assert now_near == [], "within the goal now: take them out of APART and fake_gpu_idioms.txt's list"


@on_fake
def test_what_the_fake_gpu_supplied_is_listed_with_the_jobs_line(matrix: dict[str, Any]) -> None:
    supplied = matrix["fake"]["supplied"]
    assert any(s.startswith("routing: topk over 8 balanced") and "idioms.py:" in s and "moe_topk_router" in s
               for s in supplied)
    assert any(s.startswith("value: _local_scalar_dense read 0.0") and "loss_item_for_logging" in s for s in supplied)
    assert any(s.startswith("compile: torch.compile(Sequential) ran eagerly (the figure is the eager job's; on a "
                            "GPT-like stack it read 0.43% above the GPU's Inductor run") for s in supplied)
    assert any(s.startswith("size: nonzero of values unknown") and "boolean_mask_select" in s for s in supplied)
    # Known values are no assumption: the routing's masks, counts and split sizes are read from them.
    assert not any("moe_topk_router" in s for s in supplied if not s.startswith("routing:"))
    assert not any("all_to_all_split_sizes" in s for s in supplied)


RESETS = '''
import os

import pytest
import torch

MiB = 2**20


@pytest.mark.gpumem(nproc=1, device="gpu")
def test_job():
    torch.cuda.set_device(0)
    spike = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # the body's peak, early
    del spike
    weights = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    for _ in range(3):
        (weights @ weights).sum().backward()
        if os.environ.get("RESETS") == "1":  # a memory monitor's calls, each log step
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_max_memory_allocated()
            torch.cuda.empty_cache()
            torch.cuda.memory_stats()
            torch.cuda.mem_get_info()
            torch.cuda.set_per_process_memory_fraction(0.95)
            assert torch.cuda.max_memory_allocated() < 256 * MiB  # the job reads its own reset
'''


def _allocated(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, resets: str) -> float:
    monkeypatch.setenv("RESETS", resets)
    monkeypatch.delenv("CI", raising=False)
    report = pytester.path / f"resets{resets}.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                           timeout=600)
    result.assert_outcomes(passed=1)
    size = json.loads(report.read_text())["tests"][0]["sizes"][0]
    return float(size["allocated_mib"])


def test_a_job_that_resets_the_allocators_peak_reads_the_same_as_without(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake GPU here, on a real one where there is one (tests/test_gpu.py runs it there)."""
    pytester.makepyfile(test_resets=RESETS)
    plain = _allocated(pytester, monkeypatch, "0")
    resetting = _allocated(pytester, monkeypatch, "1")
    assert plain >= 256
    assert resetting == pytest.approx(plain, abs=0.01)


SUPPLIED = '''
import pytest
import torch


@pytest.mark.gpumem(nproc=1, device="gpu", max_mib=1)
def test_router():
    torch.cuda.set_device(0)
    hidden = torch.randn(4096, 1024, device="cuda")  # computed values: a fake GPU has none
    scores = torch.nn.Linear(1024, 8).cuda()(hidden)
    weights, chosen = torch.topk(scores.softmax(-1), 2, dim=-1)
    counts = torch.bincount(chosen.flatten(), minlength=8).tolist()  # known: from the routing assumed
    assert counts == [1024] * 8
    loss = (weights.sum() * 0).pow(2)
    print(f"loss {loss.item():.3f}")  # supplied: 0.0
'''


@on_fake
def test_what_was_supplied_reaches_every_output(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A router and a logged loss on a fake GPU: the failure text, the table, JSON, JUnit and the
    Markdown summary each say what the figure assumed, with the job's line."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_supplied=SUPPLIED)
    report, summary, junit = (pytester.path / name for name in ("r.json", "summary.md", "junit.xml"))
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                           f"--gpumem-markdown={summary}", f"--junitxml={junit}", timeout=600)
    result.assert_outcomes(failed=1)
    lines = pytester.path.joinpath("test_supplied.py").read_text().splitlines()
    topk, item = (1 + next(i for i, line in enumerate(lines) if call in line) for call in ("torch.topk", ".item()"))
    routing = f"routing: topk over 8 balanced (row t picks (t*k+j) mod 8) at test_supplied.py:{topk} test_router"
    value = f"value: _local_scalar_dense read 0.0 at test_supplied.py:{item} test_router"
    text = result.stdout.str()
    assert "the fake GPU supplied what fake tensors do not have" in text and routing in text and value in text
    assert "values assumed" in text  # the table's mark
    size = json.loads(report.read_text())["tests"][0]["sizes"][0]
    assert size["supplied"] == [routing, value]
    assert routing in summary.read_text() and value in summary.read_text()
    assert "gpumem_nproc1_fake_gpu_supplied" in junit.read_text() and routing in junit.read_text()


# Each idiom as rank 0 and rank 1 of a world of 2 (simulated: this rank with a stand-in group), where the
# paths that exist only above world 1 run: SyncBatchNorm's statistics gathering, DDP's buckets, FSDP's
# shards. The GPU's figures of the same: benchmarks/results/fake_gpu_idioms_gpu_w2_r{rank}.json (a real GPU
# with the same stand-in group).
APART_AT_RANK_1 = {
    "object_collectives": "it asserts what rank 0 broadcast: a simulated rank 1 has no rank 0's objects "
                          "(simulate.py says so by name), on a GPU too",
}


# Not compared at a world of 2: its split sizes come from torch.randint over 2 ranks, drawn afresh in each run
# on the GPU and here (one run read -1.03% at rank 1, another within 1%).
RANDOM_AT_WORLD_2 = {"all_to_all_split_sizes": "split sizes drawn at random, run to run"}


@pytest.fixture(scope="module", params=[0, 1], ids=["rank0of2", "rank1of2"])
def world_of_2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rank = request.param
    out = tmp_path_factory.mktemp("idioms2") / f"rank{rank}.json"
    real = json.loads((RESULTS / f"fake_gpu_idioms_gpu_w2_r{rank}.json").read_text())
    command = [sys.executable, str(ROOT / "tests" / "idioms.py"), "--world", "2", "--rank", str(rank),
               "--out", str(out), "--model", real["device"], "--calibration", str(CALIBRATION)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"rank": rank, "fake": json.loads(out.read_text()), "gpu": real}


@on_fake
def test_every_idiom_runs_as_rank_0_and_rank_1_of_a_world_of_2(world_of_2: dict[str, Any]) -> None:
    fake = world_of_2["fake"]
    assert (fake["world"], fake["rank"]) == (2, world_of_2["rank"])
    stopped = {name: figure["error"] for name, figure in fake["idioms"].items() if "error" in figure}
    expected = set(APART_AT_RANK_1) if world_of_2["rank"] == 1 else set()
    assert set(stopped) == expected, stopped
    assert len(fake["idioms"]) >= 40


@on_fake
def test_at_a_world_of_2_each_idiom_reads_the_gpus_figure(world_of_2: dict[str, Any]) -> None:
    gpu, fake = world_of_2["gpu"]["idioms"], world_of_2["fake"]["idioms"]
    off = {name: (gpu[name]["mib"], fake[name]["mib"]) for name in gpu
           if "mib" in gpu[name] and "mib" in fake.get(name, {}) and name not in {*APART, *RANDOM_AT_WORLD_2}
           and abs(fake[name]["mib"] - gpu[name]["mib"]) > max(GOAL * gpu[name]["mib"], 0.1)}
    assert off == {}
