"""Pipeline stages and expert routing, real gloo worlds against simulated ones, every rank.

    .venv-torch/bin/python benchmarks/parallelism_validation.py              # sizes 2,4,8
    .venv-torch/bin/python benchmarks/parallelism_validation.py --sizes 2,4
    .venv-torch/bin/python benchmarks/parallelism_validation.py --jobs tensor   # one family, its own file

One generated project through ``pytest --gpumem --gpumem-report=...`` (marker, planner, launcher,
rank-side stand-in, report). For each world size N, each job once real (``simulate="off"``) and once
simulated (``simulate="on"``), interleaved so that the machine's load falls on both alike:

- the pipeline of tests/jobs.py TORCH_PP (8 layers over N stages, 32 microbatches) under 1F1B, GPipe,
  and 1F1B keeping every microbatch's output (the regression), ``rank="all"``: every rank's figure;
- the expert layer of tests/jobs.py TORCH_MOE, balanced and collapsed routing (every token to
  expert 0, the regression), ``assume="alike"`` for the simulated world, rank 0 (the collapsed
  router's receiving rank);
- the (dp, tp=2) job of tests/jobs.py TORCH_TP (ColwiseParallel/RowwiseParallel on "tp", FSDP2 on
  "dp") and its twin that gathers every dp rank's activation (the regression), rank 0.

Each rank's host figure (memray's live allocations) is read from the report; the table gives real,
simulated and their difference per rank, and which rank is the largest in each.

Results: benchmarks/results/parallelism_validation.txt (and .json, the raw figures); with ``--jobs``
other than all three, parallelism_validation_<families>.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the jobs, shared with the tests

from jobs import TORCH_MOE, TORCH_PP, TORCH_TP  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PIPELINE = {"1f1b": 'pp_job("1f1b")', "gpipe": 'pp_job("gpipe")', "keep": 'pp_job("1f1b", keep_outputs=True)'}
EXPERTS = {"balanced": 'moe_job("balanced")', "collapsed": 'moe_job("collapsed")'}
TENSOR = {"tp": "tp_job()", "tp_gather": "tp_job(True)"}
# Each family: its jobs and the marker arguments its simulated world needs.
FAMILIES = {"pipeline": (PIPELINE, 'rank="all"'), "experts": (EXPERTS, 'assume="alike"'), "tensor": (TENSOR, None)}


def project(sizes: list[int], timeout: float, families: list[str]) -> str:
    lines = [TORCH_PP, TORCH_MOE, TORCH_TP]  # each sizes itself at import (its own SCALE), before the next
    for n in sizes:
        for jobs, extra in (FAMILIES[f] for f in families):
            for job, call in jobs.items():
                for mode in ("off", "on"):
                    args = [f"nproc={n}", 'device="cpu"', f'simulate="{mode}"', f"timeout={timeout}"]
                    args += [extra] if extra else []
                    lines.append(f'''
@pytest.mark.gpumem({", ".join(args)})
def test_{job}_{n}_{"real" if mode == "off" else "simulated"}():
    {call}
''')
    return "".join(lines)


def run(sizes: list[int], timeout: float, families: list[str]) -> tuple[dict[str, Any], float]:
    return run_project(project(sizes, timeout, families), "test_parallelism.py")


def run_project(source: str, module: str, path: tuple[str, ...] = ()) -> tuple[dict[str, Any], float]:
    """``source`` as ``module`` in a fresh folder under ``pytest --gpumem``, ``path`` besides the
    repository on PYTHONPATH: its report and the seconds it took."""
    with tempfile.TemporaryDirectory(prefix="gpumem-validation-") as tmp:
        folder = Path(tmp)
        (folder / module).write_text(source)
        report = folder / "report.json"
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), *path, os.environ.get("PYTHONPATH")]))
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                               "--gpumem", "--gpumem-missing-baseline=ignore", f"--gpumem-report={report}",
                               module], cwd=folder, env={**os.environ, "PYTHONPATH": pythonpath},
                              text=True, capture_output=True)
        seconds = time.monotonic() - started
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
        if not report.exists():
            raise SystemExit(f"pytest left no report (exit {proc.returncode})")
        return json.loads(report.read_text()), seconds


def per_rank(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for test in report["tests"]:
        size = test["sizes"][0]
        out[test["test"].split("::")[1]] = {"ranks": {int(r): v for r, v in size["host_ranks"].items()},
                                            "gated": size["gated_label"], "status": test["status"]}
    return out


def table(figures: dict[str, dict[str, Any]], sizes: list[int]) -> list[str]:
    lines = [f"{'job':<10} {'N':>2}  {'rank':>4}  {'real MiB':>9}  {'simulated MiB':>13}  {'real - sim':>10}  "
             "largest (real / simulated)"]
    for job in (*PIPELINE, *EXPERTS, *TENSOR):
        for n in sizes:
            real, sim = figures.get(f"test_{job}_{n}_real"), figures.get(f"test_{job}_{n}_simulated")
            if real is None or sim is None:
                continue
            for rank in sorted(sim["ranks"]):
                r, s = real["ranks"].get(rank), sim["ranks"][rank]
                diff = f"{r - s:+10.2f}" if r is not None else f"{'-':>10}"
                largest = f"{real['gated']} / {sim['gated']}" if rank == min(sim["ranks"]) else ""
                lines.append(f"{job:<10} {n:>2}  {rank:>4}  {r if r is not None else float('nan'):>9.2f}  "
                             f"{s:>13.2f}  {diff}  {largest}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--jobs", default=",".join(FAMILIES), help=f"families, of {', '.join(FAMILIES)}")
    options = parser.parse_args()
    sizes = [int(n) for n in options.sizes.split(",")]
    families = options.jobs.split(",")
    if unknown := sorted(set(families) - set(FAMILIES)):
        parser.error(f"--jobs: unknown {', '.join(unknown)}; accepted: {', '.join(FAMILIES)}")
    report, seconds = run(sizes, options.timeout, families)
    figures = per_rank(report)
    import torch

    lines = [f"{datetime.date.today()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"python {platform.python_version()}; {seconds:.0f} s in all",
             f"command: .venv-torch/bin/python benchmarks/parallelism_validation.py --sizes {options.sizes}"
             + ("" if set(families) == set(FAMILIES) else f" --jobs {options.jobs}"), "",
             *table(figures, sizes)]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    name = "parallelism_validation" + ("" if set(families) == set(FAMILIES) else "_" + "_".join(families))
    (RESULTS / f"{name}.txt").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
