"""``launcher="direct"``: we start every rank ourselves, exec'd or forked from pytest, each in a
session of its own with the environment contract (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK) set: no launcher's start-up cost, an exit code per rank, and a simulated world."""

from __future__ import annotations

import sys
from typing import Callable, Mapping

from ...rankside import protocol
from .. import forking
from ..supervise import Launch, LaunchRequest, LaunchResult, describe_returncode, direct_env, rank_target, simulated_env
from . import LauncherOptions, LocalLauncher


class DirectLaunch(Launch):
    per_rank = True

    def _command(self, port: int) -> list[str]:
        return [sys.executable, *rank_target(self.request)]

    def _start_ranks(self, command: list[str], env: Mapping[str, str], port: int) -> tuple[str, str | None]:
        req = self.request
        refusal = forking.refusal(env) if req.start == "fork" else None
        start = req.start if req.start in ("fork", "serve") and refusal is None else "exec"
        # Each rank writes into its own log from its first byte: a rank that dies before
        # the plugin's rank code runs (it cannot import it, say) still leaves its traceback.
        for rank in range(req.nproc):
            rank_env = direct_env(env, rank, req.nproc, port)
            if req.simulated:
                rank_env.update(simulated_env(rank, req))
            log = protocol.rank_file(req.workdir, rank, "log")
            if start == "serve":
                refusal = self._serve(rank_env, log)
                if refusal is None:
                    continue
                start = "exec" if rank == 0 else start  # the server would not: this rank (and those after) exec'd
                self._spawn(command, rank_env, log)
            elif start == "fork":
                self._fork(rank_env, log)
            elif start == "exec":
                self._spawn(command, rank_env, log)
        return start, refusal


class Direct(LocalLauncher):
    name = "direct"
    per_rank = True

    def start(self, request: LaunchRequest, on_rank: Callable[[int, int], None], options: LauncherOptions) -> Launch:
        return DirectLaunch(request, on_rank)

    def exit_text(self, launch: LaunchResult, rank: int) -> str:
        return describe_returncode(launch.returncodes.get(rank))
