"""The device figure a fake GPU predicts: what NVML would show for the process on the GPU it emulates.

A job runs out of memory on that figure, not on the allocator's. It is the caching allocator's
reserved peak (replayed: ``accounting``) plus what lives outside the allocator (``models.OUTSIDE``),
as ``gpumem calibrate`` measured each part on that GPU model: the context always, each library's
kernels where the job called it, an NCCL communicator where a collective ran on a CUDA tensor
(``FakeAllocator.loaded``) or a group was made with a CUDA ``device_id`` (``simulate.eager_nccl``).
NCCL's figure is a world of one's: at larger worlds a communicator holds buffers per peer and
channel that this does not model yet (docs/fake-gpu.md, "The device figure").
"""

from __future__ import annotations

from typing import Any, Iterable

from .models import OUTSIDE, GpuModel

MiB = 2**20


def predict_device(model: GpuModel, reserved_mib: float, loaded: Iterable[str]) -> dict[str, Any] | None:
    """The prediction as the exit report carries it, or None where the model has no figures outside."""
    if not model.outside:
        return None
    used = set(loaded) | {"context"}
    parts = {"reserved": round(reserved_mib, 3)}
    parts.update({part: round(model.outside.get(part, 0) / MiB, 3) for part in OUTSIDE if part in used})
    return {"gpu": model.name, "capacity_mib": round(model.total_memory / MiB, 3), "parts_mib": parts}
