"""The optimizers' foreach path is taken for tensors of the listed types only (two lists: the
optimizers' own, and the one for gradient clipping and the like); a fake parameter's type is
FakeTensor, and without it Adam would run per tensor (another peak: the foreach path holds a
full-size temporary, the per-tensor one a step's slice)."""

from __future__ import annotations

from types import ModuleType

from .base import Context, Mend


def _patch(module: ModuleType, context: Context) -> None:
    supported = getattr(module, "_foreach_supported_types", None)
    if isinstance(supported, list) and context.fake_type not in supported:
        supported.append(context.fake_type)


MEND: Mend = Mend(
    name='the foreach path for fake tensors',
    needed_by='idioms adamw_foreach, autocast_bf16_clip_grad_norm',
    on_import=(("torch.utils._foreach_utils", _patch), ("torch.optim.optimizer", _patch)),
)
