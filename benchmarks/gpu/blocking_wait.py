"""What the plugin's default TORCH_NCCL_BLOCKING_WAIT=1 does to a DDP conv net's figure (issue 54).

The job as a team runs it: torchvision's ResNet-50, channels_last, DDP over NCCL at world 1, bf16
autocast, SGD with momentum, batch 64 at 224x224, 3 steps. Each variant runs ``--runs`` times, each
in a fresh process; each prints its ``max_memory_allocated``.

    python3 benchmarks/gpu/blocking_wait.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

VARIANTS = {"as run (no blocking wait)": {"TORCH_NCCL_BLOCKING_WAIT": "0"},
            "TORCH_NCCL_BLOCKING_WAIT=1 (the plugin's default)": {"TORCH_NCCL_BLOCKING_WAIT": "1"}}


def job() -> None:
    import torch
    import torch.distributed as dist
    import torchvision

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 2000}")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"{torch.cuda.max_memory_allocated() / 2**20:.2f}")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job()
        return 0
    for _ in range(args.runs):  # interleaved: a drift of the machine shows in both
        for name, env in VARIANTS.items():
            done = subprocess.run([sys.executable, __file__, "--job"], env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=300)
            figure = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-300:]
            print(f"{name:52s} max_memory_allocated {figure} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
