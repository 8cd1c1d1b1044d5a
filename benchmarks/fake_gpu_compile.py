"""A compiled job's figure: eager, Inductor and aot_eager on a GPU against the fake GPU (issue 54).

An 8-block GPT-like stack (d=1024, 16 heads, sequence 1024, batch 8, bf16 autocast, AdamW), three
training steps; rank 0's ``max_memory_allocated`` for each way of running it. On the fake GPU
``torch.compile`` runs the model eagerly and the report says so: this script measures by how much
that differs from the real compiled run (docs/fake-gpu.md quotes it).

    python benchmarks/fake_gpu_compile.py --real --out compile_gpu.json   # on a GPU: eager, inductor, aot_eager
    python benchmarks/fake_gpu_compile.py                                  # here: the fake GPU (eager)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def build(torch: Any) -> Any:
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, dim: int = 1024, heads: int = 16) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(attn)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(8)])


def run(torch: Any, mode: str) -> dict[str, Any]:
    model = build(torch).cuda()
    if mode != "eager":
        model = torch.compile(model, backend=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 1024, 1024, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    out = {"mib": round(torch.cuda.max_memory_allocated() / MiB, 2), "above_start_mib":
           round((torch.cuda.max_memory_allocated() - base) / MiB, 2), "s": round(time.perf_counter() - started, 1)}
    del model, opt, x
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--modes", default="eager,inductor,aot_eager")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if not args.real:
        from pytest_gpumem.rankside import fakegpu

        fakegpu.install(os.environ.get("FAKE_GPU_MODEL", "NVIDIA H200"))
    import torch

    modes = args.modes.split(",") if args.real else ["eager", "inductor"]
    found: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "fake": not args.real,
                             "torch": torch.__version__}
    for mode in modes:  # each in a fresh process would be cleaner; one process keeps the workspaces alike
        found[mode] = run(torch, mode)
        print(f"{found['device']} {'fake' if not args.real else 'real'} {mode:10s} {found[mode]}", flush=True)
    if not args.real:
        found["supplied"] = fakegpu.supplied()
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
