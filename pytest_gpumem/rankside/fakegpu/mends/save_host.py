"""``torch.save`` of CUDA tensors (a checkpoint, a state dict) writes their values: a fake GPU's are
copied to the host first, through the value policy (known values, else zeros, reported)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    from torch.utils._pytree import tree_map

    original = getattr(torch, "save")

    @functools.wraps(original)
    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        def host(leaf: Any) -> Any:
            return leaf.cpu() if isinstance(leaf, context.fake_type) and leaf.device.type == "cuda" else leaf

        return original(tree_map(host, obj), *args, **kwargs)

    setattr(torch, "save", save)
    setattr(torch.serialization, "save", save)


MEND: Mend = Mend(
    name='torch.save from the host',
    needed_by='idiom state_dict_save',
    on_import=(("torch", _patch),),
)
