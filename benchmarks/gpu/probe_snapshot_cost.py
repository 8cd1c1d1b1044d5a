"""How long reading torch's allocator history takes at a rank's exit, for a one-allocation body."""
import time

import torch

t = time.perf_counter()
torch.cuda._lazy_call(lambda: torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
                                                                        stacks="python", max_entries=200_000))
x = torch.ones(1536 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"init + alloc {time.perf_counter() - t:.3f} s")
for i in range(3):
    t = time.perf_counter()
    snap = torch.cuda.memory._snapshot()
    print(f"_snapshot #{i + 1}: {time.perf_counter() - t:.3f} s, {len(snap['device_traces'][0])} events")
t = time.perf_counter()
print("nccl", torch.cuda.nccl.version(), f"{time.perf_counter() - t:.3f} s")
