"""The walk-through of docs/diagnosis.md, run for real: a red gpumem test, its peak sites, the commit.

Builds a small git repository of 8 commits whose test is a torch DDP job (gloo, CPU); commit 6
makes every rank all-gather the global batch. Then, as a reviewer would:

1. ``pytest --gpumem`` at HEAD: the test fails its ratio, the sites that grew are listed first;
2. ``gpumem bisect <commit 1> HEAD -- test_train.py::test_ddp``: the first bad commit, with its sites.

Writes what both printed to benchmarks/results/diagnosis.txt (temporary paths shortened).

    .venv-torch/bin/python benchmarks/diagnosis_demo.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "diagnosis.txt"

TEST = '''import os

import pytest
import torch
import torch.distributed as dist

from model import train


@pytest.fixture
def group():
    dist.init_process_group("gloo")
    yield
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2, allow_mib=16)
def test_ddp(group):
    assert train() > 0
'''

MODEL = '''import torch
import torch.distributed as dist

BATCH, FEATURES = 2048, 8192  # 64 MiB of batch per rank


def batch(rank):
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def train(steps=3):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(FEATURES, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch(dist.get_rank())
    for _ in range(steps):
        {inputs}
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()
'''
HEALTHY = "inputs, labels = x, y"
INFLATING = "inputs, labels = gather(x), gather(y)  # train on the global batch"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def build(root: Path) -> list[str]:
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "dev@example.com")
    git(root, "config", "user.name", "dev")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "test_train.py").write_text(TEST)
    shas = []
    for k in range(1, 9):
        (root / "model.py").write_text(MODEL.format(inputs=INFLATING if k >= 6 else HEALTHY))
        (root / "CHANGES").write_text(f"change {k}\n")
        git(root, "add", "-A")
        subject = "train on the all-gathered global batch" if k == 6 else f"change {k}"
        git(root, "commit", "-q", "-m", subject)
        shas.append(git(root, "rev-parse", "HEAD").strip())
    return shas


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="gpumem-diagnosis-"))
    try:
        shas = build(root)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        bin_dir = Path(sys.executable).parent
        red = subprocess.run([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider",
                              "--gpumem-report=report.json", "--gpumem-missing-baseline=ignore",
                              "test_train.py"], cwd=root, capture_output=True, text=True, env=env)
        bisect = subprocess.run([str(bin_dir / "gpumem"), "bisect", shas[0], "HEAD", "--",
                                 "test_train.py::test_ddp"], cwd=root, capture_output=True, text=True, env=env)
        text = (f"$ pytest --gpumem --gpumem-report=report.json test_train.py    (exit {red.returncode})\n"
                f"{red.stdout}\n"
                f"$ gpumem bisect {shas[0][:10]} HEAD -- test_train.py::test_ddp    (exit {bisect.returncode})\n"
                f"{bisect.stdout}{bisect.stderr}")
        text = text.replace(str(root), "<repo>")
        text = re.sub(r"/tmp/[\w./-]*gpumem-bisect-\w+", "<tmp>", text)
        OUT.write_text(f"{(__doc__ or '').strip()}\n\nThe commits: {', '.join(s[:10] for s in shas)}; commit 6 "
                       f"({shas[5][:10]}) adds the all-gather.\n\n{text}")
        print(text)
        return 0 if red.returncode == 1 and bisect.returncode == 0 and shas[5] in bisect.stdout else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
