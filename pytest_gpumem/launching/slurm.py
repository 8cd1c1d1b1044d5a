"""``launcher="srun"``: the ranks as one Slurm job step, across the nodes of the allocation.

pytest runs inside an allocation (``salloc`` or an ``sbatch`` script); each launch is
``srun --ntasks=N [--nodes=K]`` with a task shim (``srun_task``) on every node. What differs from
the local launchers, and why:

- The ranks may be on other hosts, so their PIDs mean nothing here: no PID is sampled, signalled
  or scanned. Each rank reports its own peak in its ``exit`` file; the stack dump before a
  timeout is ``scancel --signal=USR1``, and ending the launch is ``scancel`` of the step, then
  a check that Slurm no longer lists it.
- The rank files travel through a folder every node sees: ``$SLURM_SUBMIT_DIR/.gpumem-slurm`` by
  default, ``--gpumem-slurm-dir`` otherwise.
- GPUs are Slurm's to give (``--gpus-per-task``, gres: ``--gpumem-srun-args``); the local lease
  files are not used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

import psutil

from ..config.spec import Spec
from ..rankside import protocol
from ..rankside.slurm_env import expand_hostlist, format_addresses
from ..rankside.srun_task import LINE_PREFIX, NOT_SHARED_EXIT
from .gpus import GpuPlan
from .launchers import LauncherOptions
from .ports import PortLease
from .supervise import STACK_DUMP_WAIT_S, Exits, Launch, LaunchRequest, read_stacks

SHARED_SUBDIR = ".gpumem-slurm"
_CANCEL_GRACE_S = 3.0     # SIGTERM to the step, then SIGKILL: the same grace as a local launch
_STEP_GONE_WAIT_S = 60.0  # Slurm's own KillWait and epilog may take a while on a busy cluster
_SLURM_CMD_TIMEOUT_S = 30.0
_HOW_TO_RUN = ("run pytest inside a Slurm allocation, e.g. `salloc -N2 -n4 pytest --gpumem ...`, "
               "or from an sbatch script (docs/cluster.md)")


def not_in_allocation(env: Mapping[str, str] = os.environ) -> str | None:
    """Why an srun launch cannot run here, or None when it can."""
    if shutil.which("srun", path=env.get("PATH")) is None:
        return f"launcher='srun' needs Slurm's srun on PATH, and there is none: {_HOW_TO_RUN}"
    if not env.get("SLURM_JOB_ID"):
        return f"launcher='srun' needs a Slurm allocation (SLURM_JOB_ID is not set): {_HOW_TO_RUN}"
    return None


def bound_gpus(spec: Spec, nproc: int, env: Mapping[str, str] = os.environ) -> GpuPlan:
    """What stands in for the local GPU planner: no leases, Slurm binds the GPUs."""
    reason = not_in_allocation(env)
    if reason is not None:
        return GpuPlan(skip_reason=reason)
    # GPU figures, where the ranks have GPUs, come from the NVML sampler inside each rank.
    return GpuPlan()


def shared_root(options: LauncherOptions, env: Mapping[str, str] = os.environ) -> Path:
    if options.shared_dir is not None:
        return options.shared_dir
    return Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd()) / SHARED_SUBDIR


def shared_workdir(options: LauncherOptions, env: Mapping[str, str] = os.environ) -> Path:
    """The launch's private folder, inside the folder every node sees."""
    root = shared_root(options, env)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"gpumem_slurm_dir {str(root)!r} cannot be created ({exc.strerror or exc}); "
                      "expected a folder on a file system every node of the allocation shares") from None
    return Path(tempfile.mkdtemp(prefix="gpumem-", dir=root))


def effective_nodes(nnodes: int | None, nproc: int) -> int | None:
    """``nnodes=2`` spreads 2 and 4 ranks over two nodes, and puts 1 rank on one node."""
    return None if nnodes is None else min(nnodes, nproc)


def node_addresses(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """NodeName -> NodeAddr for the allocation's nodes whose name is not their address.

    Usually empty: on most clusters a node's name is its host name. One ``scontrol`` call per
    launch, made here rather than in every task.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return {}
    try:
        out = subprocess.run(["scontrol", "show", "node", "--oneliner", nodelist], capture_output=True,
                             text=True, timeout=_SLURM_CMD_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        name, addr = fields.get("NodeName"), fields.get("NodeAddr")
        if name and addr and addr != name and name in expand_hostlist(nodelist):
            found[name] = addr
    return found


def srun_command(request: LaunchRequest, port: int, step_name: str, options: LauncherOptions,
                 addresses: Mapping[str, str]) -> list[str]:
    nodes = effective_nodes(request.nnodes if request.nnodes is not None else options.nnodes, request.nproc)
    srun = shutil.which("srun") or "srun"
    command = [sys.executable, "-m", "pytest_gpumem.rankside.rank", "exec",  # srun dies with pytest; Slurm
               srun, f"--job-name={step_name}",                     # then ends the step
               f"--ntasks={request.nproc}",
               # Our own fail-fast gives the other ranks gpumem_fail_fast_grace to report, as in a local launch.
               "--kill-on-bad-exit=0",
               f"--chdir={request.cwd}"]
    if nodes is not None:
        command.append(f"--nodes={nodes}")
    command += list(options.srun_args)
    command += [sys.executable, "-m", "pytest_gpumem.rankside.srun_task", str(port), format_addresses(addresses),
                *request.rank_argv]
    return command


class SrunLaunch(Launch):
    """A :class:`Launch` whose ranks are the tasks of one job step, possibly on other hosts."""

    def __init__(self, request: LaunchRequest, on_rank: Callable[[int, int], None],
                 options: LauncherOptions, env: Mapping[str, str] = os.environ) -> None:
        super().__init__(request, on_rank)
        self.options = options
        self.job_id = env["SLURM_JOB_ID"]
        self.step_name = f"gpumem-{self.launch_id[:12]}"
        self._addresses = node_addresses(env)
        self._problems: list[str] = []

    # --- what Launch.run calls ---------------------------------------------------------------
    def _command(self, port: int) -> list[str]:
        return srun_command(self.request, port, self.step_name, self.options, self._addresses)

    def _lease_port(self) -> tuple[PortLease | None, str | None]:
        """Rank 0 binds the port on its own node: a lease on this host would not hold it there."""
        return None, None

    def _watch_rank(self, pid: int) -> None:
        """The PID is on the rank's own host: never signalled, sampled or scanned from here."""

    def _rank_reported_failure(self) -> bool:
        if super()._rank_reported_failure():
            return True
        return any(code not in (None, 0) for code in self._task_codes().values())

    def _ended_ranks(self, codes: list[int | None]) -> set[int]:
        """The tasks that ended: their shim wrote the exit status (the PIDs are on other hosts)."""
        return {rank for rank, code in self._task_codes().items() if code is not None}

    def _dump_stacks(self) -> dict[int, str]:
        """Every rank's Python stacks before a hung step is cancelled (faulthandler on SIGUSR1)."""
        step = self._step_id()
        if step is None:
            return {}
        _run(["scancel", "--signal=USR1", step])
        time.sleep(STACK_DUMP_WAIT_S)
        return read_stacks(self.request.workdir, range(self.request.nproc))

    def _cleanup(self) -> list[int]:
        """scancel the step (SIGTERM, then SIGKILL), then end srun here; report a step Slurm
        still lists."""
        self._cancel_step()
        leftovers = super()._cleanup()
        self._cancel_step()  # srun may have created the step while we looked
        return leftovers

    def _strays(self) -> list[psutil.Process]:
        """The tasks are Slurm's: scancel ends them on every node, and this host cannot see the
        others. (A local scan here would also hide a step that scancel failed to end.)"""
        return []

    def _exit_codes(self, timed_out: bool) -> Exits:
        """Each task's exit code and node, as its shim wrote them (or srun's output said), and what
        went wrong with the step itself."""
        launcher_returncode = super()._exit_codes(timed_out).launcher_returncode
        tasks = self._tasks()
        lines = srun_lines(self.request.workdir / "launcher.log")
        nodes = {rank: str(t["node"]) for rank, t in tasks.items() if t.get("node")}
        for fields in lines:
            if isinstance(fields.get("rank"), int) and fields.get("node"):
                nodes.setdefault(fields["rank"], str(fields["node"]))
        problems = [*self._problems, *not_shared_problems(lines, self.request.workdir)]
        if not tasks and launcher_returncode not in (None, 0) and not timed_out and not problems:
            problems.append("no rank of the step started (srun's own output is below)")
        codes = {rank: t["returncode"] for rank, t in tasks.items() if t.get("returncode") is not None}
        return Exits(returncodes=codes, launcher_returncode=launcher_returncode, nodes=nodes, problems=tuple(problems))

    # --- Slurm ---------------------------------------------------------------------------------
    def _step_id(self) -> str | None:
        """``JOB.STEP`` of this launch's step, found by its name; None when Slurm lists none."""
        out = _run(["squeue", "--noheader", "--steps", f"--jobs={self.job_id}", "--format=%i %j"])
        for line in (out or "").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == self.step_name:
                return parts[0]
        return None

    def _cancel_step(self) -> None:
        """SIGTERM to every task of the step, 3 s, then ``scancel`` (SIGKILL for a step), and
        wait until Slurm no longer lists it: then no task is left on any node."""
        step = self._step_id()
        if step is None:
            return
        _run(["scancel", "--signal=TERM", step])
        if self._wait_gone(step, _CANCEL_GRACE_S):
            return
        _run(["scancel", step])
        if not self._wait_gone(step, _STEP_GONE_WAIT_S):
            self._problems.append(f"Slurm step {step} ({self.step_name}) is still listed "
                                  f"{_STEP_GONE_WAIT_S:g} s after scancel: check `squeue --steps`")

    def _wait_gone(self, step: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self._step_id() != step:
                return True
            time.sleep(0.2)
        return self._step_id() != step

    # --- what the tasks said ------------------------------------------------------------------
    def _tasks(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.request.nproc):
            task = protocol.read_task(self.request.workdir, rank)
            if task is not None:
                found[rank] = task
        return found

    def _task_codes(self) -> dict[int, int | None]:
        return {rank: task.get("returncode") for rank, task in self._tasks().items()}



def srun_lines(log: Path) -> list[dict]:
    """The task shims' ``gpumem-srun:`` lines in srun's output (they arrive without a shared folder)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        if line.startswith(LINE_PREFIX):
            try:
                found.append(json.loads(line[len(LINE_PREFIX):]))
            except ValueError:
                continue
    return found


def not_shared_problems(lines: list[dict], workdir: Path) -> list[str]:
    """What to say when tasks could not see the launch folder on their node."""
    missing = sorted({(f["rank"], f["node"]) for f in lines if f.get("event") == "folder-missing"})
    if not missing:
        return []
    who = ", ".join(f"rank {rank} on node {node}" for rank, node in missing)
    return [f"the launch folder {workdir} is not on a file system that every node shares: {who} "
            f"could not see it (task exit code {NOT_SHARED_EXIT}); set --gpumem-slurm-dir (or "
            f"GPUMEM_SLURM_DIR, gpumem_slurm_dir) to a folder every node mounts"]


def _run(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout
