"""CPU benchmarks of pytest-gpumem, side by side with the raw tools (issue #7, CPU half).

    .venv-oneflow/bin/python benchmarks/bench.py [--runs 10]     # OneFlow parts
    .venv-torch/bin/python benchmarks/bench.py [--runs 10]       # torch parts

It measures what the interpreter's frameworks allow (OneFlow, torch, or both) and prints a table last;
the output goes to benchmarks/results/cpu_bench.txt, one section per framework set, so running it in
both venvs fills one file.

1. launch: a no-op job (OneFlow: import + rendezvous + barrier; torch: gloo init, barrier, destroy)
   at 1, 2 and 4 ranks, through the plugin (each launcher) and, with no pytest at all, spawned by a
   minimal script (env contract set by hand) and run by the raw launcher. Medians over --runs,
   in a shuffled order so noise hits every configuration alike; runs over 5 s are counted as stalls.
   OneFlow also gets "direct spawn + rendezvous gate": the plugin's fix for its 10 s rendezvous retry
   (ranks > 0 wait for rank 0's port before OneFlow's env init).
   The plugin has two figures: the whole `pytest --gpumem` command (pytest's own start-up is paid
   once per session) and the per-launch time the plugin measured itself (report `duration_s`).
2. phases: where the time of one launch goes, plugin (direct) vs direct spawn, from timestamps
   taken inside the ranks and the parent (a trace plugin, nothing in pytest_gpumem is changed).
3. fidelity: plain-Python jobs that touch 64/256/1024 MiB for 2 ms .. 1 s; the reported peak
   against the same job with 0 MiB plus the size; next to it what 50 ms RSS polling saw and what
   the raw tool (the kernel's ru_maxrss through wait4, no pytest) says of the same body.
4. reuse: script-mode tests with the same launch parameters (the nproc=1 reference is reused) and
   controls: every rank start is counted by the rank program itself; expected vs actual.
5. sampler: CPU cost of the host sampler watching live ranks.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
STALL_S = 5.0
GOAL_RATIO = 1.10
CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID")

# The no-op jobs, identical in the plugin's test body and in the stand-alone script.
NOOP = {
    "oneflow": "import oneflow as flow\nflow.comm.barrier()\n",
    "torch": ("import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
              "dist.barrier()\ndist.destroy_process_group()\n"),
}
# Launchers through which each framework's job runs: plugin launcher -> raw launcher to compare with.
LAUNCHERS = {"oneflow": ("direct", "oneflow"), "torch": ("direct", "torchrun")}

TRACE_HEAD = ('import os as _os\n_trace = _os.environ.get("BENCH_TRACE")\n'
              'if _trace:\n    import benchtrace\n    benchtrace.mark("body_start")\n')
TRACE_TAIL = 'if _trace:\n    benchtrace.mark("body_end")\n'

GATE = '''"""A minimal spawn with the plugin's OneFlow rendezvous gate \
(pytest_gpumem.oneflow.rendezvous), nothing else."""
import runpy, sys
from pytest_gpumem.oneflow.rendezvous import install_oneflow_gate

install_oneflow_gate()
script = sys.argv[1]; sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''

# Loaded in every process of a traced run (PYTEST_PLUGINS=benchtrace; imported by the plain script).
BENCHTRACE = '''
"""bench.py's timestamps: mark() appends one JSON line; inside a rank, pytest's phases too."""
import atexit, json, os, time
_LOADED = time.time()
_RANK = os.environ.get("RANK")                 # None in the user's pytest and the bench itself
_IN_PLUGIN_RANK = bool(os.environ.get("GPUMEM_WORKDIR"))


def mark(event, t=None, **extra):
    line = json.dumps({"event": event, "t": time.time() if t is None else t, "pid": os.getpid(),
                       "rank": None if _RANK is None else int(_RANK), **extra})
    fd = os.open(os.environ["BENCH_TRACE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)


if _IN_PLUGIN_RANK:
    mark("rank_plugins_loaded", t=_LOADED)
    atexit.register(mark, "rank_atexit")   # runs before the rank wrapper's own exit report

    def pytest_sessionstart(session):
        mark("rank_sessionstart")

    def pytest_collection_finish(session):
        mark("rank_collected")

    def pytest_sessionfinish(session):
        mark("rank_sessionfinish")
'''

# Loaded in the user's pytest only (-p benchtrace_parent): wraps the launch's steps with marks.
BENCHTRACE_PARENT = '''
import pytest
from benchtrace import mark
from pytest_gpumem.launching import size_launch as _size_launch, supervise as _launch


def _wrap(cls, name, before=None, after=None):
    original = getattr(cls, name, None)
    if original is None:   # the plugin changed shape: that step's rows read "-"
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


_wrap(_launch.Launch, "run", before=lambda self: mark("launch_start", n=self.request.nproc),
      after=lambda self: mark("launch_end"))
_wrap(_launch.Launch, "_spawn", after=lambda self, *a: mark("spawned"))
_wrap(_launch.Launch, "_supervise", after=lambda self, *a: mark("exit_seen"))
_wrap(_launch.Launch, "_cleanup", before=lambda self: mark("cleanup_start"))


def _files(self, spec, nproc, workdir, *rest):
    for rank in range(nproc):
        for kind in ("hello", "result", "exit"):
            try:
                mark("file_" + kind, t=(workdir / f"rank-{rank}.{kind}").stat().st_mtime, file_rank=rank)
            except OSError:
                pass


# a module's function: the wrapper's "self" is its first argument, the spec
_wrap(_size_launch, "read_size_run", before=lambda spec, nproc, workdir, *rest: _files(None, spec, nproc, workdir))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    mark("item_call_start")
    try:
        return (yield)
    finally:
        mark("item_call_end")
'''


# --------------------------------------------------------------------------- helpers


def frameworks_here() -> list[str]:
    return [name for name in ("oneflow", "torch") if importlib.util.find_spec(name) is not None]


def oneflow_library_dirs() -> list[str]:
    """The cuDNN/cuBLAS wheel folders a pip OneFlow needs even on CPU (set by hand, as a user would)."""
    spec = importlib.util.find_spec("nvidia")
    dirs = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in ("cudnn", "cublas"):
            if (Path(root) / lib / "lib").is_dir():
                dirs.append(str(Path(root) / lib / "lib"))
    return dirs


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every job gets, plugin or not: no inherited launch contract, one thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in CONTRACT and not k.startswith(("PYTEST_", "GPUMEM_")) and k != "CI"}
    env["OMP_NUM_THREADS"] = "1"   # the plugin sets this for its ranks; the same for the others
    libs = oneflow_library_dirs() if importlib.util.find_spec("oneflow") else []
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cmd(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[float, int, str]:
    """Wall time, exit status and output of one command, in a session of its own (killed on timeout)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return time.monotonic() - t0, -999, out.decode(errors="replace")
    return time.monotonic() - t0, proc.returncode, out.decode(errors="replace")


def spawn_direct(script: Path, nproc: int, *, cwd: Path, env: dict[str, str], timeout: float,
                 gate: bool = False, trace: bool = False) -> tuple[float, int, str]:
    """The minimal direct launcher: N interpreters with MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK.

    ``gate`` runs each rank through rdzv_gate.py (the plugin's fix for OneFlow's 10 s rendezvous retry,
    measured as its own row).
    """
    port = free_port()
    t0 = time.monotonic()
    procs = []
    logs = []
    for rank in range(nproc):
        rank_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
        log = tempfile.TemporaryFile(dir=cwd)
        logs.append(log)
        argv = [sys.executable, str(cwd / "rdzv_gate.py"), str(script)] if gate else [sys.executable, str(script)]
        procs.append(subprocess.Popen(argv, cwd=cwd, env=rank_env,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        if trace:
            _mark(env, "spawned")
    deadline = t0 + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                _killpg(p.pid)
            codes.append(-999)
    wall = time.monotonic() - t0
    if trace:
        _mark(env, "exit_seen")
    for p in procs:
        if p.poll() is None:
            _killpg(p.pid)
            p.wait()
    out = ""
    if any(codes):
        for log in logs:
            log.seek(0)
            out += log.read().decode(errors="replace")[-2000:]
    for log in logs:
        log.close()
    return wall, next((c for c in codes if c), 0), out


def _mark(env: dict[str, str], event: str) -> None:
    with open(env["BENCH_TRACE"], "a") as f:
        f.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), "rank": None}) + "\n")


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or not den else f"{num / den:.2f}"


# --------------------------------------------------------------------------- 1. launch overhead


class Config:
    """One way of running the no-op job: plugin (launcher), spawn (direct / rank 0 first), raw launcher."""

    def __init__(self, fw: str, kind: str, launcher: str) -> None:
        self.fw, self.kind, self.launcher = fw, kind, launcher
        self.wall: dict[int, list[float]] = {}
        self.per_launch: dict[int, list[float]] = {}
        self.item: dict[int, list[float]] = {}
        self.failures: dict[int, list[str]] = {}

    @property
    def name(self) -> str:
        if self.kind == "plugin":
            return f"plugin ({self.launcher})"
        if self.kind == "spawn":
            return "direct spawn" if self.launcher == "direct" else "direct spawn + rendezvous gate"
        return f"raw {self.launcher}"

    def launch_times(self, n: int) -> list[float]:
        """What a stall is judged on: the per-launch time (the plugin's own figure for plugin runs)."""
        return self.per_launch.get(n, []) if self.kind == "plugin" else self.wall.get(n, [])

    def steady(self, n: int, figure: str = "launch") -> float | None:
        """Median over the runs without a stall (stalls are counted on their own)."""
        times = self.launch_times(n)
        values = {"launch": times, "wall": self.wall.get(n, []), "item": self.item.get(n, [])}[figure]
        keep = [v for v, t in zip(values, times) if t <= STALL_S]
        return med(keep)

    def runs_at(self, n: int) -> int:
        return len(self.launch_times(n))


def plugin_test_file(fw: str, sizes: list[int]) -> str:
    body = textwrap.indent(TRACE_HEAD + NOOP[fw] + TRACE_TAIL, "    ")
    out = ["import pytest\n"]
    for launcher in LAUNCHERS[fw]:
        for n in sizes:
            out.append(f"\n@pytest.mark.gpumem(nproc={n}, launcher={launcher!r}, max_ratio=None, timeout=300)\n"
                       f"def test_{launcher}_n{n}():\n{body}")
    return "".join(out)


def measure_plugin(cfg: Config, n: int, folder: Path, *, timeout: float, env_extra=None,
                   extra_args: tuple[str, ...] = ()) -> tuple[float, float | None, float | None, str]:
    report, junit = folder / "report.json", folder / "junit.xml"
    for path in (report, junit):
        path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-q",
           f"--gpumem-report={report}", f"--junitxml={junit}", *extra_args,
           f"test_launch_{cfg.fw}.py::test_{cfg.launcher}_n{n}"]
    env = base_env({"GPUMEM_MISSING_BASELINE": "ignore", **(env_extra or {})})
    env.pop("OMP_NUM_THREADS")   # the plugin's own default for its ranks is what we measure
    wall, code, out = run_cmd(cmd, cwd=folder, env=env, timeout=timeout)
    per_launch = item = None
    try:
        rec = json.loads(report.read_text())["tests"][0]
        per_launch = float(rec["sizes"][0]["duration_s"])
        if rec["status"] != "passed":
            code = code or 1
    except (OSError, ValueError, KeyError, IndexError):
        code = code or 1
    try:
        case = ET.parse(junit).getroot().find(".//testcase")
        item = float(case.get("time")) if case is not None else None
    except (OSError, ET.ParseError, TypeError, ValueError):
        pass
    return wall, per_launch, item, (out if code else "")


def measure(cfg: Config, n: int, folder: Path, timeout: float) -> tuple[str, float | None]:
    script = folder / f"noop_{cfg.fw}.py"
    if cfg.kind == "plugin":
        wall, per_launch, item, out = measure_plugin(cfg, n, folder, timeout=timeout)
        if out or per_launch is None:
            cfg.failures.setdefault(n, []).append(out[-1500:])
            return "FAILED", None
        cfg.wall.setdefault(n, []).append(wall)
        cfg.per_launch.setdefault(n, []).append(per_launch)
        if item is not None:
            cfg.item.setdefault(n, []).append(item)
        return f"{per_launch:.2f}/{wall:.2f}", per_launch
    env = base_env()
    if cfg.kind == "spawn":
        wall, code, out = spawn_direct(script, n, cwd=folder, env=env, timeout=timeout,
                                       gate=cfg.launcher == "gated")
    elif cfg.launcher == "oneflow":
        cmd = [sys.executable, "-m", "oneflow.distributed.launch", "--nproc_per_node", str(n),
               "--master_port", str(free_port()), str(script)]
        wall, code, out = run_cmd(cmd, cwd=folder, env=env, timeout=timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(script)]
        wall, code, out = run_cmd(cmd, cwd=folder, env=env, timeout=timeout)
    if code:
        cfg.failures.setdefault(n, []).append(out[-1500:])
        return "FAILED", None
    cfg.wall.setdefault(n, []).append(wall)
    return f"{wall:.2f}", wall


def launch_overhead(fw: str, args, folder: Path, say) -> list[Config]:
    (folder / f"test_launch_{fw}.py").write_text(plugin_test_file(fw, args.sizes))
    (folder / f"noop_{fw}.py").write_text(TRACE_HEAD + NOOP[fw] + TRACE_TAIL)
    plugin_launcher, raw_launcher = LAUNCHERS[fw]
    configs = [Config(fw, "plugin", plugin_launcher), Config(fw, "spawn", "direct"),
               Config(fw, "plugin", raw_launcher), Config(fw, "raw", raw_launcher)]
    if fw == "oneflow":
        configs.append(Config(fw, "spawn", "gated"))
        (folder / "rdzv_gate.py").write_text(GATE)
    say(f"[launch:{fw}] warm-up (not counted): one 1-rank run per configuration")
    for cfg in configs:
        measure(cfg, 1, folder, args.timeout)
        cfg.wall.clear(), cfg.per_launch.clear(), cfg.item.clear(), cfg.failures.clear()
    for run in range(max(args.runs, args.launcher_runs)):
        for n in args.sizes:
            order = [c for c in configs if not (c.launcher == "gated" and n == 1)
                     and run < (args.launcher_runs if c.launcher == raw_launcher else args.runs)]
            random.Random(f"{run}-{n}").shuffle(order)   # no configuration always runs right after another
            cells = []
            for cfg in order:
                text, _ = measure(cfg, n, folder, args.timeout)
                cells.append(f"{cfg.name} {text}")
            say(f"[launch:{fw}] run {run + 1} n={n}: " + "; ".join(cells))
    return configs


def spawn_reference(configs: list[Config], n: int) -> tuple[float | None, str]:
    """Stall-free median of the direct spawn at n ranks; when every direct spawn stalled (OneFlow at
    4 ranks), the gated spawn's (the same spawn, ranks > 0 held until rank 0 listens)."""
    spawn = next(c for c in configs if c.kind == "spawn" and c.launcher == "direct")
    gated = next((c for c in configs if c.launcher == "gated"), None)
    if spawn.steady(n) or gated is None or not gated.steady(n):
        return spawn.steady(n), "spawn"
    return gated.steady(n), "gated spawn"


def launch_lines(configs: list[Config], sizes: list[int]) -> list[str]:
    fw = configs[0].fw
    spawn = next(c for c in configs if c.kind == "spawn" and c.launcher == "direct")
    raw = next(c for c in configs if c.kind == "raw")
    lines = [f"launch overhead, no-op {fw} job: median seconds; a stall is a run over {STALL_S:g} s, counted on "
             "its own, and the ratios compare the stall-free medians.",
             "  plugin figures: per launch = the report's duration_s (spawn of the ranks to their exit), "
             "item = the test's JUnit time, command = the whole `pytest --gpumem` process.",
             f"  The goal (plugin / direct spawn <= {GOAL_RATIO:.2f}) is per launch: pytest's own start-up in the "
             "user's session is paid once a session, not per launch ('cmd/spawn' shows it anyway)."]
    footnote = False
    lines.append(f"  {'configuration':<31} {'n':>2} {'runs':>4} {'stalls':>6} {'fail':>4} {'all runs':>8} "
                 f"{'no stall':>8} {'item':>5} {'command':>7} {'/spawn':>6} {'cmd/spawn':>9} {'/raw launcher':>13}")
    for cfg in configs:
        for n in sizes:
            if not cfg.runs_at(n) and not cfg.failures.get(n):
                continue
            plugin = cfg.kind == "plugin"
            launch = cfg.steady(n)
            s, ref = spawn_reference(configs, n)
            if cfg is not spawn and ref != "spawn":
                footnote = True
            lines.append(
                f"  {cfg.name:<31} {n:>2} {cfg.runs_at(n):>4} {sum(t > STALL_S for t in cfg.launch_times(n)):>6} "
                f"{len(cfg.failures.get(n, [])):>4} {fmt_s(med(cfg.launch_times(n))):>8} {fmt_s(launch):>8} "
                f"{fmt_s(cfg.steady(n, 'item')) if plugin else '':>5} "
                f"{fmt_s(cfg.steady(n, 'wall')) if plugin else '':>7} "
                f"{fmt_ratio(launch, s) if cfg is not spawn else '':>6} "
                f"{fmt_ratio(cfg.steady(n, 'wall'), s) if plugin else '':>9} "
                f"{fmt_ratio(launch, raw.steady(n)) if cfg not in (spawn, raw) else '':>13}")
    if footnote:
        lines.append("  (at a size where every direct spawn stalled, '/spawn' compares with the gated spawn's "
                     "stall-free median)")
    for cfg in configs:
        for n, outs in sorted(cfg.failures.items()):
            lines.append(f"  {cfg.name} n={n}: {len(outs)} failed run(s); last output:")
            lines.extend("    " + line for line in outs[-1].strip().splitlines()[-8:])
    for cfg in configs:
        for n in sizes:
            slow = sorted(t for t in cfg.launch_times(n) if t > STALL_S)
            if slow:
                lines.append(f"  stalled runs of {cfg.name} n={n}: " + ", ".join(f"{t:.1f}" for t in slow) + " s")
    return lines


# --------------------------------------------------------------------------- 2. phases


PLUGIN_PHASES = [
    ("launch_start", "spawned", "parent: port, env, Popen of rank 0"),
    ("spawned", "file_hello", "rank: interpreter + pytest_gpumem.rankside.rank imports"),
    ("file_hello", "rank_plugins_loaded", "rank: import pytest + entry-point plugins"),
    ("rank_plugins_loaded", "rank_sessionstart", "rank: pytest config, ini, configure hooks"),
    ("rank_sessionstart", "rank_collected", "rank: collect the test module"),
    ("rank_collected", "body_start", "rank: run protocol, fixtures"),
    ("body_start", "body_end", "rank: the job body (framework + rendezvous)"),
    ("body_end", "rank_sessionfinish", "rank: teardown, reports"),
    ("rank_sessionfinish", "rank_atexit", "rank: pytest exit"),
    ("rank_atexit", "file_exit", "rank: exit report (VmHWM, provenance)"),
    ("file_exit", "exit_seen", "rank: interpreter teardown + parent's poll tick"),
    ("exit_seen", "launch_end", "parent: cleanup (signals, /proc scan)"),
    ("launch_end", "item_call_end", "parent: read results, verdict, record"),
]
SPAWN_PHASES = [
    ("spawned", "body_start", "rank: interpreter start"),
    ("body_start", "body_end", "rank: the job body (framework + rendezvous)"),
    ("body_end", "exit_seen", "rank: interpreter teardown + wait()"),
]


def phases(fw: str, args, folder: Path, say) -> list[str]:
    """Timestamps of rank 0's way through one launch, plugin (direct) vs direct spawn."""
    (folder / "benchtrace.py").write_text(BENCHTRACE)
    (folder / "benchtrace_parent.py").write_text(BENCHTRACE_PARENT)
    trace = folder / "trace.jsonl"
    runs = max(1, min(args.runs, args.phase_runs))
    plugin_rows: dict[int, dict[str, list[float]]] = {}
    spawn_rows: dict[int, dict[str, list[float]]] = {}
    totals: dict[tuple[str, int], list[float]] = {}
    sizes = [n for n in args.sizes if n <= 2] or args.sizes[:1]
    for run in range(runs + 1):   # run 0 warms the caches and is not counted
        for n in sizes:
            for kind in ("plugin", "spawn"):
                trace.unlink(missing_ok=True)
                extra = {"BENCH_TRACE": str(trace), "PYTHONPATH": str(folder), "PYTEST_PLUGINS": "benchtrace"}
                if kind == "plugin":
                    cfg = Config(fw, "plugin", "direct")
                    _, per_launch, _, out = measure_plugin(cfg, n, folder, timeout=args.timeout, env_extra=extra,
                                                           extra_args=("-p", "benchtrace_parent"))
                    ok = per_launch is not None and not out
                else:
                    env = base_env({"BENCH_TRACE": str(trace), "PYTHONPATH": str(folder)})
                    wall, code, out = spawn_direct(folder / f"noop_{fw}.py", n, cwd=folder, env=env,
                                                   timeout=args.timeout, trace=True)
                    ok = code == 0
                if not ok:
                    say(f"[phases:{fw}] {kind} n={n} failed: {out[-500:]}")
                    continue
                events = _rank0_events(trace)
                if run == 0:
                    continue
                table = PLUGIN_PHASES if kind == "plugin" else SPAWN_PHASES
                rows = (plugin_rows if kind == "plugin" else spawn_rows).setdefault(n, {})
                for start, end, label in table:
                    if start in events and end in events:
                        rows.setdefault(label, []).append(events[end] - events[start])
                first = "launch_start" if kind == "plugin" else "spawned"
                last = "item_call_end" if kind == "plugin" else "exit_seen"
                if first in events and last in events:
                    totals.setdefault((kind, n), []).append(events[last] - events[first])
        if run:
            say(f"[phases:{fw}] run {run}/{runs} done")
    lines = [f"where the time of one launch goes, no-op {fw} job, rank 0's timeline "
             f"(median ms over {runs} runs; each row is one step, consecutive):"]
    for n in sizes:
        for kind, rows, table in (("plugin (direct)", plugin_rows.get(n, {}), PLUGIN_PHASES),
                                  ("direct spawn", spawn_rows.get(n, {}), SPAWN_PHASES)):
            total = med(totals.get(("plugin" if kind.startswith("plugin") else "spawn", n), []))
            lines.append(f"  {kind}, n={n}: total {fmt_ms(total)} ms")
            for _, _, label in table:
                lines.append(f"    {fmt_ms(med(rows.get(label, []))):>7} ms  {label}")
    return lines


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _rank0_events(trace: Path) -> dict[str, float]:
    """First time of each event of the parent and of rank 0 (file marks: rank 0's files)."""
    events: dict[str, float] = {}
    try:
        lines = trace.read_text().splitlines()
    except OSError:
        return events
    for line in lines:
        rec = json.loads(line)
        if rec.get("rank") not in (None, 0) or rec.get("file_rank") not in (None, 0):
            continue
        events.setdefault(rec["event"], rec["t"])
    return events


# --------------------------------------------------------------------------- 3. fidelity


HOLD = '''
import os, sys, time
MiB = 1024 * 1024


def hold(mib, ms):
    """Allocate ``mib`` MiB, write every page, keep it ``ms`` ms, free it."""
    buf = bytearray(mib * MiB)                       # zero-filled: every page written once
    buf[::4096] = b"\\1" * len(range(0, len(buf), 4096))   # and once more, to be sure
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        time.sleep(max(0.0, min(0.001, end - time.perf_counter())))
    del buf
'''


def fidelity(args, folder: Path, say) -> tuple[list[str], dict]:
    sizes_mib = [0] + args.fid_mib
    durations = args.fid_ms
    (folder / "hold.py").write_text(HOLD)
    (folder / "test_fidelity.py").write_text(
        "import pytest\nfrom hold import hold\n\n"
        f"@pytest.mark.gpumem(nproc=1, max_ratio=None, timeout=120)\n"
        f"@pytest.mark.parametrize('ms', {durations!r})\n"
        f"@pytest.mark.parametrize('mib', {sizes_mib!r})\n"
        "def test_hold(mib, ms):\n    hold(mib, ms)\n")
    (folder / "hold_main.py").write_text(
        "import sys\nfrom hold import hold\nhold(int(sys.argv[1]), float(sys.argv[2]))\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])\n")
    report = folder / "fidelity.json"
    env = base_env({"GPUMEM_MISSING_BASELINE": "ignore", "PYTHONPATH": str(folder)})
    env.pop("OMP_NUM_THREADS")
    say("[fidelity] plugin: %d launches" % (len(sizes_mib) * len(durations)))
    wall, code, out = run_cmd([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-q",
                               f"--gpumem-report={report}", "test_fidelity.py"],
                              cwd=folder, env=env, timeout=args.timeout * 4)
    plugin: dict[tuple[int, float], dict] = {}
    try:
        for rec in json.loads(report.read_text())["tests"]:
            mib, ms = re.search(r"\[(\d+)-([\d.]+)\]", rec["test"]).groups()
            size = rec["sizes"][0]
            polled = [point.get("0") for _, point in size["timeline"] if point.get("0") is not None]
            plugin[(int(mib), float(ms))] = {"peak": size["ranks"]["0"], "method": size["methods"]["0"],
                                             "polled": max(polled) if polled else None}
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        return [f"host peak fidelity: plugin run failed ({exc}); exit {code}:", *out.splitlines()[-15:]], {}
    say("[fidelity] raw tool: the plain script (no pytest), its own VmHWM and wait4's ru_maxrss")
    raw: dict[tuple[int, float], float] = {}
    own: dict[tuple[int, float], float] = {}
    for mib in sizes_mib:
        for ms in durations:
            proc = subprocess.Popen([sys.executable, "hold_main.py", str(mib), str(ms)], cwd=folder, env=env,
                                    stdout=subprocess.PIPE)
            text = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            proc.stdout.close()
            raw[(mib, float(ms))] = usage.ru_maxrss / 1024   # KiB on Linux: what /usr/bin/time -v prints
            own[(mib, float(ms))] = float(text) / 1024
    base_p = [plugin[(0, float(ms))]["peak"] for ms in durations if (0, float(ms)) in plugin]
    base_r = [raw[(0, float(ms))] for ms in durations]
    base_o = [own[(0, float(ms))] for ms in durations]
    bp, br, bo = statistics.median(base_p), statistics.median(base_r), statistics.median(base_o)
    spread_p = max(base_p) - min(base_p)
    lines = ["host peak fidelity, nproc=1 plain-Python job (bytearray, every page written), "
             "expected = the same job with 0 MiB + size:",
             f"  0 MiB job: plugin {bp:.1f} MiB (spread {spread_p:.1f} MiB over {len(base_p)} durations); "
             f"the same body as a plain script: its own VmHWM {bo:.1f} MiB, wait4 ru_maxrss {br:.1f} MiB",
             "  (ru_maxrss, what `/usr/bin/time -v` reports, starts at the parent's peak across exec: "
             "this bench's own RSS here, so it errs by the difference on every row)",
             f"  {'MiB':>5} {'held':>6} {'plugin peak':>11} {'expected':>8} {'error':>7}  {'50 ms RSS polling saw':>21}"
             f"  {'script VmHWM err':>16} {'ru_maxrss err':>13}  method"]
    worst = raw_worst = 0.0
    polled_missed = 0
    for mib in args.fid_mib:
        for ms in durations:
            rec = plugin.get((mib, float(ms)))
            if rec is None:
                lines.append(f"  {mib:>5} {ms:>4g}ms  (no result)")
                worst = float("inf")
                continue
            err = rec["peak"] - (bp + mib)
            raw_err = raw[(mib, float(ms))] - (br + mib)
            own_err = own[(mib, float(ms))] - (bo + mib)
            worst = max(worst, abs(err))
            polled = rec["polled"]
            if polled is None or polled < bp + mib - max(1.0, spread_p):
                polled_missed += 1
            lines.append(f"  {mib:>5} {ms:>4g}ms {rec['peak']:>11.1f} {bp + mib:>8.1f} {err:>+7.1f}  "
                         f"{'-' if polled is None else f'{polled:.1f}':>21}  "
                         f"{own_err:>+16.1f} {raw_err:>+13.1f}  {rec['method']}")
            raw_worst = max(raw_worst, abs(raw_err))
    tolerance = max(1.0, spread_p)
    lines.append(f"  worst |error| {worst:.1f} MiB (tolerance: the baseline's own spread, at least 1 MiB = "
                 f"{tolerance:.1f} MiB); 50 ms RSS polling under-read {polled_missed} of "
                 f"{len(args.fid_mib) * len(durations)} allocations")
    return lines, {"worst": worst, "tolerance": tolerance, "polled_missed": polled_missed, "raw_worst": raw_worst,
                   "cells": len(args.fid_mib) * len(durations)}


# --------------------------------------------------------------------------- 4. reference reuse


COUNT = '''
import os, sys
line = f"{sys.argv[2]} ws={os.environ['WORLD_SIZE']} rank={os.environ['RANK']} pid={os.getpid()}\\n"
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
os.write(fd, line.encode())
os.close(fd)
'''

# (test, tag, marker arguments, world sizes it must launch)
REUSE_TESTS = [
    ("test_a", "shared", "nproc=[1, 2, 4], max_ratio=10", [1, 2, 4]),
    ("test_b", "shared", "nproc=[1, 2, 4], max_ratio=10, max_mib=100000", [2, 4]),   # reference reused
    ("test_c", "shared", "nproc=[2, 4], max_ratio=10", [2, 4]),                      # added reference reused
    ("test_d", "other", "nproc=[2], max_ratio=10", [1, 2]),                          # other args: own reference
    ("test_e", "body", "nproc=[2], max_ratio=10", [1, 2]),                           # body mode: per test
]


def reuse(args, folder: Path, say) -> tuple[list[str], dict]:
    counter = folder / "rank_starts.txt"
    counter.unlink(missing_ok=True)
    (folder / "count_ranks.py").write_text(COUNT)
    src = ["import os, sys, subprocess, pytest\n"]
    for name, tag, marker, _ in REUSE_TESTS:
        if tag == "body":
            src.append(f"\n@pytest.mark.gpumem({marker})\ndef {name}():\n"
                       f"    subprocess.run([sys.executable, {str(folder / 'count_ranks.py')!r}, "
                       f"{str(counter)!r}, {tag!r}], check=True)\n")
        else:
            src.append(f"\n@pytest.mark.gpumem({marker}, script='count_ranks.py', args=[{str(counter)!r}, {tag!r}])\n"
                       f"def {name}():\n    pass\n")
    (folder / "test_reuse.py").write_text("".join(src))
    report = folder / "reuse.json"
    env = base_env({"GPUMEM_MISSING_BASELINE": "ignore"})
    env.pop("OMP_NUM_THREADS")
    say("[reuse] pytest --gpumem test_reuse.py")
    wall, code, out = run_cmd([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-q",
                               f"--gpumem-report={report}", "test_reuse.py"], cwd=folder, env=env,
                              timeout=args.timeout * 4)
    starts = counter.read_text().splitlines() if counter.exists() else []
    expected_launches = sum(len(sizes) for *_, sizes in REUSE_TESTS)
    expected_starts = sum(sum(sizes) for *_, sizes in REUSE_TESTS)
    lines = ["reference reuse (script mode: same script, args, env and launcher => the nproc=1 reference is "
             "launched once; every rank start counted by the rank program):",
             f"  {'test':<7} {'tag':<7} {'marker':<44} {'launches expected':>17} {'reused (report)':>16} "
             f"{'rank starts exp/actual':>22}"]
    by_test: dict[str, dict] = {}
    try:
        for rec in json.loads(report.read_text())["tests"]:
            by_test[rec["test"].split("::")[1]] = rec
    except (OSError, ValueError, KeyError):
        lines.append(f"  (no report; pytest exit {code})")
        lines.extend("  " + line for line in out.splitlines()[-15:])
    for name, tag, marker, sizes in REUSE_TESTS:
        rec = by_test.get(name, {})
        reused = [s["nproc"] for s in rec.get("sizes", []) if s.get("reused")]
        lines.append(f"  {name:<7} {tag:<7} {marker:<44} {str(sizes):>17} {str(reused or '-'):>16} "
                     f"{'':>22}  status {rec.get('status', '?')}")
    actual_by_tag: dict[str, int] = {}
    for line in starts:
        actual_by_tag[line.split()[0]] = actual_by_tag.get(line.split()[0], 0) + 1
    expected_by_tag: dict[str, int] = {}
    for _, tag, _, sizes in REUSE_TESTS:
        expected_by_tag[tag] = expected_by_tag.get(tag, 0) + sum(sizes)
    for tag in expected_by_tag:
        by_ws: dict[str, int] = {}
        for line in starts:
            if line.split()[0] == tag:
                ws = line.split()[1]
                by_ws[ws] = by_ws.get(ws, 0) + 1
        lines.append(f"  rank starts, tag {tag}: expected {expected_by_tag[tag]}, actual {actual_by_tag.get(tag, 0)} "
                     f"({', '.join(f'{k}: {v}' for k, v in sorted(by_ws.items()))})")
    if code:
        lines.append(f"  pytest exit {code}; last lines of its output:")
        lines.extend("    " + line for line in out.strip().splitlines()[-12:])
    actual_launches = sum(1 for rec in by_test.values() for s in rec.get("sizes", []) if not s.get("reused"))
    lines.append(f"  total: launches expected {expected_launches}, actual {actual_launches} (report, not reused); "
                 f"rank starts expected {expected_starts}, actual {len(starts)}; session {wall:.1f} s, exit {code}")
    return lines, {"expected_launches": expected_launches, "actual_launches": actual_launches,
                   "expected_starts": expected_starts, "actual_starts": len(starts)}


# --------------------------------------------------------------------------- 5. sampler cost


def sampler_cost(args, folder: Path, say) -> tuple[list[str], dict]:
    sys.path.insert(0, str(ROOT))
    from pytest_gpumem.sampling.host import DEFAULT_INTERVAL_S, HostSampler

    say("[sampler] host sampler CPU cost, 4 sleeping ranks, 3 s per interval")
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(4)]
    lines = ["host sampler cost (VmHWM + VmRSS from /proc, 4 live ranks, 3 s; CPU of this process while "
             "the main thread sleeps):"]
    result = {}
    try:
        time.sleep(0.3)
        for interval in (DEFAULT_INTERVAL_S, 0.002):
            sampler = HostSampler(interval)
            for rank, proc in enumerate(procs):
                sampler.add_process(rank, proc.pid)
            cpu0, t0 = time.process_time(), time.monotonic()
            sampler.start()
            time.sleep(3.0)
            sampler.stop()
            share = (time.process_time() - cpu0) / (time.monotonic() - t0) * 100
            ticks = len(sampler.timeline())
            lines.append(f"  every {interval * 1000:g} ms: {share:.2f}% of one core ({share / 4:.3f}% per rank), "
                         f"{ticks} samples")
            result[interval] = share
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return lines, result


# --------------------------------------------------------------------------- main


def summary(fw_configs: dict[str, list[Config]], sizes: list[int], fid: dict, reuse_res: dict,
            sampler: dict) -> list[str]:
    rows: list[tuple[str, str, str, str]] = []
    for fw, configs in fw_configs.items():
        plugin = next(c for c in configs if c.kind == "plugin" and c.launcher == "direct")
        spawn = next(c for c in configs if c.kind == "spawn" and c.launcher == "direct")
        gated = next((c for c in configs if c.launcher == "gated"), None)
        for n in sizes:
            # Stalls are judged on their own; the ratio compares launches that did not stall. When
            # every direct spawn stalled (OneFlow at 4 ranks), the gated spawn's stall-free runs stand
            # in for it (the same spawn, ranks > 0 held until rank 0 listens).
            p = plugin.steady(n)
            s, ref = spawn_reference(configs, n)
            if p is None and plugin.runs_at(n):
                rows.append((f"{fw} n={n}: plugin (direct) / direct spawn, per launch",
                             f"every plugin run stalled (median {med(plugin.launch_times(n)):.2f} s)",
                             f"<= {GOAL_RATIO:.2f}", "NOT met"))
                continue
            ratio = p / s if p is not None and s else None
            rows.append((f"{fw} n={n}: plugin (direct) / direct spawn, per launch",
                         "-" if ratio is None else f"{ratio:.2f} ({p:.2f} s / {s:.2f} s {ref}, stall-free)",
                         f"<= {GOAL_RATIO:.2f}",
                         "-" if ratio is None else ("met" if ratio <= GOAL_RATIO else "NOT met")))
        for n in sizes:
            w = plugin.steady(n, "wall")
            s, ref = spawn_reference(configs, n)
            rows.append((f"{fw} n={n}: whole pytest command / direct spawn",
                         "-" if w is None or not s else f"{w / s:.2f} ({w:.2f} s / {s:.2f} s {ref}, stall-free)",
                         "info (pytest start-up: once a session)", "-"))
        launches = sum(plugin.runs_at(n) for n in sizes)
        stalls = sum(t > STALL_S for n in sizes for t in plugin.launch_times(n))
        fails = sum(len(plugin.failures.get(n, [])) for n in sizes)
        rows.append((f"{fw}: plugin (direct) stalls > {STALL_S:g} s / failures",
                     f"{stalls} / {fails} in {launches + fails} launches", "0 (in 20 launches)",
                     "met" if stalls == 0 and fails == 0 and launches + fails >= 20 else
                     ("NOT met" if stalls or fails else f"too few launches ({launches})")))
        for cfg in configs:
            if cfg is plugin:
                continue
            st = [sum(t > STALL_S for t in cfg.launch_times(n)) for n in sizes]
            rows.append((f"{fw}: {cfg.name} stalls at n={sizes}",
                         f"{st} of {[cfg.runs_at(n) for n in sizes]} runs", "info", "-"))
        viar = next((c for c in configs if c.kind == "plugin" and c.launcher != "direct"), None)
        raw = next((c for c in configs if c.kind == "raw"), None)
        if viar and raw:
            vals = [fmt_ratio(viar.steady(n), raw.steady(n)) for n in sizes]
            rows.append((f"{fw}: plugin ({viar.launcher}) / raw {raw.launcher}, per launch, n={sizes}",
                         ", ".join(vals), "info", "-"))
        if gated:
            vals = [fmt_ratio(gated.steady(n), spawn.steady(n)) for n in sizes if n > 1]
            rows.append((f"{fw}: spawn + gate / direct spawn, stall-free, n={[n for n in sizes if n > 1]}",
                         ", ".join(vals), "info (what the stall fix costs)", "-"))
    if fid:
        rows.append(("host peak: worst |reported - (0 MiB job + size)|",
                     f"{fid['worst']:.1f} MiB over {fid['cells']} size x duration cells",
                     f"<= {fid['tolerance']:.1f} MiB (baseline spread)",
                     "met" if fid["worst"] <= fid["tolerance"] else "NOT met"))
        rows.append(("host peak: worst |error| of wait4 ru_maxrss (/usr/bin/time)", f"{fid['raw_worst']:.1f} MiB",
                     "info (the raw tool)", "-"))
        rows.append(("host peak: allocations 50 ms RSS polling under-read (> 1 MiB)",
                     f"{fid['polled_missed']} of {fid['cells']}", "info (the raw-polling alternative)", "-"))
    if reuse_res:
        ok = (reuse_res["expected_launches"] == reuse_res["actual_launches"]
              and reuse_res["expected_starts"] == reuse_res["actual_starts"])
        rows.append(("reference reuse: launches / rank starts",
                     f"{reuse_res['actual_launches']} / {reuse_res['actual_starts']}",
                     f"= {reuse_res['expected_launches']} / {reuse_res['expected_starts']}",
                     "met" if ok else "NOT met"))
    for interval, share in sampler.items():
        rows.append((f"host sampler CPU at {interval * 1000:g} ms, 4 ranks", f"{share:.2f}% of one core", "info", "-"))
    widths = [max(len(r[i]) for r in rows + [("measure", "measured", "goal", "verdict")]) for i in range(4)]
    out = ["  ".join(h.ljust(w) for h, w in zip(("measure", "measured", "goal", "verdict"), widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return out


def write_results(path: Path, key: str, text: str) -> None:
    """Replace this environment's section of the results file, keep the others."""
    begin, end = f"==== {key} ====", f"==== end {key} ===="
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    section = f"{begin}\n{text.rstrip()}\n{end}\n"
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else (old + ("\n" if old else "") + section)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main() -> None:
    global STALL_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per launch configuration (default 10)")
    parser.add_argument("--launcher-runs", type=int, default=None,
                        help="runs of the plugin-with-launcher and raw-launcher rows (default: --runs, at most 5: "
                             "every OneFlow launcher run costs 3-18 s)")
    parser.add_argument("--sizes", default="1,2,4", help="world sizes of the launch benchmark (default 1,2,4)")
    parser.add_argument("--parts", default="launch,phases,fidelity,reuse,sampler",
                        help="comma-separated subset of launch,phases,fidelity,reuse,sampler")
    parser.add_argument("--framework", choices=["oneflow", "torch"], action="append",
                        help="limit to this framework (default: every one this interpreter has)")
    parser.add_argument("--stall-s", type=float, default=STALL_S, help="a run slower than this is a stall (default 5)")
    parser.add_argument("--phase-runs", type=int, default=3, help="runs of the phase breakdown (default 3)")
    parser.add_argument("--fid-mib", default="64,256,1024", help="sizes of the fidelity jobs, MiB")
    parser.add_argument("--fid-ms", default="2,10,100,1000", help="how long each size is held, ms")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before one run is killed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_bench.txt")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.launcher_runs = min(args.runs, 5) if args.launcher_runs is None else args.launcher_runs
    STALL_S = args.stall_s
    args.fid_mib = [int(x) for x in args.fid_mib.split(",")]
    args.fid_ms = [float(x) if "." in x else int(x) for x in args.fid_ms.split(",")]
    parts = set(args.parts.split(","))
    fws = args.framework or frameworks_here()
    missing = [fw for fw in fws if importlib.util.find_spec(fw) is None]
    if missing:
        parser.error(f"{', '.join(missing)} not importable by {sys.executable}")

    started = time.monotonic()

    def say(text: str) -> None:
        print(f"{time.monotonic() - started:7.1f}s {text}", flush=True)

    header = [f"pytest-gpumem CPU benchmarks ({datetime.date.today().isoformat()})",
              f"  Python {platform.python_version()} ({sys.executable.replace(str(ROOT) + '/', '')}), "
              f"frameworks: {', '.join(f'{fw} {_version(fw)}' for fw in fws) or 'none'}, "
              f"{os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.2f}",
              f"  runs per launch configuration: {args.runs} ({args.launcher_runs} through the launchers); "
              f"command: {' '.join(sys.argv[1:]) or '(defaults)'}"]
    sections: list[list[str]] = []
    fw_configs: dict[str, list[Config]] = {}
    fid: dict = {}
    reuse_res: dict = {}
    sampler: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-") as tmp:
        folder = Path(tmp)
        (folder / "pytest.ini").write_text("[pytest]\n")
        for fw in fws:
            if "launch" in parts:
                fw_configs[fw] = launch_overhead(fw, args, folder, say)
                sections.append(launch_lines(fw_configs[fw], args.sizes))
            if "phases" in parts:
                (folder / f"test_launch_{fw}.py").write_text(plugin_test_file(fw, args.sizes))
                (folder / f"noop_{fw}.py").write_text(TRACE_HEAD + NOOP[fw] + TRACE_TAIL)
                sections.append(phases(fw, args, folder, say))
        if "fidelity" in parts:
            lines, fid = fidelity(args, folder, say)
            sections.append(lines)
        if "reuse" in parts:
            lines, reuse_res = reuse(args, folder, say)
            sections.append(lines)
        if "sampler" in parts:
            lines, sampler = sampler_cost(args, folder, say)
            sections.append(lines)
    table = summary(fw_configs, args.sizes, fid, reuse_res, sampler)
    footer = [f"  load average at end {os.getloadavg()[0]:.2f}; total {time.monotonic() - started:.0f} s"]
    text = "\n".join(header + [""] + [line for sec in sections for line in sec + [""]] + table + footer)
    print("\n" + text)
    if not args.no_write:
        key = "+".join(fws) if fws else "none"
        write_results(args.out, f"{key} (Python {platform.python_version()})", text)
        print(f"\nwritten to {args.out}")


def _version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
