"""Where a fake GPU's figure differs from a real one's: the blocks live at each idiom's peak (issue 54).

For each idiom of tests/idioms.py: the allocator history from the idiom's start, replayed to its peak
(``sampling.torch_history.replay``), and the blocks live there, each as its size and the innermost
frames of the stack that allocated it. Run on a GPU (``--real``) and here, then ``--diff`` the two:
the blocks one side holds and the other not are what the fake accounting misses or adds.

    python benchmarks/fake_gpu_blocks.py --real --only dropout_activations --out blocks_gpu.json
    python benchmarks/fake_gpu_blocks.py --only dropout_activations --out blocks_fake.json
    python benchmarks/fake_gpu_blocks.py --diff blocks_gpu.json blocks_fake.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _where(frames: Any) -> str:
    """The innermost frames outside torch's own Python, e.g. ``idioms.py:212 dropout_activations``."""
    kept = [(name, f, line) for name, f, line in frames if "pytest_gpumem" not in f]
    named = [f"{Path(f).name}:{line} {name}" for name, f, line in kept]
    mine = [n for n, (_, f, _) in zip(named, kept) if f"{os.sep}torch{os.sep}" not in f]
    torch_side = [n for n, (_, f, _) in zip(named, kept) if f"{os.sep}torch{os.sep}" in f][:2]
    return " < ".join(torch_side + mine[:1]) or "(no Python stack: the autograd thread)"


def record(names: list[str], real: bool, model: str | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import idioms

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), GPUMEM_SIMULATE_ASSUME="alike")
    if not real:
        from pytest_gpumem.rankside import fakegpu, simulate

        simulate.install_world(simulate.World(0, 1))
        fakegpu.install(model or "NVIDIA H200")
    import torch
    import torch.distributed as dist

    from pytest_gpumem.sampling.torch_history import replay

    idioms.torch, idioms.nn, idioms.F = torch, torch.nn, torch.nn.functional
    if real:
        idioms._route_as_the_fake_gpu_assumes()  # noqa: SLF001
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",  # noqa: SLF001
                                             max_entries=400_000)
    out: dict[str, Any] = {}
    for name in names:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        idioms.IDIOMS[name]()
        torch.cuda.synchronize()
        found = replay(torch.cuda.memory._snapshot(), 0)  # noqa: SLF001
        sizes: collections.Counter[str] = collections.Counter()
        for frames, size in found.blocks:
            sizes[f"{size / MiB:10.3f} MiB  {_where(frames)}"] += 1
        out[name] = {"peak_mib": round(torch.cuda.max_memory_allocated() / MiB, 2), "blocks": dict(sizes)}
    dist.destroy_process_group()
    return out


def diff(real_file: Path, fake_file: Path) -> None:
    real, fake = json.loads(real_file.read_text()), json.loads(fake_file.read_text())
    for name in real:
        if name not in fake:
            continue
        print(f"== {name}: gpu peak {real[name]['peak_mib']} MiB, fake {fake[name]['peak_mib']} MiB")
        a, b = _by_function(real[name]["blocks"]), _by_function(fake[name]["blocks"])
        for key in sorted((a - b).keys()):
            print(f"  gpu only  {(a - b)[key]}x {key}")
        for key in sorted((b - a).keys()):
            print(f"  fake only {(b - a)[key]}x {key}")


def _by_function(blocks: dict[str, int]) -> collections.Counter[str]:
    """Blocks keyed without line numbers or torch's dispatch frames: torch versions differ in both."""
    import re

    out: collections.Counter[str] = collections.Counter()
    for key, count in blocks.items():
        frames = [re.sub(r":\d+ ", " ", f) for f in key.split(" < ")]
        out[" < ".join(f for f in frames if "handle_torch_function" not in f and "_call_impl" not in f)] += count
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--diff", nargs=2, type=Path, default=None)
    args = parser.parse_args(argv)
    if args.diff:
        diff(*args.diff)
        return 0
    names = [n for n in args.only.split(",") if n]
    if len(names) == 1:
        found = record(names, args.real, args.model)
    else:  # each idiom in a process of its own: its history and peak are its own
        import subprocess
        import tempfile

        found = {}
        for name in names:
            with tempfile.NamedTemporaryFile(suffix=".json") as one:
                command = [sys.executable, __file__, "--only", name, "--out", one.name] + (
                    ["--real"] if args.real else []) + (["--model", args.model] if args.model else [])
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                if done.returncode:
                    found[name] = {"error": done.stderr[-2000:]}
                    continue
                found.update(json.loads(Path(one.name).read_text()))
    text = json.dumps(found, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
