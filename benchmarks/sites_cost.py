"""What reading the peak sites costs a rank at exit, beside reading its peak (host: memray's capture).

Runs the torch DDP example's training loop (one rank, gloo) under the tracker the ranks use, then
times, on that capture: the peak alone (what a rank reads without sites), the sites at the
high-water mark, and the live-heap curve for the plots. Medians of 5 reads.

    .venv-torch/bin/python benchmarks/sites_cost.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import memray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_gpumem.sampling import MiB  # noqa: E402
from pytest_gpumem.sampling.sites import memray_heap_timeline, memray_sites  # noqa: E402


def job() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16384, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2048, 16384), torch.randint(0, 10, (2048,))
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


def timed(fn) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1000


def main() -> None:
    path = Path(tempfile.mkdtemp()) / "capture.bin"
    with memray.Tracker(path, native_traces=False, follow_fork=False,
                        file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
        job()
    peak = memray.FileReader(path).metadata.peak_memory / MiB
    sites = memray_sites(path)
    print(f"capture {os.path.getsize(path) / 1024:.0f} KiB, peak {peak:.1f} MiB, {len(sites)} sites")
    print(f"read the peak (header):           {timed(lambda: memray.FileReader(path).metadata.peak_memory):7.1f} ms")
    print(f"read the sites at the peak:       {timed(lambda: memray_sites(path)):7.1f} ms")
    print(f"read the live-heap curve (plots): {timed(lambda: memray_heap_timeline(path)):7.1f} ms")
    for site in sites[:5]:
        print(f"  {site.mib:7.1f} MiB x{site.count:<6d} {site.label()}")


if __name__ == "__main__":
    main()
