"""What torch's allocator history looks like on this GPU machine (the shape rankside/gpu_allocator.py reads)."""
import json
import time

import torch

torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1000)


def make():
    return torch.ones(256 * 2**20 // 4, device="cuda")


kept = make()
tmp = make()
del tmp
snap = torch.cuda.memory._snapshot()
seg = snap["segments"][0]
block = next(b for b in seg["blocks"] if b["state"] == "active_allocated")
events = snap["device_traces"][0]
print(json.dumps({
    "segment_keys": sorted(seg), "block_keys": sorted(block), "block_frames": block.get("frames", [])[:2],
    "event_keys": sorted(events[0]), "actions": [e["action"] for e in events],
    "last_time_us": events[-1].get("time_us"), "now_s": time.time(),
    "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
}, indent=1, default=str))
