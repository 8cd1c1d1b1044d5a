"""The blocks live at an idiom's peak on a GPU with their C++ stacks (issue 54): what allocated the
blocks the fake GPU's blocks diff shows as the GPU's only, where the Python stack is empty (the
autograd thread).

    python3 benchmarks/gpu/peak_stacks.py moe_topk_router --min-mib 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("idiom")
    parser.add_argument("--min-mib", type=float, default=1.0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import idioms
    import torch
    import torch.distributed as dist

    from pytest_gpumem.sampling.torch_history import replay

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    idioms.torch, idioms.nn, idioms.F = torch, torch.nn, torch.nn.functional
    idioms._route_as_the_fake_gpu_assumes()  # noqa: SLF001
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="all",  # noqa: SLF001
                                             max_entries=400_000)
    torch.cuda.reset_peak_memory_stats()
    idioms.IDIOMS[args.idiom]()
    torch.cuda.synchronize()
    found = replay(torch.cuda.memory._snapshot(), 0)  # noqa: SLF001
    print(f"{args.idiom}: peak {torch.cuda.max_memory_allocated() / MiB:.2f} MiB")
    for frames, size in sorted(found.blocks, key=lambda b: -b[1]):
        if size / MiB < args.min_mib:
            continue
        names = [name for name, _, _ in frames]
        cut = next((i + 1 for i, n in enumerate(names) if "gather_with_cpp" in n), 0)  # the recorder's own frames
        print(f"{size / MiB:9.3f} MiB  " + " < ".join(n.split("(")[0][:60] for n in names[cut:cut + 7]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
