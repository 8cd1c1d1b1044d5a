"""The fake GPU's mends: each a place where torch's CPU build under fake mode would differ from a GPU.

A mend declares what arms it (a module's import, an op's counted call), its patch, and what needs
it: the idiom of ``tests/idioms.py`` or the sweep's model that crashed or read wrong without it.
``MENDS`` is the registry, applied in its order by ``dispatch.install_dispatch``; a new mend is a
module here and its line in ``MENDS``; each declares itself with ``base``'s types.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ...imports import after_import
from . import (
    attention,
    compile_eager,
    cublas,
    ddp,
    dtensor_rng,
    foreach,
    fsdp1_allocated,
    fsdp_move,
    kernel_scratch,
    libraries,
    lift_cpu,
    save_host,
    shape_rules,
    sharding,
    storage_resize,
    ties,
)
from .base import BoundHook, Context, Mend, Patch

MENDS: tuple[Mend, ...] = (
    storage_resize.MEND, attention.MEND, sharding.MEND, ddp.MEND, dtensor_rng.MEND, fsdp1_allocated.MEND,
    foreach.MEND, lift_cpu.MEND, ties.MEND, shape_rules.MEND, compile_eager.MEND, save_host.MEND,
    fsdp_move.MEND, kernel_scratch.MEND, cublas.MEND, libraries.MEND,
)

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True


def apply_mends(context: Context) -> dict[Any, tuple[BoundHook, ...]]:
    """Arm every mend's import patches; returns its op hooks by overload packet (the ops this torch has)."""
    hooks: dict[Any, tuple[BoundHook, ...]] = {}
    for mend in MENDS:
        for module, patch in mend.on_import:
            after_import(module, functools.partial(_applied, patch, context))
        for op, hook in mend.after_op:
            namespace, _, name = op.rpartition(".")  # "mm" is aten's; "c10d.allreduce_" names its namespace
            ops = getattr(context.torch.ops, namespace or "aten")
            if hasattr(ops, name):
                packet = getattr(ops, name)
                hooks[packet] = (*hooks.get(packet, ()), functools.partial(hook, context))
    return hooks


def _applied(patch: Patch, context: Context, module: ModuleType) -> None:
    patch(module, context)
