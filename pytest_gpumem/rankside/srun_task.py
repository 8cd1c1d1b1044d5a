"""What ``srun`` starts on every node: ``python -m pytest_gpumem.rankside.srun_task PORT ADDRESSES RANK-ARGV...``.

One shim per Slurm task. It maps Slurm's variables to the env contract (``slurm_env.contract``),
checks that the launch folder is there (it must be on a file system every node shares), starts
the rank (``pytest_gpumem.rankside.rank``) as its child, and records in ``rank-N.task`` which node ran the
rank and how the rank ended, which the parent cannot learn otherwise: srun reports one exit status
for the whole step, and the rank may be on another host. A task that cannot start its rank says
why in one ``gpumem-srun:`` line on stdout, which srun carries back to the parent even when the
folder is not shared.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..config.env_names import WORKDIR_ENV
from . import protocol
from .slurm_env import SlurmEnvError, contract, parse_addresses

FOLDER_WAIT_ENV = "GPUMEM_SLURM_FOLDER_WAIT_S"
FOLDER_WAIT_S = 10.0  # a folder made a moment ago on the submit host may take a while to show on NFS
NOT_SHARED_EXIT = 3
LINE_PREFIX = "gpumem-srun:"


def say(**fields: object) -> None:
    """One line for the parent, through srun's output: ``gpumem-srun: {"rank": 2, ...}``."""
    print(LINE_PREFIX, json.dumps(fields, sort_keys=True), flush=True)


def _wait_for(folder: Path) -> bool:
    end = time.monotonic() + float(os.environ.get(FOLDER_WAIT_ENV) or FOLDER_WAIT_S)
    while not folder.is_dir():
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        raise SystemExit("usage: python -m pytest_gpumem.rankside.srun_task PORT ADDRESSES RANK-ARGV...")
    port, addresses, rank_argv = int(argv[0]), parse_addresses(argv[1]), argv[2:]
    env = dict(os.environ)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        env.update(contract(env, port, addresses))
    except SlurmEnvError as exc:
        say(rank=env.get("SLURM_PROCID"), node=node, event="bad-environment", detail=str(exc))
        return 2
    rank = int(env["RANK"])
    facts = {"rank": rank, "node": node, "host": socket.gethostname(), "master": env["MASTER_ADDR"]}
    workdir = Path(env[WORKDIR_ENV])
    if not _wait_for(workdir):
        say(**facts, event="folder-missing", folder=str(workdir))
        return NOT_SHARED_EXIT

    proc = subprocess.Popen([sys.executable, "-m", "pytest_gpumem.rankside.rank", *rank_argv], env=env)
    protocol.write_task(workdir, rank, {**facts, "pid": proc.pid, "returncode": None})

    def forward(signum: int, _frame: object) -> None:  # scancel signals the whole step; srun may signal us alone
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    # SIGUSR1 (a stack dump before a timeout) is for the rank; Slurm sends it to us too.
    signal.signal(signal.SIGUSR1, lambda *_: None)
    code = proc.wait()
    protocol.write_task(workdir, rank, {**facts, "pid": proc.pid, "returncode": code})
    if code < 0:  # end the way the rank ended, so srun reports "task 2: Killed" as it would have
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
