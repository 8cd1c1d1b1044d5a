"""DTensor's sharding propagation runs its ops on global-shape fake tensors in the job's fake mode:
not the job's memory, so not counted."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..accounting import paused
from .base import Context, Mend


def _patch(module: ModuleType, context: Context) -> None:
    propagator = module.ShardingPropagator
    original = propagator._propagate_tensor_meta_non_cached  # noqa: SLF001

    @functools.wraps(original)
    def uncounted(*args: Any, **kwargs: Any) -> Any:
        paused.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            paused.depth -= 1

    propagator._propagate_tensor_meta_non_cached = uncounted  # noqa: SLF001


MEND: Mend = Mend(
    name='sharding propagation uncounted',
    needed_by='idiom fsdp2_options (DTensor parameters: a global-size block each op)',
    on_import=(("torch.distributed.tensor._sharding_prop", _patch),),
)
