"""Why OneFlow's nn.Graph example reads one of two figures at nproc=1, 32 MiB apart.

    .venv-oneflow/bin/python benchmarks/blas_buffer.py [--runs 8] [--captures 3]

1. Reruns ``pytest --gpumem examples/test_oneflow_graph_dp.py`` and prints rank 0's gated figure at each
   size of both tests (the healthy one and its inflating twin), run by run.
2. Runs the healthy training step standalone under ``memray run --native`` a few times and, between a
   high and a low capture, prints the native stacks whose bytes live at the high-water mark differ by
   more than 1 MiB: the stack names the library that mapped the difference.

The output is appended to benchmarks/results/oneflow_blas_buffer.txt with the command.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "oneflow_blas_buffer.txt"
EXAMPLE = "examples/test_oneflow_graph_dp.py"
STANDALONE = f"""
import sys
sys.path.insert(0, {str(ROOT / 'examples')!r})
import test_oneflow_graph_dp as example
print(example._train(broadcast_batch=False))
"""


def rerun_figures(runs: int, tmp: Path) -> list[str]:
    lines = []
    for run in range(1, runs + 1):
        report = tmp / f"report{run}.json"
        subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--gpumem",
                        f"--gpumem-report={report}", "-o", "gpumem_missing_baseline=warn", EXAMPLE],
                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        record = json.loads(report.read_text())
        cells = [f"{t['test'].split('::')[1]}@{s['nproc']}={s['gated_mib']:.2f}"
                 for t in record["tests"] for s in t["sizes"]]
        lines.append(f"run {run}: " + "  ".join(cells))
    return lines


def _peak_stacks(capture: Path) -> collections.Counter[tuple[str, ...]]:
    import memray

    by_stack: collections.Counter[tuple[str, ...]] = collections.Counter()
    for record in memray.FileReader(capture).get_high_watermark_allocation_records(merge_threads=False):
        frames = record.hybrid_stack_trace(max_stacks=14)
        by_stack[tuple(f"{function[:90]}" for function, _file, _line in frames)] += record.size
    return by_stack


def native_difference(captures: int, tmp: Path) -> list[str]:
    script = tmp / "graph_step.py"
    script.write_text(STANDALONE)
    peaks = []
    for n in range(captures):
        capture = tmp / f"native{n}.bin"
        subprocess.run([sys.executable, "-m", "memray", "run", "--native", "-f", "-q", "-o", str(capture),
                        str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        import memray

        peak = memray.FileReader(capture).metadata.peak_memory
        peaks.append((peak, capture))
    lines = ["standalone peaks under memray --native, MiB: "
             + ", ".join(f"{peak / 2**20:.2f}" for peak, _ in peaks)]
    high, low = max(peaks)[1], min(peaks)[1]
    if max(peaks)[0] - min(peaks)[0] < 2**20:
        return lines + ["all captures read the same peak: no difference to explain this time"]
    a, b = _peak_stacks(high), _peak_stacks(low)
    diff = {stack: a[stack] - b[stack] for stack in set(a) | set(b) if abs(a[stack] - b[stack]) > 2**20}
    for stack, size in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
        lines.append(f"{size / 2**20:+.1f} MiB live at the high capture's peak, not the low one's:")
        lines.extend(f"    {frame}" for frame in stack)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--captures", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        lines = rerun_figures(args.runs, tmp) + native_difference(args.captures, tmp)
    text = "\n".join(lines)
    print(text)
    with RESULTS.open("a") as out:
        out.write(f"# {datetime.date.today()}: .venv-oneflow/bin/python benchmarks/blas_buffer.py "
                  f"--runs {args.runs} --captures {args.captures}\n{text}\n\n")


if __name__ == "__main__":
    main()
