"""What torch's CUDA caching allocator would count for a rank's fake CUDA tensors.

``max_memory_allocated`` counts blocks: each storage's size rounded up to 512 bytes (the allocator's
smallest block), from the op that creates it until its last tensor dies, resized in place where a
job frees or regrows a storage (FSDP's parameters). Views share their base's block. Beyond the
job's tensors, the allocator holds the math libraries' workspaces: cuBLAS's for each thread that
runs a matrix product (the forward's and the autograd thread's), cuBLASLt's likewise; their sizes
are the GPU model's (``models``).

What is reserved (``max_memory_reserved``) is the caching allocator's policy replayed over the same
allocations and frees as they happen (``sampling.caching_allocator``, with the job's
``PYTORCH_CUDA_ALLOC_CONF``): segments, splitting, caching and ``empty_cache``, a pool per stream (a
block comes from the pool of the stream current where it is made: FSDP2's all-gathers take theirs),
none held past its free for another stream (the fake GPU's streams run nothing).

With history on, each block keeps the Python stack that allocated it, and the events are kept in
the shape of torch's own allocator history, so the plugin's peak sites read them unchanged.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...sampling.alloc_conf import AllocConf
from ...sampling.caching_allocator import CachingAllocator

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

BLOCK = 512  # kMinBlockSize: every allocation is a multiple of it
HISTORY_DEPTH = 64
HERE = str(Path(__file__).resolve().parent)
# The fake mode's own frames between the job and an allocation: not in a real GPU's history either.
MACHINERY = ("/torch/_subclasses/", "/torch/_ops.py", "/torch/utils/_stats.py", "/torch/_compile.py",
             "/torch/_dynamo/eval_frame.py", "/torch/utils/_python_dispatch.py")


class _Depth(threading.local):
    depth = 0


paused = _Depth()  # >0 on this thread: ops run fake but nothing is counted (DTensor's sharding propagation)


def block_bytes(nbytes: int) -> int:
    """The caching allocator's block for a request of ``nbytes`` (0 allocates nothing)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // BLOCK) * BLOCK


@dataclass
class _Block:
    device: int
    size: int
    frames: list[dict[str, Any]] | None


class FakeAllocator:
    """The allocator's accounting of this rank's fake CUDA storages, per device."""

    def __init__(self, cublas_workspace: int, cublaslt_workspace: int, conf: AllocConf | None = None) -> None:
        self.cublas_workspace = cublas_workspace
        self.cublaslt_workspace = cublaslt_workspace
        self.conf = conf or AllocConf()
        self._pools: dict[int, CachingAllocator] = {}  # device -> its caching allocator, replayed
        self._pool_ids: dict[int, int] = {}  # block key -> its id in its device's pool
        self.current: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.allocations: dict[int, int] = {}  # device -> number of blocks allocated (the stats' count)
        self._blocks: dict[int, _Block] = {}  # storage key -> its block
        self._workspaces: dict[tuple[int, str, int], tuple[int, _Block]] = {}  # (thread, library, device)
        self._scratch: dict[int, _Block] = {}
        self._lock = threading.Lock()
        self._next_addr = 1 << 40
        self.history: list[dict[str, Any]] | None = None  # events, once history is on
        self.on_peak: Callable[[int], None] | None = None  # told each new peak's bytes (sampling.holders)
        self.stream_of: Callable[[], int] = lambda: 0  # the current stream's pool (0: the default stream)
        self.loaded: set[str] = set()  # the libraries whose kernels the job's calls loaded (models.OUTSIDE)

    # -- the job's storages -------------------------------------------------------------------------

    def track(self, storage: Any, device: int) -> None:
        """A storage that an op returned: counted once, freed when it dies."""
        key = storage._cdata  # noqa: SLF001 - the StorageImpl's address: one per storage
        if key in self._blocks:
            self.resized(storage)
            return
        size = block_bytes(storage.nbytes())
        with self._lock:
            self._blocks[key] = _Block(device, size, self._frames())
            self._grow(device, size, key)
        weakref.finalize(storage, self._free, key)
        self._tell_peak(device)

    def resized(self, storage: Any) -> None:
        """A tracked storage whose size changed in place (``resize_``: FSDP frees and regrows its
        parameters' storage this way)."""
        block = self._blocks.get(storage._cdata)  # noqa: SLF001
        if block is None:
            return
        size = block_bytes(storage.nbytes())
        if size == block.size:
            return
        with self._lock:
            key = storage._cdata  # noqa: SLF001
            self._shrink(block.device, block.size, key, block.frames)
            block.size, block.frames = size, self._frames()
            self._grow(block.device, size, key)
        self._tell_peak(block.device)

    def live(self) -> dict[int, int]:
        """``{storage key: bytes}`` of the job's storages live now (keys as ``track`` makes them)."""
        with self._lock:
            return {key: block.size for key, block in self._blocks.items()}

    def _tell_peak(self, device: int) -> None:
        """A storage that reaches a new peak is in place (outside the lock): the watcher may walk to it."""
        if self.on_peak is not None and self.current.get(device, 0) >= self.peak.get(device, 0):
            self.on_peak(sum(self.current.values()))

    def _free(self, key: int) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                self._shrink(block.device, block.size, key, block.frames)

    # -- the libraries' workspaces -----------------------------------------------------------------

    def workspace(self, library: str, device: int) -> None:
        """cuBLAS's (``"cublas"``) or cuBLASLt's (``"cublaslt"``) workspace for this thread, once."""
        key = (threading.get_ident(), library, device)
        self.called("cublas")
        if key in self._workspaces:
            return
        size = self.cublas_workspace if library == "cublas" else self.cublaslt_workspace
        with self._lock:
            self._next_addr += BLOCK
            block = _Block(device, size, self._frames())
            self._workspaces[key] = (self._next_addr, block)
            if size:
                self._scratch[self._next_addr] = block  # for the history's frames
                self._grow(device, size, self._next_addr)  # held to the end, as the real pool holds it
                self._scratch.pop(self._next_addr)

    def called(self, library: str) -> None:
        """The job called into ``library`` (a part of ``models.OUTSIDE``): its kernels are loaded."""
        self.loaded.add(library)

    def transient(self, device: int, nbytes: int) -> None:
        """Scratch a kernel allocates and frees inside one op (a copy of an operand): it counts
        toward the peak at the op, on top of what is live."""
        size = block_bytes(nbytes)
        if not size:
            return
        with self._lock:
            self._next_addr += BLOCK
            key = self._next_addr
            self._scratch[key] = _Block(device, size, self._frames())
            self._grow(device, size, key)
            self._shrink(device, size, key, self._scratch.pop(key).frames)

    # -- the figures --------------------------------------------------------------------------------

    def reset_peak(self, device: int) -> None:
        with self._lock:
            self.peak[device] = self.current.get(device, 0)
            self._pool(device).reset_peak()

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every device's unused cached segments released."""
        with self._lock:
            for pool in self._pools.values():
                pool.empty_cache()

    def stats(self, device: int) -> dict[str, int]:
        """The keys of ``torch.cuda.memory_stats`` a job or the plugin reads."""
        current, peak = self.current.get(device, 0), self.peak.get(device, 0)
        with self._lock:
            pool = self._pool(device)
            reserved, reserved_peak, retries = pool.heap.reserved, pool.figures().reserved_peak, pool.retries
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
                "active_bytes.all.current": current, "active_bytes.all.peak": peak,
                "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved_peak,
                "requested_bytes.all.current": current, "requested_bytes.all.peak": peak,
                "allocation.all.current": sum(1 for b in self._blocks.values() if b.device == device),
                "allocation.all.allocated": self.allocations.get(device, 0),
                "num_alloc_retries": retries, "num_ooms": 0}

    # -- history ------------------------------------------------------------------------------------

    def start_history(self) -> None:
        if self.history is None:
            self.history = []

    def snapshot(self) -> dict[str, Any]:
        """The live blocks and the events, as ``torch.cuda.memory._snapshot()`` shapes them."""
        devices = sorted(set(self.current) | {0})
        live = list(self._blocks.items()) + [(addr, b) for addr, b in self._workspaces.values() if b.size]
        segments = [{"device": device, "blocks": [
            {"state": "active_allocated", "address": key, "size": b.size, "requested_size": b.size,
             "frames": b.frames or []} for key, b in live if b.device == device]}
            for device in devices]
        traces: list[list[dict[str, Any]]] = [[] for _ in range(max(devices) + 1)]
        for event in self.history or ():
            traces[event["device"]].append(event)
        return {"segments": segments, "device_traces": traces}

    # -- inside -------------------------------------------------------------------------------------

    def _pool(self, device: int) -> CachingAllocator:
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = CachingAllocator(self.conf)
        return pool

    def _grow(self, device: int, size: int, key: int) -> None:
        if size:
            self._pool_ids[key] = self._pool(device).malloc(size, self.stream_of())
        current = self.current.get(device, 0) + size
        self.current[device] = current
        if current > self.peak.get(device, 0):
            self.peak[device] = current
        self.allocations[device] = self.allocations.get(device, 0) + 1
        if self.history is not None and size:
            block = self._blocks.get(key) or self._scratch.get(key)
            self.history.append({"action": "alloc", "addr": key, "size": size, "device": device,
                                 "frames": (block.frames if block is not None else None) or [],
                                 "time_us": time.time() * 1e6})

    def _shrink(self, device: int, size: int, key: int, frames: list[dict[str, Any]] | None) -> None:
        pool_id = self._pool_ids.pop(key, None)
        if pool_id is not None:
            self._pools[device].free(pool_id)
        self.current[device] = self.current.get(device, 0) - size
        if self.history is not None and size:
            self.history.append({"action": "free_requested", "addr": key, "size": size, "device": device,
                                 "frames": frames or [], "time_us": time.time() * 1e6})

    def _frames(self) -> list[dict[str, Any]] | None:
        """The Python stack allocating now, innermost first (only while history is on)."""
        if self.history is None:
            return None
        frames: list[dict[str, Any]] = []
        frame: Any = sys._getframe(2)  # noqa: SLF001 - past track/resized
        while frame is not None and len(frames) < HISTORY_DEPTH:
            code = frame.f_code
            name = code.co_filename
            if not name.startswith(HERE) and not any(part in name for part in MACHINERY):
                frames.append({"filename": name, "line": frame.f_lineno, "name": code.co_name})
            frame = frame.f_back
        return frames
