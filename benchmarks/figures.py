"""Do the gated host figures travel? Reruns, a second install, spike capture, tracking cost.

    .venv-torch/bin/python benchmarks/figures.py [--runs 10]      # torch: examples/test_torch_ddp.py
    .venv-oneflow/bin/python benchmarks/figures.py [--runs 10]    # OneFlow: examples/test_oneflow_eager_dp.py

Everything goes through ``pytest --gpumem`` on the shipped examples, side by side in one run:

1. reruns: the healthy example (nproc=1 and 2) ``--runs`` times; spread (max - min) of rank 0's
   gated figure (the peak of live allocations) and of its VmHWM, which the report keeps as information.
2. a second install: the framework's package folder copied afresh and put first on PYTHONPATH
   (same code, other files, another page-cache state), run 3 times; the same two spreads against
   the installed copy.
3. spike capture: 20 launches of a job that allocates 64 MiB, holds it 2 ms and frees it, each
   beside its twin without the spike; caught when the gated figure is at least 63 MiB above the
   twin's (the spike lands on the live set of its moment, which may sit a fraction of a MiB below
   the job's own later peak: the deltas are printed).
4. tracking cost: the example's per-launch time (the plugin's own ``duration_s``) with the
   tracker on and off (``--gpumem-track-host=on|off``), alternated, medians; and the
   CPU time of each whole session, which other jobs on the machine move less than wall time.

Results are appended to ``benchmarks/results/figures.txt``, one section per framework.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "torch": "examples/test_torch_ddp.py::test_torch_ddp",
    "oneflow": "examples/test_oneflow_eager_dp.py::test_oneflow_eager_dp",
}
SPIKE = '''
import time
import pytest

@pytest.mark.gpumem(nproc=1)
@pytest.mark.parametrize("run", range({runs}))
@pytest.mark.parametrize("spike", [0, 64])
def test_spike(run, spike):
    buf = bytearray(spike * 1024 * 1024)
    time.sleep(0.002)
    del buf
'''


def framework() -> str:
    for name in ("oneflow", "torch"):
        if importlib.util.find_spec(name) is not None:
            return name
    raise SystemExit("run this with the interpreter of .venv-torch or .venv-oneflow")


def pytest_gpumem(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> list[dict]:
    """Run ``pytest --gpumem`` and return the report's tests."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpumem",
               "--gpumem-missing-baseline=ignore", f"--gpumem-report={report}", *args]
        done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
        if not report.exists():
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(report.read_text())["tests"]


def rank0(test: dict) -> dict[int, tuple[float, float, float]]:
    """{nproc: (gated MiB, VmHWM MiB, launch seconds)} of rank 0."""
    return {s["nproc"]: (s["gated_mib"], s["rss_ranks"]["0"], s["duration_s"]) for s in test["sizes"]}


def spread(values: list[float]) -> str:
    return f"{min(values):8.1f} .. {max(values):8.1f}  spread {max(values) - min(values):6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--parts", default="reruns,spike,cost", help="comma list of reruns, spike, cost")
    args = parser.parse_args()
    parts = args.parts.split(",")
    name = framework()
    example = EXAMPLES[name]
    lines = [f"== {name} {importlib.import_module(name).__version__}, Python {sys.version.split()[0]}, "
             f"{datetime.date.today()}, command: {Path(sys.executable).parent.parent.name}/bin/python "
             f"benchmarks/figures.py --runs {args.runs} --parts {args.parts}"]

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    if "reruns" in parts:
        reruns(name, example, args.runs, say)
    if "spike" in parts:
        spike(say)
    if "cost" in parts:
        cost(example, say)
    out = ROOT / "benchmarks" / "results" / "figures.txt"
    with out.open("a") as handle:
        handle.write("\n".join(lines) + "\n\n")
    print(f"appended to {out.relative_to(ROOT)}")


def reruns(name: str, example: str, runs: int, say) -> None:
    installed = [rank0(pytest_gpumem([example])[0]) for _ in range(runs)]
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(importlib.util.find_spec(name).origin).parent
        shutil.copytree(package, Path(tmp) / name, ignore=shutil.ignore_patterns("include", "*.a"))
        libs = package.parent / f"{name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, Path(tmp) / libs.name)
        nvidia = package.parent / "nvidia"  # OneFlow loads cuDNN/cuBLAS from beside itself: not the copy's subject
        if name == "oneflow" and nvidia.is_dir():
            (Path(tmp) / "nvidia").symlink_to(nvidia)
        copied = [rank0(pytest_gpumem([example], {"PYTHONPATH": tmp})[0]) for _ in range(3)]

    say(f"[reruns] {example}, rank 0, {runs} runs, MiB")
    say(f"  {'nproc':>5}  {'gated (live allocations)':>38}  {'VmHWM (information)':>38}")
    for n in sorted(installed[0]):
        say(f"  {n:>5}  {spread([r[n][0] for r in installed]):>38}  {spread([r[n][1] for r in installed]):>38}")
    say(f"[second install] the {name} package copied afresh, first on PYTHONPATH: 3 runs against the {runs} above")
    for n in sorted(installed[0]):
        both_g = [r[n][0] for r in installed + copied]
        both_h = [r[n][1] for r in installed + copied]
        gi, gc = statistics.median(r[n][0] for r in installed), statistics.median(r[n][0] for r in copied)
        hi, hc = statistics.median(r[n][1] for r in installed), statistics.median(r[n][1] for r in copied)
        say(f"  nproc={n}: gated median {gi:.2f} vs {gc:.2f} (all runs spread {max(both_g) - min(both_g):.2f}); "
            f"VmHWM median {hi:.1f} vs {hc:.1f} (spread {max(both_h) - min(both_h):.1f})")


def spike(say) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "test_spike.py").write_text(SPIKE.replace("{runs}", "20"))
        tests = pytest_gpumem(["test_spike.py"], cwd=Path(tmp))
    by = {}
    for t in tests:
        size_mib, run = t["test"].split("[")[1].rstrip("]").split("-")
        by.setdefault(int(run), {})[int(size_mib)] = t["sizes"][0]["gated_mib"]
    caught = sum(1 for pair in by.values() if pair[64] - pair[0] >= 63.0)
    deltas = [pair[64] - pair[0] for pair in by.values()]
    say(f"[spike] 64 MiB held 2 ms, nproc=1, 20 launches: caught {caught}/20 "
        f"(gated figure above the no-spike twin by {min(deltas):.2f} .. {max(deltas):.2f} MiB)")


def cost(example: str, say) -> None:
    """Per-launch seconds with the tracker on and off, alternated; and, steadier on a shared machine,
    the CPU time of each whole session (pytest and every rank it waited for; both sizes)."""
    import resource

    on, off, cpu_on, cpu_off = [], [], [], []
    for _ in range(5):
        for runs, cpus, switch in ((on, cpu_on, "on"), (off, cpu_off, "off")):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            runs.append(rank0(pytest_gpumem([example, f"--gpumem-track-host={switch}"])[0]))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    say(f"[cost] {example}: per-launch seconds, median of 5, tracker on vs off (--gpumem-track-host, alternated); "
        f"load average {os.getloadavg()[0]:.1f}")
    for n in sorted(on[0]):
        t_on, t_off = statistics.median(r[n][2] for r in on), statistics.median(r[n][2] for r in off)
        say(f"  nproc={n}: {t_on:.2f} s vs {t_off:.2f} s ({t_on / t_off:.3f}x)")
    c_on, c_off = statistics.median(cpu_on), statistics.median(cpu_off)
    say(f"  CPU time of the whole session (nproc 1 and 2, pytest and every rank): {c_on:.2f} s vs {c_off:.2f} s "
        f"({c_on / c_off:.3f}x)")


if __name__ == "__main__":
    main()
