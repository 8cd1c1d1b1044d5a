"""DDP on a fake GPU: its check that reads parameter values across ranks is skipped (the ranks of a
simulated world agree), and its logger takes no CUDA timings."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from .base import Context, Mend


class _QuietLogger:
    """DDP's logger, minus its per-step runtime figures: they read the reducer's CUDA timer, which
    the CPU build has none of (an internal assert)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def set_runtime_stats_and_log(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def _patch(module: ModuleType, context: Context) -> None:
    setattr(module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)
    ddp = module.DistributedDataParallel
    init = ddp.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "logger", None) is not None and not isinstance(self.logger, _QuietLogger):
            self.logger = _QuietLogger(self.logger)

    ddp.__init__ = __init__


MEND: Mend = Mend(
    name='DDP without value checks and CUDA timings',
    needed_by='idioms ddp_no_sync_accumulation, ddp_static_graph_bucket_view, sync_batch_norm_ddp',
    on_import=(("torch.nn.parallel.distributed", _patch),),
)
