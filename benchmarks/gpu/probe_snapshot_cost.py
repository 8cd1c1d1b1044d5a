"""How long reading torch's allocator history takes at a rank's exit, for a one-allocation body."""
import sys
import time

import torch

record = sys.argv[1:] != ["nohistory"]
t = time.perf_counter()
if record:
    torch.cuda._lazy_call(lambda: torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=200_000))
x = torch.ones(1536 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"history {record}: init + alloc {time.perf_counter() - t:.3f} s")
t = time.perf_counter()
raw = torch._C._cuda_memorySnapshot(None)
print(f"raw _cuda_memorySnapshot #1: {time.perf_counter() - t:.3f} s")
t = time.perf_counter()
snap = torch.cuda.memory._snapshot()
print(f"_snapshot #2: {time.perf_counter() - t:.3f} s, {len(snap['device_traces'][0])} events")
mods = sorted(m for m in sys.modules if m.startswith("torch._C") or "traceback" in m)
print(len(sys.modules), "modules")
