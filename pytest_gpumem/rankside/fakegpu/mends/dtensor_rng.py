"""DTensor's random ops keep the CUDA generator's state (16 bytes) as a CUDA tensor and compare it
across ranks; a fake one has no values to compare or to advance, so it stays on the CPU."""

from __future__ import annotations

from types import ModuleType

from .base import Context, Mend


def _patch(module: ModuleType, context: Context) -> None:
    tracker = getattr(module, "OffsetBasedRNGTracker", None)
    if tracker is not None and hasattr(tracker, "_get_device_state"):
        tracker._get_device_state = lambda self: self._device_handle.get_rng_state()


MEND: Mend = Mend(
    name="DTensor's RNG state on the host",
    needed_by='tests/test_fake_gpu_ops.py: random init of sharded DTensors',
    on_import=(("torch.distributed.tensor._random", _patch),),
)
