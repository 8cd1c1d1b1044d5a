"""``launcher="oneflow"``: ``python -m oneflow.distributed.launch`` starts the ranks (its logs in
the launch folder). It answers a failed rank with ``killpg(getpid(), SIGTERM)``: the launch's own
session keeps that from reaching pytest."""

from __future__ import annotations

from typing import Callable

from ..supervise import Launch, LaunchRequest, bound_python, rank_target
from . import LauncherOptions, LocalLauncher


class OneflowLaunch(Launch):
    def _command(self, port: int) -> list[str]:
        req = self.request
        return [*bound_python(), "-m", "oneflow.distributed.launch",
                "--nproc_per_node", str(req.nproc), "--master_port", str(port),
                "--logdir", str(req.workdir / "log"), *rank_target(req)]


class Oneflow(LocalLauncher):
    name = "oneflow"
    framework = "oneflow"  # its ranks run OneFlow: a device="gpu" test without a GPU maps CUDA to the CPU

    def start(self, request: LaunchRequest, on_rank: Callable[[int, int], None], options: LauncherOptions) -> Launch:
        return OneflowLaunch(request, on_rank)
