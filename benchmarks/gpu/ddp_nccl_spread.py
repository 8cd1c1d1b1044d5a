"""Why a real NCCL DDP job's allocator peak moves between identical runs (issue 26, item 6).

The job: DDP over an MLP 4096x8192 (two 128 MiB weights), Adam, 3 steps, NCCL at world 1, one GPU.
Each variant is run ``--runs`` times in fresh processes; each prints its ``max_memory_allocated``.
The probe variant prints how ``memory_allocated()`` moves after DDP's construction, on host time,
with no GPU work issued: memory that is released later by a background thread shows there.

    python3 benchmarks/gpu/ddp_nccl_spread.py --runs 8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS = {  # name -> (extra environment, job arguments)
    "default": ({}, []),
    "avoid_record_streams=1": ({"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}, []),
    "avoid_record_streams=0": ({"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}, []),
    "sleep 0.3 s after DDP()": ({}, ["--sleep", "0.3"]),
    "gloo": ({}, ["--backend", "gloo"]),
    # Where the extra memory comes from: time after step 1 only; no bucket rebuild after step 1.
    "sleep 0.3 s after step 1": ({}, ["--sleep-after-first", "0.3"]),
    "static_graph=True": ({}, ["--static-graph"]),
    "TORCH_NCCL_BLOCKING_WAIT=1": ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, []),
}


def job(backend: str, sleep: float, probe: bool, sleep_after_first: float = 0.0, static_graph: bool = False) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 2000}")
    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 4096)).cuda()
    before = torch.cuda.memory_allocated()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], static_graph=static_graph)
    if probe:  # no GPU work from here on: what moves is released on host time
        torch.cuda.synchronize()
        start = time.perf_counter()
        seen = []
        while time.perf_counter() - start < 0.5:
            seen.append((time.perf_counter() - start, (torch.cuda.memory_allocated() - before) / 2**20))
            time.sleep(0.001)
        changes = [(round(t * 1000, 1), round(m, 2)) for i, (t, m) in enumerate(seen) if i == 0 or m != seen[i - 1][1]]
        print("probe", changes, flush=True)
    if sleep:
        torch.cuda.synchronize()
        time.sleep(sleep)
    opt = torch.optim.Adam(ddp.parameters())
    for step in range(3):
        ddp(torch.randn(256, 4096, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and sleep_after_first:
            torch.cuda.synchronize()
            time.sleep(sleep_after_first)
    torch.cuda.synchronize()
    print("peak", round(torch.cuda.max_memory_allocated() / 2**20, 2), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--job", action="store_true")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--sleep-after-first", type=float, default=0.0)
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names to run")
    parser.add_argument("--no-probe", action="store_true")
    args = parser.parse_args()
    if args.job:
        job(args.backend, args.sleep, args.probe, args.sleep_after_first, args.static_graph)
        return
    chosen = {name: VARIANTS[name] for name in args.variants.split(",")}
    import torch

    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}; {args.runs} runs a variant, interleaved")
    peaks: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.runs):
        for name, (env, extra) in chosen.items():
            out = subprocess.run([sys.executable, __file__, "--job", *extra], env={**os.environ, **env},
                                 capture_output=True, text=True, check=False)
            line = [s for s in out.stdout.splitlines() if s.startswith("peak")]
            peaks[name].append(float(line[0].split()[1]) if line else float("nan"))
            if not line:
                print(name, "failed:", out.stderr[-800:])
    for name, values in peaks.items():
        print(f"{name:28s} max_memory_allocated MiB: {values}")
    for variant in () if args.no_probe else (["--probe"], ["--probe", "--backend", "gloo"]):
        for _ in range(3):
            out = subprocess.run([sys.executable, __file__, "--job", *variant], capture_output=True, text=True,
                                 check=False)
            print(" ".join(variant), [s for s in out.stdout.splitlines() if s.startswith("probe")] or out.stderr[-500:])


if __name__ == "__main__":
    main()
