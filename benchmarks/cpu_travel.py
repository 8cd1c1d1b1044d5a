"""What moves torch's host figure from one CPU model to another? Vary one candidate at a time, on one machine.

    .venv-torch/bin/python benchmarks/cpu_travel.py [--runs 2] [--only NAME,...]

Runs the torch examples (examples/test_torch_ddp.py::test_torch_ddp and examples/test_script_mode.py)
through ``pytest --gpumem`` once per variant and rerun (the figure is exact: benchmarks/travel_spread.py),
and reads rank 0's gated figure (the peak of live allocations) at nproc=1 and 2. The variants are set
in pytest's environment, which the ranks inherit:

- the CPU paths of torch's math libraries: ATen's kernels (``ATEN_CPU_CAPABILITY``), oneDNN's ISA
  (``ONEDNN_MAX_CPU_ISA``, ``DNNL_MAX_CPU_ISA``), MKL's code path (``MKL_ENABLE_INSTRUCTIONS``,
  ``MKL_CBWR``), and MKL's vendor check: ``LD_PRELOAD`` of a two-line library whose
  ``mkl_serv_intel_cpu_true`` returns 0 makes MKL treat this CPU as a non-Intel one, as it treats an
  AMD EPYC (torch links MKL into libtorch_cpu.so and calls that function through its PLT);
- thread pools and the allocator: one CPU (``taskset -c 0``), glibc ``MALLOC_ARENA_MAX=1``.

The figures and the CPU's facts are appended to benchmarks/results/cpu_travel.txt with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_gpumem.sampling.identity import _cpu_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cpu_travel.txt"
TESTS = {"examples/test_torch_ddp.py::test_torch_ddp": "DDP", "examples/test_script_mode.py::test_train_net_script":
         "script"}
NOT_INTEL = "int mkl_serv_intel_cpu_true(void) { return 0; }\n"

VARIANTS: dict[str, dict[str, str]] = {
    "as found": {},
    "as found (again)": {},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ONEDNN_MAX_CPU_ISA=AVX512_CORE": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "DNNL_MAX_CPU_ISA=AVX2": {"DNNL_MAX_CPU_ISA": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL sees a non-Intel CPU": {"LD_PRELOAD": "{not_intel}"},
    "taskset -c 0 (one CPU)": {"TASKSET": "0"},
    "MALLOC_ARENA_MAX=1": {"MALLOC_ARENA_MAX": "1"},
}


def run_examples(env: dict[str, str], taskset: str | None) -> dict[str, float]:
    """{"example nproc=N": rank 0's gated MiB} of one pytest session."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpumem",
               "--gpumem-missing-baseline=ignore", f"--gpumem-report={report}", *TESTS]
        if taskset:
            cmd = ["taskset", "-c", taskset, *cmd]
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
        run_env.update(env)
        done = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True)
        if not report.exists() or "passed" not in done.stdout:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        out = {}
        for test in json.loads(report.read_text())["tests"]:
            for size in test["sizes"]:
                out[f"{TESTS[test['test']]} nproc={size['nproc']}"] = size["gated_mib"]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = parser.parse_args()
    import torch

    from pytest_gpumem.sampling.identity import cpu_provenance

    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        shim = Path(tmp) / "not_intel.so"
        source = Path(tmp) / "not_intel.c"
        source.write_text(NOT_INTEL)
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler:
            subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
        for name in names:
            env = {k: v.format(not_intel=shim) for k, v in VARIANTS[name].items()}
            if "LD_PRELOAD" in env and not compiler:
                lines.append(f"  {name:34s} skipped: no C compiler for the shim")
                continue
            taskset = env.pop("TASKSET", None)
            got: dict[str, list[float]] = {}
            for _ in range(args.runs):
                for example, mib in run_examples(env, taskset).items():
                    got.setdefault(example, []).append(mib)
            line = f"  {name:34s} " + "   ".join(
                f"{ex} " + " ".join(f"{m:8.3f}" for m in vals) for ex, vals in sorted(got.items()))
            print(line, flush=True)
            lines.append(line)
    facts = ", ".join(f"{k}={v}" for k, v in cpu_provenance().items())
    command = f".venv-torch/bin/python benchmarks/cpu_travel.py --runs {args.runs}" + (
        f" --only '{args.only}'" if args.only else "")
    text = "\n".join([
        f"== torch {torch.__version__}, Python {platform.python_version()}, {datetime.date.today()}, "
        f"command: {command}", f"   CPU: {_cpu_model()}; {facts}",
        "[variants] rank 0's gated figure (live allocations), MiB, each rerun "
        "(DDP: examples/test_torch_ddp.py::test_torch_ddp, script: examples/test_script_mode.py)", *lines]) + "\n\n"
    print(text)
    with RESULTS.open("a") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
