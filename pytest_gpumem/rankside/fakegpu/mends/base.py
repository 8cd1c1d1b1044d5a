"""What a mend is (``Mend``) and what it may use (``Context``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from ..accounting import FakeAllocator
from ..models import GpuModel


@dataclass(frozen=True)
class Context:
    """What a mend may use: the rank's torch, its fake allocator and GPU model, the fake tensor type,
    and the collector of what the fake GPU supplied (the report lists it)."""

    torch: ModuleType
    allocator: FakeAllocator
    model: GpuModel
    fake_type: Any  # torch's FakeTensor
    supplied: Any


Patch = Callable[[ModuleType, Context], None]
# After a counted call of the op (its outputs already counted): (context, args, kwargs, the CUDA
# device its first fake tensor argument is on) -> None.
OpHook = Callable[[Context, Any, dict[str, Any], int], None]
BoundHook = Callable[[Any, dict[str, Any], int], None]  # an OpHook given the rank's context


@dataclass(frozen=True)
class Mend:
    """One difference from a GPU and its remedy."""

    name: str
    needed_by: str  # the idioms (tests/idioms.py) or sweep models that fail or read wrong without it
    on_import: tuple[tuple[str, Patch], ...] = ()  # (the module whose import arms it, its patch)
    after_op: tuple[tuple[str, OpHook], ...] = ()  # (an op's name, aten's or "namespace.op", what its call adds)
