"""The fake GPU on models nobody here wrote (issue 63): a sample of each family of the committed sweep
(``benchmarks/fake_gpu_sweep.py``; results and commands in ``benchmarks/results/fake_gpu_sweep/``).

Every sampled model trains two steps on a fake GPU at world 1 and as rank 0 of 2 under DDP and FSDP2,
in fp32 and under bf16 autocast, built as it trained on plain CPU torch (the sweep's denominator); each
figure reads within 1% of the same model's on a GPU, where the GPU's run has it, or differs by what the
sweep's table explains. The whole families are the benchmark's (its table has the commands).
torchvision's and timm's families run in the vision venv (marked vision: torch's CUDA build, on a
machine with no driver here).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.skipif(torch.cuda.is_available(),
                                                   reason="a real GPU here: the fake GPU is for machines without")]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fake_gpu_sweep"
SWEEP = ROOT / "benchmarks" / "fake_gpu_sweep.py"
# Each family's sample: mixture-of-experts models (they crashed on grouped_mm's shape rule; PhiMoE's
# router on max without keepdim), everyday ones; a convolutional, a windowed and a plain vision
# transformer. Kept small for make test's time (the whole families are the benchmark's).
SAMPLE = {"causal_lm": ["mixtral", "qwen2_moe", "phimoe", "llama", "gpt2"],
          "image_classification": ["vit", "resnet", "swin"]}
# torchvision's and timm's: a ResNet and a MobileNet, DeepLab's light head, a detector (its RoI ops and
# NMS, whose output's size is the data's), timm's smallest ConvNeXt and ViT (the ones timm tests with).
VISION_SAMPLE = {"tv_classification": ["resnet18", "mobilenet_v3_small"],
                 "tv_segmentation": ["lraspp_mobilenet_v3_large"],
                 "tv_detection": ["fasterrcnn_mobilenet_v3_large_320_fpn"],
                 "timm": ["test_convnext", "test_vit"]}
GOAL = 0.01


def _results(family: str) -> Path:
    return RESULTS / "vision" if family in VISION_SAMPLE else RESULTS


def _sweep(tmp_path: Path, family: str, extra: list[str]) -> dict[str, Any]:
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(SWEEP), "--levels", str(_results(family) / "cpu.json"),
                           "--out", str(out), "--families", family, *extra],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _real(family: str) -> dict[tuple[str, str, str], float]:
    path = _results(family) / "real.json"
    if not path.exists():
        return {}
    return {(r["family"], r["model"], r["case"]): r["mib"] for r in json.loads(path.read_text())["rows"] if "mib" in r}


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_a_sample_of_each_family_trains_on_the_fake_gpu_at_every_world_and_reads_the_gpus_figure(
        tmp_path: Path, family: str) -> None:
    _check_sample(tmp_path, family, SAMPLE[family])


@pytest.mark.vision
@pytest.mark.parametrize("family", sorted(VISION_SAMPLE))
def test_a_sample_of_torchvisions_and_timms_families_trains_on_the_fake_gpu_and_reads_the_gpus_figure(
        tmp_path: Path, family: str) -> None:
    pytest.importorskip("torchvision")
    pytest.importorskip("timm")
    _check_sample(tmp_path, family, VISION_SAMPLE[family])


def _check_sample(tmp_path: Path, family: str, sample: list[str]) -> None:
    found = _sweep(tmp_path, family, ["--only", ",".join(sample)])
    rows = found["rows"]
    stopped = {f"{r['model']} {r['case']}": r["error"] for r in rows if "error" in r}
    assert stopped == {}
    assert {r["model"] for r in rows} == set(sample)
    assert len(rows) == len(sample) * 6  # single, ddp, fsdp2 x fp32, bf16
    real = _real(family)
    off = {(family, r["model"], r["case"]): r["mib"] for r in rows
           if (key := (family, r["model"], r["case"])) in real
           and abs(r["mib"] - real[key]) > max(GOAL * real[key], 0.1)}
    # beyond 1% only where the table lists the case as beyond, with the fake figure it lists there
    listed = _beyond(family)
    unlisted = {key: mib for key, mib in off.items() if abs(mib - listed.get(key, -1e9)) > max(0.005 * mib, 0.1)}
    assert unlisted == {}, "beyond 1% of the GPU and not as the sweep's table lists it: explain it there or mend"


def _beyond(family: str) -> dict[tuple[str, str, str], float]:
    """The sweep's table's 'Beyond 1% of the GPU' cases: their fake figures."""
    table = _results(family) / "table.txt"
    text = table.read_text() if table.exists() else ""
    lines = re.findall(r"^(\w+) (\S+) (\S+): gpu [\d.]+ fake ([\d.]+)", text, re.M)
    return {(family, model, case): float(fake) for family, model, case, fake in lines}


def test_the_mixture_of_experts_models_say_that_grouped_mm_was_answered_by_its_cpu_kernel(tmp_path: Path) -> None:
    found = _sweep(tmp_path, "causal_lm", ["--only", "mixtral", "--modes", "single", "--dtypes", "fp32"])
    (row,) = found["rows"]
    assert any(line.startswith("rule: aten::_grouped_mm answered by its CPU kernel") for line in row["supplied"])
