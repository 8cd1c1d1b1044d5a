"""Shape rules torch lacks for CUDA ops, and the one-kernel routes (``rules``)."""

from __future__ import annotations

from types import ModuleType

from .. import rules
from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    rules.install_rules(torch)


MEND: Mend = Mend(
    name='missing shape rules and one-kernel routes',
    needed_by='tests/test_fake_gpu_ops.py: SyncBatchNorm under DDP at a world of 2, grouped_mm in float32 '
              "(the transformers sweep's mixture-of-experts models); idioms gru, dropout_activations",
    on_import=(("torch", _patch),),
)
