"""``launcher="torchrun"``: ``python -m torch.distributed.run --standalone`` starts the ranks. It
picks and binds its own rendezvous port (none is leased here), and restarts nothing."""

from __future__ import annotations

from typing import Callable

from ..supervise import Launch, LaunchRequest, bound_python, rank_target
from . import LauncherOptions, LocalLauncher


class TorchrunLaunch(Launch):
    picks_own_port = True

    def _command(self, port: int) -> list[str]:
        req = self.request
        # --log-dir: torchrun's default is a fresh torchelastic_* folder in the system temp dir,
        # never removed; inside the launch's private folder it goes away with it.
        return [*bound_python(), "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(req.nproc), "--max-restarts", "0",
                "--monitor-interval", "0.1", "--log-dir", str(req.workdir / "torchrun"), *rank_target(req)]


class Torchrun(LocalLauncher):
    name = "torchrun"

    def start(self, request: LaunchRequest, on_rank: Callable[[int, int], None], options: LauncherOptions) -> Launch:
        return TorchrunLaunch(request, on_rank)
