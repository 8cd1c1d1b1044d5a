"""DTensor's random ops keep the CUDA generator's state (16 bytes) as a CUDA tensor and compare it
across ranks; a fake one has no values to compare or to advance, so it stays on the CPU. On a GPU
that first comparison broadcasts the state over NCCL, which makes the group's communicator (an H100
at world 1 held 562 MiB more: benchmarks/results/device_figure.txt, the hub's Mixtral): noted for the
device figure."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from .base import Context, Mend


def _patch(module: ModuleType, context: Context) -> None:
    tracker = getattr(module, "OffsetBasedRNGTracker", None)
    if tracker is None or not hasattr(tracker, "_get_device_state"):
        return
    tracker._get_device_state = lambda self: self._device_handle.get_rng_state()
    init = tracker.__init__

    @functools.wraps(init)
    def synced(self: Any, device_mesh: Any = None, run_state_sync: bool = True, *args: Any, **kwargs: Any) -> None:
        init(self, device_mesh, run_state_sync, *args, **kwargs)
        if run_state_sync:
            context.allocator.called("nccl")

    tracker.__init__ = synced


MEND: Mend = Mend(
    name="DTensor's RNG state on the host",
    needed_by='tests/test_fake_gpu_ops.py: random init of sharded DTensors',
    on_import=(("torch.distributed.tensor._random", _patch),),
)
