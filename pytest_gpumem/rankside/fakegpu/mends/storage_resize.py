"""``UntypedStorage.resize_`` is no op the modes see, and FSDP frees and regrows parameters with it."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..accounting import paused
from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    resize = torch.UntypedStorage.resize_

    @functools.wraps(resize)
    def resize_(self: Any, size: int) -> Any:
        out = resize(self, size)
        if not paused.depth:
            context.allocator.resized(self)
        return out

    torch.UntypedStorage.resize_ = resize_


MEND: Mend = Mend(
    name='storage resize counted',
    needed_by='idioms fsdp1_options, fsdp2_options (their freed parameters)',
    on_import=(("torch", _patch),),
)
