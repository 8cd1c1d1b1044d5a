"""A fake GPU in a rank: the job as written for CUDA, on a machine without one.

The launch sets ``GPUMEM_RANK_FAKE_GPU`` to the GPU model to emulate (``models``). Before the job
imports torch, the CUDA shim is loaded (``shim``: torch's CPU build has no CUDA device guard);
once torch is imported, ``torch.cuda`` answers for the model (``cuda_api``) and every CUDA tensor
is a fake one (``dispatch``), counted as the caching allocator counts it (``accounting``). The
rank's allocator figure (``max_memory_allocated``) is then read by the plugin as on a real GPU, and
what the caching allocator reserves, replayed (``accounting``). The device figure is predicted
(``device``): the reserved peak and what the GPU model's calibration says lives outside the allocator.

Sizes run as a simulated world (``rankside.simulate``): with no GPU there is no NCCL, and a fake
tensor has no values to communicate; the stand-in group keeps every collective's sizes.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

FAKE_GPU_ENV = "GPUMEM_RANK_FAKE_GPU"  # the GPU model this rank's fake GPU emulates (set by the launch)
CALIBRATION_ENV = "GPUMEM_FAKE_GPU_CALIBRATION"  # the calibration file beside the baselines, if any

active: dict[str, Any] = {}  # once installed: "model" (GpuModel), "allocator" (FakeAllocator)


def requested(env: Mapping[str, str] = os.environ) -> str | None:
    """The GPU model this rank emulates, or None for a real GPU (or none)."""
    return env.get(FAKE_GPU_ENV) or None


def install(name: str, calibration: str | None = None) -> None:
    """Load the shim now and arm the rest at torch's import. Raises ``ShimError``,
    ``CalibrationError`` or ``AllocConfError`` with a message that says what to do."""
    from ...sampling.alloc_conf import alloc_conf_from_env
    from ..imports import after_import
    from . import models, shim
    from .accounting import FakeAllocator

    model = models.model(name, Path(calibration) if calibration else None)
    if active.get("model") == model:  # a rank forked from the fake GPU's warm server: installed there
        return
    guarded = shim.load() is not None  # the shim's guard and hooks: a CPU build, or a CUDA one with no driver
    allocator = FakeAllocator(model.cublas_workspace, model.cublaslt_workspace, alloc_conf_from_env(os.environ))
    active.update(model=model, allocator=allocator)
    after_import("torch", lambda torch: _arm(torch, allocator, model, guarded))


def _arm(torch: ModuleType, allocator: Any, model: Any, guarded: bool) -> None:
    from . import cuda_api, dispatch

    cuda_api.install_cuda_api(torch, allocator, model, guarded)
    active["mode"] = dispatch.install_dispatch(torch, allocator, model)


def supplied() -> list[str]:
    """What this rank's fake GPU supplied that a fake tensor does not have (``values``): one line each."""
    mode = active.get("mode")
    return mode.policy.supplied.lines() if mode is not None else []


def describe(reserved_mib: float | None) -> dict[str, Any]:
    """What the exit report says of this rank's fake GPU ({} on a real one): with the device figure
    predicted from ``reserved_mib`` (the reserved peak the report carries), where the model has one."""
    from ..simulate import eager_nccl
    from .device import predict_device

    model = active.get("model")
    if model is None:
        return {}
    loaded = active["allocator"].loaded | ({"nccl"} if eager_nccl else set())
    device = None if reserved_mib is None else predict_device(model, reserved_mib, loaded)
    return {"model": model.name, "calibration": model.source, "measured_with": dict(model.measured_with),
            "cublas_workspace_mib": model.cublas_workspace / 2**20,
            "cublaslt_workspace_mib": model.cublaslt_workspace / 2**20, "supplied": supplied(),
            **({"device": device} if device else {})}
