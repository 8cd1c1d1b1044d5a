"""What the exact host figure costs a two-rank CPU launch (issue 29), side by side in one run.

    PYTHONPATH=. .venv-torch/bin/python benchmarks/host_cost.py OUT --python .venv-torch/bin/python \\
        --python .venv-oneflow/bin/python [--rounds 5]

For each framework (the interpreter given) and each job (a no-op: init, one collective, end; and the
DDP example's job: examples/test_torch_ddp.py's model and batch, examples/test_oneflow_eager_dp.py's
for OneFlow), imported at the top of the test module as the examples do, one two-rank launch is
timed. torch's DDP job runs twice: ``ddp``, whose constructor imports ``torch._dynamo`` lazily, in the
body (~820 modules, tracked at every launch), as examples/test_torch_ddp.py does, and ``ddp_top``,
whose test module imports it at its top (at collection: in the start-up, measured once; such a job
deadlocks at its end more often, benchmarks/gloo_teardown_deadlock.py). Modes:

- ``bare``: the two ranks spawned directly (the direct launcher's env contract), no pytest;
- ``pytest``: pytest's own start-up and exit, one plain test in the same file (no --gpumem);
- ``untracked``: ``pytest --gpumem --gpumem-track-host=off`` (the host figure falls back to VmHWM);
- ``whole``: ``--gpumem-host-startup=tracked``: memray in each rank from its start (before this change);
- ``cold``: ``pytest --gpumem`` with an empty start-up cache: a probe launch tracks the ranks' start-up
  up to the test's setup, then the test's launch tracks from there (a first session);
- ``cached``: ``pytest --gpumem`` with the start-up cache filled: the test's launch only (later sessions).

Every launch uses the direct launcher and ``--gpumem-floor=off``. Rounds interleave (each round runs
every command once, in an order rotated per round); a warm-up round fills the page cache and the
start-up cache, and is not counted. Wall and CPU seconds (the CPU of the command and of every
process it waited for, which a shared machine moves less): median and range over the rounds.
Results: OUT/host_cost.txt (benchmarks/results/ keeps the committed one).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TORCH_JOBS = '''
import os
import torch
import torch.distributed as dist

LOCAL_BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 2048, 16384, 64, 10, 3  # examples/test_torch_ddp.py's job


def noop():
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def ddp():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(LOCAL_BATCH, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (LOCAL_BATCH,), generator=gen)
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


ddp_top = ddp  # the same job; its test module imports what DDP imports lazily (TOP_IMPORTS)
'''

ONEFLOW_JOBS = '''
import oneflow as flow

LOCAL_BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 2048, 16384, 64, 10, 3  # examples/test_oneflow_eager_dp.py's job


def noop():
    placement = flow.placement("cpu", ranks=list(range(flow.env.get_world_size())))
    t = flow.ones(1, placement=placement, sbp=flow.sbp.partial_sum)
    t.to_global(sbp=flow.sbp.broadcast).to_local().numpy()


def ddp():
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    split, bcast = flow.sbp.split(0), flow.sbp.broadcast
    model = flow.nn.Sequential(
        flow.nn.Linear(FEATURES, HIDDEN), flow.nn.ReLU(), flow.nn.Linear(HIDDEN, CLASSES)
    ).to_global(placement=placement, sbp=bcast)
    opt = flow.optim.SGD(model.parameters(), lr=0.01)
    x = flow.randn(LOCAL_BATCH * world, FEATURES, placement=placement, sbp=split)
    y = flow.randint(0, CLASSES, (LOCAL_BATCH * world,), placement=placement, sbp=split)
    for _ in range(STEPS):
        loss = flow.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    loss.to_global(sbp=bcast).to_local().item()
'''

JOBS = {"torch": ("noop", "ddp", "ddp_top"), "oneflow": ("noop", "ddp")}
# What a test module imports at its top besides the job. DDP's constructor reads torch._dynamo, a lazy
# attribute of torch, which imports the compiler stack and sympy (~820 modules, 1.3 s untracked): in
# the body, the tracker follows that import in every launch; at the top of the module it happens at
# collection, in the start-up that is measured once.
TOP_IMPORTS = {"ddp_top": "import torch._dynamo  # noqa: F401\n"}
MODES = ("bare", "pytest", "untracked", "whole", "cold", "cached")


def framework_of(python: str) -> str:
    code = "import importlib.util as u; print('torch' if u.find_spec('torch') else 'oneflow')"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def write_cases(folder: Path, framework: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "jobs.py").write_text(TORCH_JOBS if framework == "torch" else ONEFLOW_JOBS)
    for job in JOBS[framework]:
        top = TOP_IMPORTS.get(job, "")
        (folder / f"job_{job}.py").write_text(
            f"{top}from jobs import {job}\n\nif __name__ == '__main__':\n    {job}()\n")
        (folder / f"test_{job}.py").write_text(
            f"import pytest\n{top}\nfrom jobs import {job}\n\n\n"
            f"@pytest.mark.gpumem(nproc=2, timeout=300)\ndef test_{job}():\n"
            f"    {job}()\n\n\n"
            "def test_plain():\n    pass\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_bare(python: str, folder: Path, job: str, env: dict[str, str]) -> list[subprocess.Popen]:
    """The job's two ranks, spawned directly with the direct launcher's env contract (no pytest)."""
    port = str(free_port())
    return [subprocess.Popen([python, f"job_{job}.py"], cwd=folder, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                                  "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)]


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """(exit code, CPU seconds of the process and of every process it waited for)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.02)


def run_once(python: str, mode: str, job: str, folder: Path, env: dict[str, str]) -> tuple[float, float] | None:
    """(wall seconds, CPU seconds) of one launch (None: it failed)."""
    start = time.monotonic()
    if mode == "bare":
        procs = spawn_bare(python, folder, job, env)
        results = [_wait(p, 600) for p in procs]
        ok = all(code == 0 for code, _ in results)
        cpu = sum(c for _, c in results)
    else:
        args = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"test_{job}.py"]
        extra = dict(env)
        if mode == "pytest":
            args += ["-k", "test_plain"]
        else:
            args += ["--gpumem", "--gpumem-floor=off", "-k", f"test_{job}"]
        if mode == "untracked":
            args.append("--gpumem-track-host=off")
        if mode == "whole":
            args.append("--gpumem-host-startup=tracked")
        cache = folder / f"startups-{job}.json"
        if mode == "cold":
            cache = folder / "startups-cold.json"
            cache.unlink(missing_ok=True)
        extra["GPUMEM_STARTUP_CACHE"] = str(cache)
        log = folder / "last.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(args, cwd=folder, env=extra, stdout=sink, stderr=subprocess.STDOUT)
            code, cpu = _wait(proc, 900)
        ok = code == 0
        if not ok:
            sys.stderr.write(f"{mode} {job} failed:\n{log.read_text(errors='replace')[-3000:]}\n")
    wall = time.monotonic() - start
    return (wall, cpu) if ok else None


def _table(cases: list, times: dict, failures: dict, which: int) -> list[str]:
    header = ("| framework | job | " + " | ".join(MODES) + " | whole / untracked | cold / untracked "
              "| cached / untracked | no-op cached / (bare + pytest) |")
    lines = [header, "|" + " --- |" * (len(MODES) + 6)]
    for framework in dict.fromkeys(c[0] for c in cases):
        for job in JOBS[framework]:
            got = {m: [t[which] for t in times.get((framework, job, m), [])] for m in MODES}
            med = {m: statistics.median(got[m]) if got[m] else None for m in MODES}
            cells = []
            for mode in MODES:
                cell = f"{med[mode]:.2f} [{min(got[mode]):.2f}-{max(got[mode]):.2f}]" if got[mode] else "-"
                if failures.get((framework, job, mode)):
                    cell += f" ({failures[(framework, job, mode)]} failed)"
                cells.append(cell)
            ratios = [f"{med[m] / med['untracked']:.2f}x" if med[m] and med["untracked"] else "-"
                      for m in ("whole", "cold", "cached")]
            base = (f"{med['cached'] / (med['bare'] + med['pytest']):.2f}x"
                    if job == "noop" and med["cached"] and med["bare"] and med["pytest"] else "")
            lines.append(f"| {framework} | {job} | " + " | ".join(cells + ratios) + f" | {base} |")
    return lines


def write_table(out: Path, cases: list, times: dict, failures: dict, rounds: int) -> str:
    lines = [f"# host_cost.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{platform.node()}, {os.cpu_count()} CPUs, {rounds} interleaved rounds after a warm-up "
             "(machine shared: read the ranges)",
             "# command: PYTHONPATH=. " + " ".join(["python", "benchmarks/host_cost.py", *sys.argv[1:]]),
             "# one two-rank launch, direct launcher, --gpumem-floor=off; median [min-max] over the rounds", "",
             "## wall seconds", ""]
    lines += _table(cases, times, failures, 0)
    lines += ["", "## CPU seconds (the command and every process it waited for: pytest and both ranks)", ""]
    lines += _table(cases, times, failures, 1)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (out / "host_cost.txt").write_text(text)
    print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--python", action="append", required=True, help="an interpreter with torch or OneFlow")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "PYTEST_ADDOPTS") and not k.startswith("GPUMEM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cases = []
    for python in map(os.path.abspath, args.python):  # the ranks run in the cases' folder; a venv's link kept
        framework = framework_of(python)
        folder = args.out / f"host_cost_{framework}"
        write_cases(folder, framework)
        cases += [(framework, python, job, mode, folder) for job in JOBS[framework] for mode in MODES]
    times: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    failures: dict[tuple[str, str, str], int] = {}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, not counted
        shift = round_ % len(MODES)  # each mode takes each place in the order in turn
        for framework in dict.fromkeys(c[0] for c in cases):
            for job in JOBS[framework]:
                block = [c for c in cases if c[0] == framework and c[2] == job]
                block = block[shift:] + block[:shift]
                for _, python, _, mode, folder in block:
                    measured = run_once(python, mode, job, folder, env)
                    if round_ == 0:
                        continue
                    key = (framework, job, mode)
                    if measured is None:
                        failures[key] = failures.get(key, 0) + 1
                    else:
                        times.setdefault(key, []).append(measured)
        print(f"round {round_} done", file=sys.stderr, flush=True)
        if round_:  # written after every round: a run stopped early still leaves what it measured
            write_table(args.out, cases, times, failures, round_)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
