"""What a gpumem test costs beside its job (issue 20): the bare job and the same job as a test, side by side.

    PYTHONPATH=.:/tmp/site python3 benchmarks/gpu_evidence.py OUT --parts speed [--runs 5] [--device cpu]
    .venv-torch/bin/python benchmarks/speed.py OUT [--runs 5] [--device cpu]       # the same, on its own

Cases: a trivial body (allocate MIB and return; at 2 ranks one collective first) and the DDP
example's job (examples/test_torch_ddp.py's model and batch, on the GPU with NCCL), each at one rank
(bare ``python3 job.py`` against a whole ``pytest --gpumem`` session of a one-test file) and at two
(bare ``torchrun --standalone --nproc-per-node 2 job.py`` against the plugin with launcher
"torchrun"). The job's code is the same text in both. The runs interleave (each round runs every
case once, bare and plugin taking turns first); a warm-up round fills the page cache and the floor
cache (its plugin session is the first one: it measures the floor) and is reported apart; the rest
give medians. Every process writes timestamps (a trace plugin, nothing in pytest_gpumem changes), and
the median of each step of rank 0's way through the session is printed below the ratios.

Without GPUs (or with ``--device cpu``) the same runs use gloo and host memory: a CPU result, where the
ranks track their host allocations (memray), since the host figure is then the gated one.
Results: OUT/gpu_speed.txt (or OUT/cpu_speed.txt); benchmarks/results/ keeps the committed ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BODY = '''
import json
import os
import time

import torch
import torch.distributed as dist

DEVICE = os.environ.get("SPEED_DEVICE", "cuda")  # cpu: host memory and gloo
MIB = int(os.environ.get("SPEED_MIB", "1536"))
LOCAL_BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 2048, 16384, 64, 10, 3  # examples/test_torch_ddp.py's job


def _mark(event):
    path = os.environ.get("SPEED_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), "rank": int(os.environ.get("RANK", "0"))}) + "\\n")


def _start():
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def trivial():
    """Allocate MIB on the device and return (at 2 ranks, one collective first)."""
    _mark("body_start")
    _start()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
        dist.all_reduce(torch.ones(1, device=DEVICE))
        dist.destroy_process_group()
    x = torch.ones(MIB * 2**20, dtype=torch.uint8, device=DEVICE)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    _mark("body_end")
    return x.numel()


def ddp():
    """examples/test_torch_ddp.py's healthy job: DDP over a 2-layer MLP, 3 steps on this rank's batch."""
    _mark("body_start")
    _start()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)).to(DEVICE))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(LOCAL_BATCH, FEATURES, generator=gen).to(DEVICE)
    y = torch.randint(0, CLASSES, (LOCAL_BATCH,), generator=gen).to(DEVICE)
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    value = loss.item()
    dist.barrier()
    dist.destroy_process_group()
    _mark("body_end")
    return value
'''

# Loaded in every pytest process (PYTEST_PLUGINS): the user's session and each rank's.
TRACE = '''
"""speed.py's timestamps: one JSON line per step, in SPEED_TRACE.

Loaded once per process: a forked rank finds it loaded by the pytest it was forked from, so where
it runs (the user's pytest or a rank) is asked at each call, not at import.
"""
import atexit, json, os, time
import pytest

_LOADED = time.time()
_LOADED_IN = os.getpid()


def _in_rank():
    return bool(os.environ.get("GPUMEM_WORKDIR"))


def mark(event, t=None, **extra):
    path = os.environ.get("SPEED_TRACE")
    if not path:
        return
    rank = os.environ.get("RANK")
    line = json.dumps({"event": event, "t": time.time() if t is None else t,
                       "rank": int(rank) if rank is not None and _in_rank() else None, **extra})
    with open(path, "a") as f:
        f.write(line + "\\n")


def _wrap(cls, name, before=None, after=None):
    original = getattr(cls, name, None)
    if original is None:  # the plugin changed shape: that step reads "-"
        return

    def wrapper(self, *args, **kwargs):
        if before:
            before(self, *args)
        try:
            return original(self, *args, **kwargs)
        finally:
            if after:
                after(self, *args)
    setattr(cls, name, wrapper)


def _files(self, spec, nproc, workdir, *rest):
    for kind in ("hello", "result", "exit"):
        try:
            mark("file_" + kind, t=(workdir / f"rank-0.{kind}").stat().st_mtime, rank=0)
        except OSError:
            pass


def _instrument():
    from pytest_gpumem.launching import floors, size_launch, supervise  # imported by the first gpumem test anyway

    _wrap(supervise.Launch, "run", before=lambda self: mark("launch_start"), after=lambda self: mark("launch_end"))
    for start in ("_spawn", "_fork"):  # an exec'd rank, or a forked one
        _wrap(supervise.Launch, start, after=lambda self, *a: mark("spawned"))
    _wrap(supervise.Launch, "_supervise", after=lambda self, *a: mark("exit_seen"))
    _wrap(floors.Floors, "with_floors", before=lambda self, *a: mark("floor_start"),
          after=lambda self, *a: mark("floor_end"))
    # a module's function: the wrapper's "self" is its first argument, the spec
    _wrap(size_launch, "read_size_run", before=lambda spec, nproc, workdir, *rest: _files(None, spec, nproc, workdir))


def pytest_addoption(parser):
    # a process that imported this module: when it did; a forked rank: when its pytest loads plugins
    if _in_rank():
        mark("rank_plugins", t=_LOADED if _LOADED_IN == os.getpid() else None)
    else:
        mark("parent_plugins", t=_LOADED)


def pytest_configure(config):
    if _in_rank():
        atexit.register(mark, "rank_atexit")


def pytest_sessionstart(session):
    mark("rank_sessionstart" if _in_rank() else "parent_sessionstart")


def pytest_collection_finish(session):
    mark("rank_collected" if _in_rank() else "parent_collected")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _in_rank():
        return (yield)
    mark("item_call_start")
    if not getattr(_instrument, "done", False):
        _instrument()
        _instrument.done = True
    try:
        return (yield)
    finally:
        mark("item_call_end")


def pytest_sessionfinish(session):
    mark("rank_sessionfinish" if _in_rank() else "parent_sessionfinish")
'''

PLUGIN_PHASES = [
    ("start", "parent_plugins", "parent: Python, import pytest, entry-point plugins"),
    ("parent_plugins", "parent_sessionstart", "parent: pytest configure (the plugin's settings)"),
    ("parent_sessionstart", "parent_collected", "parent: collection (imports the test module, torch with it)"),
    ("parent_collected", "launch_start", "parent: test set-up, NVML, GPU lease"),
    ("launch_start", "spawned", "parent: port, environment, Popen or fork"),
    ("spawned", "file_hello", "rank: launcher + Python (exec'd) + the rank wrapper (+ tracker start)"),
    ("file_hello", "rank_plugins", "rank: import pytest, entry-point plugins"),
    ("rank_plugins", "rank_sessionstart", "rank: pytest configure"),
    ("rank_sessionstart", "rank_collected", "rank: collection (imports the test module, torch with it)"),
    ("rank_collected", "body_start", "rank: fixtures, set-up"),
    ("body_start", "body_end", "rank: the body"),
    ("body_end", "rank_sessionfinish", "rank: teardown, reports"),
    ("rank_sessionfinish", "rank_atexit", "rank: pytest exit, frameworks' atexit"),
    ("rank_atexit", "file_exit", "rank: exit report (tracker stop and read, provenance)"),
    ("file_exit", "exit_seen", "rank: process end (launcher exit) + the parent's poll tick"),
    ("exit_seen", "launch_end", "parent: cleanup (signals, process scan)"),
    ("launch_end", "floor_start", "parent: samplers stop (NVML), read the ranks' files"),
    ("floor_start", "floor_end", "parent: floor (from the cache, or an empty launch)"),
    ("floor_end", "item_call_end", "parent: verdict, record"),
    ("item_call_end", "end", "parent: report, pytest exit"),
]
BARE_PHASES = [
    ("start", "body_start", "launcher + Python + imports (torch)"),
    ("body_start", "body_end", "the body"),
    ("body_end", "end", "exit"),
]
CASES = [("trivial", 1), ("ddp", 1), ("trivial", 2), ("ddp", 2)]


def absolute_pythonpath(env: dict[str, str], first: list[Path]) -> str:
    """PYTHONPATH for the children: our folders first, then each inherited entry made absolute
    (a relative '.' would mean the cases folder to a process started there)."""
    entries = [str(p) for p in first]
    for entry in (env.get("PYTHONPATH") or "").split(os.pathsep):
        if entry:
            entries.append(str(Path(entry).resolve()))
    return os.pathsep.join(dict.fromkeys(entries))


def plugin_installed() -> bool:
    return any(ep.name == "gpumem" for ep in entry_points(group="pytest11"))


def gpu_count() -> int:
    try:
        from pytest_gpumem.sampling.nvml import visible_gpus
    except ImportError:  # no nvidia-ml-py here: no GPUs either, for this purpose
        return 0
    return len(visible_gpus())


def case_name(case: str, nproc: int, device: str, mib: int) -> str:
    body = (f"trivial body ({mib} MiB on the {'GPU' if device == 'gpu' else 'host'})" if case == "trivial"
            else f"DDP example's job ({'NCCL' if device == 'gpu' else 'gloo'})")
    return f"{body}, {nproc} rank{'s' if nproc > 1 else ''}"


def write_cases(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")  # the rootdir: this folder, whatever is above it
    (folder / "speedtrace.py").write_text(TRACE)
    for case, nproc in CASES:
        (folder / f"job_{case}.py").write_text(BODY + f"\n\nif __name__ == '__main__':\n    {case}()\n")
        launcher = ', launcher="torchrun"' if nproc > 1 else ""
        (folder / f"test_{case}_{nproc}.py").write_text(
            BODY + f"\n\nimport pytest\n\n\n@pytest.mark.gpumem(nproc={nproc}{launcher}, timeout=300)\n"
                   f"def test_{case}():\n    {case}()\n")
        # The same test, importing the job (torch with it) in its body: pytest's own process then never
        # loads torch to collect it (the ranks do, in the body).
        (folder / f"test_{case}_{nproc}_lazy.py").write_text(
            f"import pytest\n\n\n@pytest.mark.gpumem(nproc={nproc}{launcher}, timeout=300)\n"
            f"def test_{case}():\n    from job_{case} import {case}\n\n    {case}()\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(kind: str, case: str, nproc: int) -> list[str]:
    if kind != "bare":
        lazy = "_lazy" if kind == "lazy" else ""
        return [sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-q",
                f"test_{case}_{nproc}{lazy}.py"]
    if nproc == 1:
        return [sys.executable, f"job_{case}.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            f"job_{case}.py"]


def run_once(kind: str, case: str, nproc: int, folder: Path, env: dict[str, str], trace: Path,
             timeout: float) -> tuple[float | None, float, dict[str, float], str]:
    """(wall seconds or None on failure, CPU seconds of the command and every process it waited for,
    rank 0's first time of each event, the output's tail)."""
    trace.unlink(missing_ok=True)
    extra = {"SPEED_TRACE": str(trace)}
    if kind == "bare" and nproc == 1:  # the same rendezvous variables the plugin's direct launcher sets
        extra.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                     LOCAL_RANK="0")
    log = trace.with_suffix(".log")
    with log.open("wb") as sink:
        start = time.time()
        t0 = time.monotonic()
        proc = subprocess.Popen(command(kind, case, nproc), cwd=folder, env={**env, **extra}, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        timer.cancel()
    events = {"start": start, "end": start + wall}
    for line in trace.read_text().splitlines() if trace.exists() else []:
        rec = json.loads(line)
        if rec.get("rank") in (None, 0):
            events.setdefault(rec["event"], rec["t"])
    ok = os.waitstatus_to_exitcode(status) == 0
    return (wall if ok else None), usage.ru_utime + usage.ru_stime, events, log.read_text(errors="replace")[-2000:]


def secs(value: float | None) -> str:
    return "failed" if value is None else f"{value:.2f} s"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def speed(folder: Path, out: Path, runs: int = 5, device: str = "auto", timeout: float = 300.0,
          base: Path | None = None, budget_s: float = 400.0, sites_off: bool = False,
          lazy: bool = False, start_exec: bool = False) -> list[str]:
    """The part: run every case ``runs`` times (after a warm-up round), write and return the lines.

    ``base``: another checkout of pytest-gpumem (say main, before a change), measured alongside as a
    third command in the same rounds, so one run compares before and after under the same load.
    ``budget_s``: no round starts that would end past it (the GPU machines stop a command at 10
    minutes); the lines say how many rounds were measured.
    """
    asked = device
    gpus = gpu_count() if device != "cpu" else 0
    if device == "gpu" and gpus == 0:
        return ["speed: --device gpu, but no GPU is visible here"]
    device = "gpu" if gpus else "cpu"
    mib = 1536 if device == "gpu" else 256  # host memory on a shared CPU machine: less
    folder = folder / "speed"
    write_cases(folder)
    # As a normal install runs: bytecode written (a warm-up round writes it), no CI, no gpumem settings.
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS") and not k.startswith("GPUMEM_")}
    plugins = ["speedtrace"] + ([] if plugin_installed() else ["pytest_gpumem.plugin"])
    env.update(PYTEST_PLUGINS=",".join(plugins), SPEED_DEVICE="cuda" if device == "gpu" else "cpu",
               SPEED_MIB=str(mib), OMP_NUM_THREADS="1", GPUMEM_MISSING_BASELINE="ignore")
    roots = {"bare": ROOT, "plugin": ROOT, **({"base": base.resolve()} if base is not None else {}),
             **({"nosites": ROOT} if sites_off else {}), **({"lazy": ROOT} if lazy else {}),
             **({"exec": ROOT} if start_exec else {})}
    envs = {}
    for kind, root in roots.items():
        floors = out / f"speed-floors-{kind}.json"
        floors.unlink(missing_ok=True)  # the warm-up round is a first session
        envs[kind] = {**env, "PYTHONPATH": absolute_pythonpath(env, [root, folder]), "GPUMEM_FLOOR_CACHE": str(floors)}
        if kind == "nosites":  # the same plugin with no peak sites: what recording them costs
            envs[kind]["GPUMEM_SITES"] = "0"
        if kind == "exec":  # the same plugin, its ranks exec'd: what forking them saves
            envs[kind]["GPUMEM_START"] = "exec"
    kinds = list(roots)
    cases = [(c, n) for c, n in CASES if n <= max(gpus, 1) or device == "cpu"]
    skipped = [(c, n) for c, n in CASES if (c, n) not in cases]
    walls: dict[tuple[str, str, int], list[float]] = {}
    cpus: dict[tuple[str, str, int], list[float]] = {}
    first: dict[tuple[str, str, int], float | None] = {}
    steps: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    failures: list[str] = []
    trace = out / "speed-trace.jsonl"
    t_start = time.monotonic()
    done = 0
    for round_ in range(runs + 1):  # round 0: the warm-up
        elapsed = time.monotonic() - t_start
        if round_ >= 2 and elapsed + elapsed / round_ > budget_s:
            print(f"[speed] stopping after {done} measured rounds: the next would end past {budget_s:g} s")
            break
        for i, (case, nproc) in enumerate(cases):
            turn = (round_ + i) % len(kinds)  # who goes first changes every time
            for kind in kinds[turn:] + kinds[:turn]:
                wall, cpu, events, tail = run_once(kind, case, nproc, folder, envs[kind], trace, timeout)
                if wall is None:
                    failures.append(f"{kind} {case} nproc={nproc} round {round_}: {tail}")
                if round_ == 0:
                    first[(kind, case, nproc)] = wall
                    continue
                if wall is not None:
                    walls.setdefault((kind, case, nproc), []).append(wall)
                    cpus.setdefault((kind, case, nproc), []).append(cpu)
                    table = BARE_PHASES if kind == "bare" else PLUGIN_PHASES
                    rows = steps.setdefault((kind, case, nproc), {})
                    for a, b, label in table:
                        if a in events and b in events:
                            rows.setdefault(label, []).append(events[b] - events[a])
        done = round_
        print(f"[speed] round {round_}/{runs} done, {time.monotonic() - t_start:.0f} s", flush=True)

    import torch

    import pytest_gpumem

    med = statistics.median
    names = {"plugin": f"pytest-gpumem {pytest_gpumem.__version__}", "base": "pytest-gpumem at BASE (before)",
             "nosites": f"pytest-gpumem {pytest_gpumem.__version__} with --gpumem-sites=off",
             "lazy": f"pytest-gpumem {pytest_gpumem.__version__}, the test importing the job in its body",
             "exec": f"pytest-gpumem {pytest_gpumem.__version__} with --gpumem-start=exec (ranks exec'd)"}
    lines = [f"speed: the bare job vs the same job as a pytest-gpumem test, {device.upper()} "
             f"({gpus} GPU{'s' if gpus != 1 else ''} visible), {datetime.date.today().isoformat()}",
             f"  Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
             f"load average {os.getloadavg()[0]:.1f} at the end; medians of {done} interleaved rounds after a "
             "warm-up round (min-max); wall time of the whole command, and its CPU time (user + system, with every "
             "process it waited for) beside it"
             + (f"; {done} of the {runs} rounds asked for: the time budget of {budget_s:g} s ran out"
                if done < runs else ""),
             f"  command: python3 benchmarks/gpu_evidence.py OUT --parts speed --runs {runs}"
             + (f" --device {asked}" if asked != "auto" else "") + (" --base BASE" if base is not None else "")
             + (" --sites-off" if sites_off else "") + (" --lazy-import" if lazy else "")
             + (" --start-exec" if start_exec else "")]
    for case, nproc in CASES:
        name = case_name(case, nproc, device, mib)
        if (case, nproc) in skipped:
            lines.append(f"  {name}: skipped: {gpus} GPU{'s' if gpus != 1 else ''} here, the case needs {nproc}")
            continue
        bare = walls.get(("bare", case, nproc))
        bare_cmd = "python3 job.py" if nproc == 1 else f"torchrun --standalone --nproc-per-node {nproc} job.py"
        how = "pytest --gpumem" + (", launcher torchrun" if nproc > 1 else "")
        for kind in kinds[1:]:
            ours = walls.get((kind, case, nproc))
            if not bare or not ours:
                lines.append(f"  {name}: {names[kind]}: no successful run to compare (failures below)")
                continue
            cpu_bare, cpu_ours = med(cpus[("bare", case, nproc)]), med(cpus[(kind, case, nproc)])
            lines.append(f"  {name}: bare `{bare_cmd}` {med(bare):.2f} s ({min(bare):.2f}-{max(bare):.2f}, "
                         f"CPU {cpu_bare:.2f} s); {names[kind]} (`{how}`) {med(ours):.2f} s "
                         f"({min(ours):.2f}-{max(ours):.2f}, CPU {cpu_ours:.2f} s): {med(ours) / med(bare):.2f}x")
    for kind in kinds[1:]:
        lines.append(f"  first session of {names[kind]} (the warm-up round, an empty floor cache"
                     + (": the floor is launched where the cache lacks it" if device == "gpu" else
                        "; host figures show no floor") + "): "
                     + ", ".join(f"{c} nproc={n} {secs(first.get((kind, c, n)))}" for c, n in cases))
    lines.append("")
    lines.append(f"where the time goes, rank 0's way through one session (median ms over {done} rounds"
                 + ("; before -> after" if base is not None else "") + ")")
    if len(kinds) > 2:
        lines.append("  columns, left to right: " + " -> ".join(names[kind] for kind in reversed(kinds[1:])))
    for case, nproc in cases:
        bare = steps.get(("bare", case, nproc), {})
        lines.append(f"  {case_name(case, nproc, device, mib)}:")
        lines.append("    bare: " + "; ".join(f"{label} {ms(med(bare[label]) if bare.get(label) else None)}"
                                             for _, _, label in BARE_PHASES))
        for _, _, label in PLUGIN_PHASES:
            cells = [ms(med(rows[label]) if (rows := steps.get((kind, case, nproc), {})).get(label) else None)
                     for kind in reversed(kinds[1:])]
            lines.append(f"    {' -> '.join(f'{c:>6}' for c in cells)} ms  {label}")
    lines += [f"  failed: {f}" for f in failures]
    lines.append(f"  (the whole part took {time.monotonic() - t_start:.0f} s)")
    text = "\n".join(lines) + "\n"
    (out / f"{device}_speed.txt").write_text(text)
    print(text)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", type=int, default=5, help="measured rounds after the warm-up (default 5)")
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--base", type=Path, help="another checkout of pytest-gpumem, measured alongside (before)")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="start no round that would end past this many seconds (default 400)")
    parser.add_argument("--sites-off", action="store_true",
                        help="also measure the plugin with --gpumem-sites=off (what recording peak sites costs)")
    parser.add_argument("--start-exec", action="store_true",
                        help="also measure the plugin with --gpumem-start=exec (what forking the ranks saves)")
    parser.add_argument("--lazy-import", action="store_true",
                        help="also measure the test importing its job (torch) in its body, not at module level")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    speed(out / "cases", out, args.runs, args.device, base=args.base, budget_s=args.budget_s, sites_off=args.sites_off,
          lazy=args.lazy_import, start_exec=args.start_exec)


if __name__ == "__main__":
    main()
