"""Jobs written with the frameworks teams train with, real gloo worlds against simulated ones.

    .venv-torch/bin/python benchmarks/framework_validation.py deepspeed      # sizes 2,4,8
    .venv-torch/bin/python benchmarks/framework_validation.py accelerate --sizes 2,4

One generated project through ``pytest --gpumem --gpumem-report=...``, with the frameworks of
tests/frameworks.txt on the path (``make venvs`` puts them in .venv-torch/frameworks). For each world
size N, each job once real (``simulate="off"``, ``rank="all"``: every rank) and once simulated
(``simulate="on"``, rank 0), interleaved so that the machine's load falls on both alike:

- ``deepspeed``: ZeRO-3 and ZeRO-1 (the regression) over tests/jobs.py TORCH_ZERO, the simulated
  world under ``assume="alike"`` (ZeRO-3 broadcasts rank 0's lists and reads them, to check the
  ranks agree);
- ``accelerate``: Hugging Face accelerate's DDP (tests/jobs.py TORCH_ACCELERATE), healthy and
  gathering every rank's batch (the regression).

Each rank's host figure (memray's live allocations) is read from the report; the table gives rank
0 real and simulated, their difference, and the other real ranks' spread.

Results: benchmarks/results/framework_validation_<family>.txt (and .json, the raw figures).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the jobs, shared with the tests

from jobs import TORCH_ACCELERATE, TORCH_ZERO  # noqa: E402
from parallelism_validation import run_project  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FRAMEWORKS = Path(sys.prefix) / "frameworks"
FAMILIES = {  # the job's source, its variants, what a simulated rank declares
    "deepspeed": (TORCH_ZERO, {"zero3": "zero_job(3)", "zero1": "zero_job(1)"}, 'assume="alike"'),
    "accelerate": (TORCH_ACCELERATE, {"ddp": "accelerate_job()", "gather": "accelerate_job(gather=True)"}, ""),
}


def project(family: str, sizes: list[int], timeout: float) -> str:
    source, jobs, declared = FAMILIES[family]
    lines = [source]
    for n in sizes:
        for job, call in jobs.items():
            for mode, extra in (("off", 'rank="all"'), ("on", declared)):
                args = [f"nproc={n}", 'device="cpu"', f'simulate="{mode}"', f"timeout={timeout}"]
                args += [extra] if extra else []
                lines.append(f'''
@pytest.mark.gpumem({", ".join(args)})
def test_{job}_{n}_{"real" if mode == "off" else "simulated"}():
    {call}
''')
    return "".join(lines)


def run(family: str, sizes: list[int], timeout: float) -> tuple[dict[str, Any], float]:
    path = (str(FRAMEWORKS),) if FRAMEWORKS.is_dir() else ()
    return run_project(project(family, sizes, timeout), "test_frameworks.py", path)


def per_rank(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for test in report["tests"]:
        size = test["sizes"][0]
        out[test["test"].split("::")[1]] = {"ranks": {int(r): v for r, v in size["host_ranks"].items()},
                                            "status": test["status"], "seconds": size["duration_s"]}
    return out


def table(figures: dict[str, dict[str, Any]], jobs: dict[str, str], sizes: list[int]) -> list[str]:
    lines = [f"{'job':<6} {'N':>2}  {'real rank 0':>11}  {'simulated':>9}  {'real - sim':>10}  "
             f"{'real ranks 1..N-1':>17}  {'launch s (real/sim)':>19}"]
    for job in jobs:
        for n in sizes:
            real, sim = figures.get(f"test_{job}_{n}_real"), figures.get(f"test_{job}_{n}_simulated")
            if real is None or sim is None or 0 not in real["ranks"] or 0 not in sim["ranks"]:
                statuses = "/".join(str((each or {}).get("status")) for each in (real, sim))
                lines.append(f"{job:<6} {n:>2}  not measured ({statuses})")
                continue
            r, s = real["ranks"][0], sim["ranks"][0]
            others = [v for k, v in real["ranks"].items() if k]
            spread = f"{min(others):.2f}-{max(others):.2f}" if others else "-"
            lines.append(f"{job:<6} {n:>2}  {r:>11.2f}  {s:>9.2f}  {r - s:>+10.2f}  {spread:>17}  "
                         f"{real['seconds']:>9.1f}/{sim['seconds']:<9.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--timeout", type=float, default=900)
    options = parser.parse_args()
    sizes = [int(n) for n in options.sizes.split(",")]
    report, seconds = run(options.family, sizes, options.timeout)
    figures = per_rank(report)
    import torch

    sys.path.insert(0, str(FRAMEWORKS))
    framework = importlib.import_module(options.family)

    lines = [f"{datetime.date.today()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{options.family} {framework.__version__}, python {platform.python_version()}; {seconds:.0f} s in all",
             f"command: .venv-torch/bin/python benchmarks/framework_validation.py {options.family} "
             f"--sizes {options.sizes}", "", *table(figures, FAMILIES[options.family][1], sizes)]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"framework_validation_{options.family}.txt").write_text("\n".join(lines) + "\n")
    (RESULTS / f"framework_validation_{options.family}.json").write_text(
        json.dumps(figures, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
