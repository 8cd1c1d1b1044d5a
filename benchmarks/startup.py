"""What the installed plugin costs a pytest run that does not use it (issue 13: nothing paid when unused).

    .venv-torch/bin/python benchmarks/startup.py [--runs 10]

Runs a one-test pytest session (``def test_ok(): pass``, in a temporary folder with its own
``pytest.ini``) with the plugin loaded as installed and with ``-p no:gpumem``, taking turns,
and prints the median wall time, CPU time (user + system, from wait4) and peak resident memory
of each, the difference against the goal (within 10 ms), and which of the plugin's modules and
heavy dependencies the unused plugin imported. The goal is judged on both medians: wall time is
what a user waits, CPU time is what the plugin itself adds on a machine where other jobs run.
A third row runs ``--gpumem`` over the same file: no gpumem test, so nothing launches.

The interpreter must have pytest-gpumem installed (its ``pytest11`` entry point), as the Makefile's
venvs do. Bytecode is written for the children (a warm-up run each), as in a normal install:
without it every run would compile the plugin's sources again. The output goes to
benchmarks/results/startup.txt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_MS = 10.0
HEAVY = ("psutil", "filelock", "pynvml", "matplotlib")
CONFIGS = {
    "-p no:gpumem": ["-p", "no:gpumem"],
    "plugin installed, unused": [],
    "plugin, --gpumem, no gpumem test": ["--gpumem"],
}
PROBE = """
import sys, pytest
code = pytest.main(sys.argv[1:])
mods = sorted(m for m in sys.modules if m.split('.')[0] in ('pytest_gpumem',) + {heavy!r})
print('PROBE', int(code), len(sys.modules), ' '.join(mods))
"""


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS",
                        "PYTEST_DISABLE_PLUGIN_AUTOLOAD") and not k.startswith("GPUMEM_")}
    return env


def run_once(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak resident MiB) of one pytest process."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_trivial.py"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"pytest {' '.join(args)} exited {proc.returncode}:\n{err}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0  # KiB on Linux


def probe(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """(modules loaded in all, the plugin's and heavy ones) of one in-process run."""
    command = [sys.executable, "-c", PROBE.format(heavy=HEAVY), "-q", "-p", "no:cacheprovider", *args,
               "test_trivial.py"]
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False).stdout
    line = next((x for x in out.splitlines() if x.startswith("PROBE")), "PROBE -1 0")
    parts = line.split()
    return int(parts[2]), parts[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per configuration (default 10)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "startup.txt")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if not any(ep.name == "gpumem" for ep in entry_points(group="pytest11")):
        raise SystemExit(f"{sys.executable}: pytest-gpumem is not installed here (no pytest11 entry point)")

    env = child_env()
    with tempfile.TemporaryDirectory(prefix="gpumem-startup-") as tmp:
        cwd = Path(tmp)
        (cwd / "pytest.ini").write_text("[pytest]\n")
        (cwd / "test_trivial.py").write_text("def test_ok():\n    pass\n")
        for extra in CONFIGS.values():  # warm-up: bytecode written, page cache filled
            run_once(extra, cwd, env)
        walls: dict[str, list[float]] = {name: [] for name in CONFIGS}
        cpus: dict[str, list[float]] = {name: [] for name in CONFIGS}
        rss: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.runs):
            order = list(CONFIGS)
            random.shuffle(order)  # noise hits every configuration alike
            for name in order:
                wall, cpu, peak = run_once(CONFIGS[name], cwd, env)
                walls[name].append(wall)
                cpus[name].append(cpu)
                rss[name].append(peak)
        probes = {name: probe(extra, cwd, env) for name, extra in CONFIGS.items()}

    import pytest  # the version under test

    off = "-p no:gpumem"
    lines = [
        f"pytest-gpumem start-up cost when unused ({datetime.date.today().isoformat()})",
        f"  Python {platform.python_version()}, pytest {pytest.__version__}, {os.cpu_count()} CPUs, "
        f"load average at start {os.getloadavg()[0]:.2f}; {args.runs} runs each, in turns",
        "  one-test session (def test_ok(): pass) in a temporary folder with its own pytest.ini",
        "",
        f"  {'configuration':34s} {'wall s':>7s} {'min':>6s} {'max':>6s} {'vs off ms':>10s} "
        f"{'CPU s':>6s} {'vs off ms':>10s} {'peak RSS MiB':>13s} {'vs off':>7s} {'modules':>8s}",
    ]
    med = statistics.median
    for name in CONFIGS:
        wall, cpu, peak = med(walls[name]), med(cpus[name]), med(rss[name])
        d_wall = "" if name == off else f"{(wall - med(walls[off])) * 1000:+.1f}"
        d_cpu = "" if name == off else f"{(cpu - med(cpus[off])) * 1000:+.1f}"
        d_rss = "" if name == off else f"{peak - med(rss[off]):+.1f}"
        lines.append(f"  {name:34s} {wall:7.3f} {min(walls[name]):6.3f} {max(walls[name]):6.3f} {d_wall:>10s} "
                     f"{cpu:6.3f} {d_cpu:>10s} {peak:13.1f} {d_rss:>7s} {probes[name][0]:8d}")
    unused = "plugin installed, unused"
    wall_ms = (med(walls[unused]) - med(walls[off])) * 1000
    cpu_ms = (med(cpus[unused]) - med(cpus[off])) * 1000
    met = wall_ms <= GOAL_MS and cpu_ms <= GOAL_MS
    lines += [
        "",
        f"  goal: installed-but-unused within {GOAL_MS:.0f} ms of -p no:gpumem (medians): "
        f"wall {wall_ms:+.1f} ms, CPU {cpu_ms:+.1f} ms -> {'met' if met else 'NOT met'}",
    ]
    for name in CONFIGS:
        if name != off:
            lines.append(f"  imported ({name}): {' '.join(probes[name][1]) or 'nothing'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
