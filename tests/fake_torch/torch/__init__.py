"""A fake ``torch`` whose CUDA caching allocator is scripted: the GPU allocator path on a CPU machine.

Only what ``pytest_gpumem.rankside.gpu_allocator`` reads is here, shaped as torch 2.x gives it:
``cuda._lazy_call`` (run at the job's first CUDA call), ``cuda.memory_stats`` (allocated/reserved
peaks), ``cuda.reset_peak_memory_stats``, and the history (``memory._record_memory_history``,
``memory._snapshot`` with ``segments`` and ``device_traces``). A job allocates with
``torch.cuda.alloc(mib)`` and frees with ``torch.cuda.free(block)``; the stacks recorded are the
job's own Python frames, innermost first. The cache is scripted too: ``reserved`` is the
allocated peak plus ``FAKE_CUDA_CACHE_MIB`` from the environment, as a caching allocator's slack
varies between identical runs while the tensors do not.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

__version__ = "2.99.0+fake"
MiB = 1024 * 1024
_HERE = os.path.dirname(os.path.abspath(__file__))


def _stack() -> list[dict]:
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_HERE):
            frames.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return frames


class _Memory:
    def __init__(self, cuda: "_Cuda") -> None:
        self.cuda = cuda

    def _record_memory_history(self, enabled="all", context="all", stacks="all", max_entries=0) -> None:
        self.cuda.history = enabled is not None

    def _snapshot(self) -> dict:
        blocks = [{"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                   "frames": frames} for addr, (size, frames) in self.cuda.blocks.items()]
        return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [list(self.cuda.trace)]}

    def _dump_snapshot(self, path: str) -> None:
        import pickle

        with open(path, "wb") as fh:
            pickle.dump(self._snapshot(), fh)


class _Cuda:
    def __init__(self) -> None:
        self.initialized = False
        self.queued: list = []
        self.history = False
        self.trace: list[dict] = []
        self.blocks: dict[int, tuple[int, list[dict]]] = {}
        self.allocated = self.peak = 0
        self.next_addr = 4096
        self.memory = _Memory(self)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return 1

    def _lazy_call(self, fn, **kwargs) -> None:
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def init(self) -> None:
        """What a job's first CUDA call does: the context, then torch's queued calls."""
        if not self.initialized:
            self.initialized = True
            for fn in self.queued:
                fn()

    def alloc(self, mib: float) -> int:
        self.init()
        size, addr = int(mib * MiB), self.next_addr
        self.next_addr += size + 512
        frames = _stack()
        self.blocks[addr] = (size, frames)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        if self.history:
            self.trace.append({"action": "alloc", "addr": addr, "size": size, "time_us": time.time() * 1e6,
                               "frames": frames})
        return addr

    def free(self, addr: int) -> None:
        size, frames = self.blocks.pop(addr)
        self.allocated -= size
        if self.history:
            self.trace.append({"action": "free_requested", "addr": addr, "size": size,
                               "time_us": time.time() * 1e6, "frames": frames})

    def memory_stats(self, device: int = 0) -> dict:
        cache = float(os.environ.get("FAKE_CUDA_CACHE_MIB", "0")) * MiB
        return {"allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.peak": (self.peak + cache) if self.initialized else 0}

    def reset_peak_memory_stats(self, device: int = 0) -> None:
        self.peak = self.allocated


cuda = _Cuda()
version = SimpleNamespace(cuda="12.8", git_version="fake")
