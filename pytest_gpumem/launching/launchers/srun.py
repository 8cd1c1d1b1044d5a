"""``launcher="srun"``: the ranks as one Slurm job step across the allocation's nodes (the Slurm
plumbing and its launch: ``launching/slurm.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...config.spec import Spec
from .. import slurm
from ..gpus import GpuPlan
from ..supervise import Launch, LaunchRequest, LaunchResult, describe_returncode
from . import LauncherOptions


class Srun:
    name = "srun"
    per_rank = False
    remote = True  # PIDs on other hosts: never sampled here; each rank reports its own peaks

    def plan(self, spec: Spec, nproc: int) -> GpuPlan | None:
        return slurm.bound_gpus(spec, nproc)  # Slurm binds the GPUs; the local leases are for local launches

    def workdir(self, options: LauncherOptions) -> Path | None:
        return slurm.shared_workdir(options)  # on a file system that every node sees

    def start(self, request: LaunchRequest, on_rank: Callable[[int, int], None], options: LauncherOptions) -> Launch:
        return slurm.SrunLaunch(request, on_rank, options)

    def exit_text(self, launch: LaunchResult, rank: int) -> str:
        if rank in launch.returncodes:  # the task shim saw the rank end
            return describe_returncode(launch.returncodes[rank])
        return f"{self.name} launcher {describe_returncode(launch.launcher_returncode)}"
