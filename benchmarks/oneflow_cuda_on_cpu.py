"""A OneFlow job written for CUDA, run on a runner without a GPU with CUDA mapped to the CPU, against the
same job written for the CPU (issue 63): tests/test_oneflow_cuda_on_cpu.py's job, eager and nn.Graph, at
nproc=[1, 2], both copies in one pytest session per run (side by side: the machine's other load falls on
both). Appends to results/oneflow_cuda_on_cpu.txt each copy's conversions (whether they are the same),
its gated figures and ratio, and the largest differences, from which that test's RATIO_SPREAD comes.

    .venv-oneflow/bin/python benchmarks/oneflow_cuda_on_cpu.py --runs 3
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' conftest, as the test module sees it

from tests.test_oneflow_cuda_on_cpu import CPU, CUDA, session  # noqa: E402

TESTS = ("test_eager", "test_graph")


def one_run(run: int) -> tuple[list[str], dict[str, float]]:
    """One session's lines, and the largest figure and ratio differences of each test in it."""
    with tempfile.TemporaryDirectory() as folder:
        _, records = session(Path(folder), *(f"{copy}::{name}" for name in TESTS for copy in (CUDA, CPU)))
        if any(size["ratio"] is None and size["nproc"] > 1 for r in records.values() for size in r["sizes"]):
            print((Path(folder) / "output.txt").read_text(), file=sys.stderr)  # why a size has no ratio
            raise SystemExit(f"run {run}: a size above 1 without its ratio (its output above)")
    lines, worst = [], {}
    for name in TESTS:
        cuda, cpu = records[f"{CUDA}::{name}"], records[f"{CPU}::{name}"]
        same = [line.replace(CUDA, CPU) for line in cuda["conversions"]] == cpu["conversions"]
        lines.append(f"run {run} {name}: {len(cuda['conversions'])} conversions, "
                     f"{'the same' if same else 'DIFFERENT'} on both copies (CUDA copy labelled "
                     f"{cuda['sizes'][0]['cuda_on_cpu']!r})")
        lines.extend(f"    {line}" for line in cuda["conversions"])
        for on_cuda, on_cpu in zip(cuda["sizes"], cpu["sizes"], strict=True):
            ratio = "" if on_cpu["ratio"] is None else \
                f"  ratio {on_cuda['ratio']:.4f} vs {on_cpu['ratio']:.4f} ({on_cuda['ratio'] - on_cpu['ratio']:+.4f})"
            lines.append(f"    nproc={on_cuda['nproc']}: CUDA copy {on_cuda['gated_mib']:.2f} MiB vs CPU copy "
                         f"{on_cpu['gated_mib']:.2f} MiB ({on_cuda['gated_mib'] - on_cpu['gated_mib']:+.2f}){ratio}")
            worst[f"{name} MiB"] = max(worst.get(f"{name} MiB", 0.0), abs(on_cuda["gated_mib"] - on_cpu["gated_mib"]))
            if on_cpu["ratio"] is not None:
                worst[f"{name} ratio"] = max(worst.get(f"{name} ratio", 0.0), abs(on_cuda["ratio"] - on_cpu["ratio"]))
    return lines, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "oneflow_cuda_on_cpu.txt")
    args = parser.parse_args()
    out = [f"# {datetime.date.today()}: .venv-oneflow/bin/python benchmarks/oneflow_cuda_on_cpu.py --runs {args.runs}",
           "# rank 0's gated figure (live allocations, the host figure) of each copy, MiB; a 2-core machine shared "
           "with other work"]
    worst: dict[str, float] = {}
    for run in range(1, args.runs + 1):
        lines, differences = one_run(run)
        out.extend(lines)
        print("\n".join(lines), flush=True)
        for key, value in differences.items():
            worst[key] = max(worst.get(key, 0.0), value)
    out.append("largest difference, CUDA copy vs CPU copy: " + ", ".join(f"{k} {v:.4f}" for k, v in worst.items()))
    with args.out.open("a") as handle:
        handle.write("\n".join(out) + "\n\n")
    print(out[-1])


if __name__ == "__main__":
    main()
