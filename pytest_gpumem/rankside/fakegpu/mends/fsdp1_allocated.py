"""FSDP1 asks whether a flat parameter's storage is allocated by its data pointer, and a fake
storage's is always 0: a fake storage is allocated when it has bytes."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .base import Context, Mend


def _patch(module: ModuleType, context: Context) -> None:
    original = module._data_ptr_allocated

    def allocated(tensor: Any) -> bool:
        if isinstance(tensor, context.fake_type):
            return bool(tensor.untyped_storage().nbytes() > 0)
        return bool(original(tensor))

    setattr(module, "_data_ptr_allocated", allocated)


MEND: Mend = Mend(
    name="FSDP1's allocated check by size",
    needed_by='idiom fsdp1_options at a world above 1 (SHARD_GRAD_OP with use_orig_params: its pre-unshard '
              'check failed)',
    on_import=(("torch.distributed.fsdp._flat_param", _patch),),
)
