"""How often a two-rank gloo DDP job deadlocks at its end, with ``torch._dynamo`` imported by DDP's
constructor (``ddp``) or at the top of the module (``ddp_top``): benchmarks/host_cost.py's jobs,
spawned bare (no pytest, no plugin), one launch after another.

A launch still running after ``--timeout`` seconds is counted as hung; each live rank's threads are
dumped with gdb (``thread apply all bt``) into OUT before it is killed.

    PYTHONPATH=. .venv-torch/bin/python benchmarks/gloo_teardown_deadlock.py OUT --python .venv-torch/bin/python \\
        [--launches 25] [--job ddp --job ddp_top]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_cost import spawn_bare, write_cases  # noqa: E402


def launch(python: str, folder: Path, job: str, timeout: float, dump: Path) -> str:
    """'ok', 'failed' or 'hung' (the live ranks' stacks written to ``dump``-<rank>.gdb)."""
    procs = spawn_bare(python, folder, job, dict(os.environ))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for rank in alive:
        if shutil.which("gdb"):
            stacks = subprocess.run(["gdb", "-p", str(procs[rank].pid), "-batch", "-ex", "thread apply all bt 30"],
                                    capture_output=True, text=True).stdout
            dump.with_name(f"{dump.name}-rank{rank}.gdb").write_text(stacks)
    for p in procs:
        p.kill()
        p.wait()
    if alive:
        return "hung"
    return "ok" if all(p.returncode == 0 for p in procs) else "failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--python", required=True, help="an interpreter with torch")
    parser.add_argument("--launches", type=int, default=25)
    parser.add_argument("--job", action="append", choices=("ddp", "ddp_top"))
    parser.add_argument("--timeout", type=float, default=90)
    args = parser.parse_args(argv)
    folder = args.out / "jobs"
    write_cases(folder, "torch")
    counts: dict[str, dict[str, int]] = {}
    for job in args.job or ["ddp", "ddp_top"]:
        counts[job] = {"ok": 0, "failed": 0, "hung": 0}
        for i in range(args.launches):
            outcome = launch(os.path.abspath(args.python), folder, job, args.timeout, args.out / f"{job}-{i}")
            counts[job][outcome] += 1
            print(f"{job} launch {i}: {outcome}", file=sys.stderr, flush=True)
    print(f"# gloo_teardown_deadlock.py --launches {args.launches}: two-rank gloo DDP launches, spawned bare")
    print("| job | launches | ok | failed | hung |")
    print("| --- | --- | --- | --- | --- |")
    for job, got in counts.items():
        print(f"| {job} | {sum(got.values())} | {got['ok']} | {got['failed']} | {got['hung']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
