"""What a fake-GPU size costs beside the same job's real one-rank GPU launch (issue 34: within 2x).

    python3 benchmarks/fake_gpu_cost.py --runs 3          # on a GPU machine: both, side by side
    .venv-torch/bin/python benchmarks/fake_gpu_cost.py     # on a CPU machine: the fake side only

Each job (tests/jobs.py: the tier's FSDP2 and DDP, and the three foreign ones) is one test marked
``gpumem(nproc=1, device="gpu")`` in a project of its own, run by a whole ``pytest --gpumem``, once
with ``--gpumem-fake-gpu=on`` and, where a GPU is present, once with ``=off``, alternating, ``--runs``
times. Printed per job: the medians of the size's launch (the report's ``duration_s``: from the
launch to every rank reaped) and of the whole pytest command, and fake / real for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jobs  # noqa: E402

CASES = {  # job: (source in tests/jobs.py, its module's name)
    "fsdp2": ("GPU_TIER", "gpu_tier"), "ddp": ("GPU_TIER", "gpu_tier"),
    "gpt2_ddp": ("FOREIGN", "foreign"), "llama_fsdp2": ("FOREIGN", "foreign"), "bert_fsdp1": ("FOREIGN", "foreign"),
}
TEST = '''
import pytest
from {module} import JOBS


@pytest.mark.gpumem(nproc=1, device="gpu")
def test_{job}():
    JOBS["{job}"]()
'''


def launch(project: Path, job: str, fake: bool) -> tuple[float, float, float]:
    """(the size's launch seconds, the pytest command's seconds, allocated MiB) of one run."""
    report = project / "report.json"
    command = [sys.executable, "-m", "pytest", "--gpumem", "-q", "-p", "no:cacheprovider", "--gpumem-refresh",
               f"--gpumem-report={report}", f"--gpumem-fake-gpu={'on' if fake else 'off'}", f"test_{job}.py"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=project, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{job} ({'fake' if fake else 'real'}) failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
    size = json.loads(report.read_text())["tests"][0]["sizes"][0]
    return size["duration_s"], wall, size["allocated_mib"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", default=",".join(CASES))
    parser.add_argument("--fake-only", action="store_true", help="skip the real GPU launch (no GPU here)")
    args = parser.parse_args()
    real_too = not args.fake_only and shutil.which("nvidia-smi") is not None
    print(f"python {sys.version.split()[0]}, torch {__import__('torch').__version__}, "
          f"{'fake and real' if real_too else 'fake only'}, medians of {args.runs} runs")
    print(f"{'job':12} {'fake launch':>11} {'real launch':>11} {'ratio':>6} {'fake pytest':>11} "
          f"{'real pytest':>11} {'ratio':>6} {'fake MiB':>9} {'real MiB':>9}")
    for job in args.jobs.split(","):
        source, module = CASES[job]
        with tempfile.TemporaryDirectory() as tmp:
            project = Path(tmp)
            (project / f"{module}.py").write_text(getattr(jobs, source))
            (project / f"test_{job}.py").write_text(TEST.format(module=module, job=job))
            runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for _ in range(args.runs):
                for fake in (True, False) if real_too else (True,):
                    runs[fake].append(launch(project, job, fake))
        med = {fake: [statistics.median(r[i] for r in found) for i in range(3)]
               for fake, found in runs.items() if found}
        fake, real = med[True], med.get(False)
        cells = [f"{fake[0]:10.1f}s", f"{real[0]:10.1f}s" if real else f"{'-':>11}",
                 f"{fake[0] / real[0]:6.2f}" if real else f"{'-':>6}",
                 f"{fake[1]:10.1f}s", f"{real[1]:10.1f}s" if real else f"{'-':>11}",
                 f"{fake[1] / real[1]:6.2f}" if real else f"{'-':>6}",
                 f"{fake[2]:9.2f}", f"{real[2]:9.2f}" if real else f"{'-':>9}"]
        print(f"{job:12} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
