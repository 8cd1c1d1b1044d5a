"""What the default tolerance (``auto``) catches, and that it stays green on unchanged runs (issue 36).

    .venv-torch/bin/python benchmarks/tolerance_power.py --reruns 20

A project of its own (no ini: every setting at its default) with two host-memory tests: the torch
DDP example (examples/test_torch_ddp.py, gloo) and a small FSDP2 job (``fully_shard`` over a
4-layer TransformerEncoder, the job a new user's FSDP2 regression went unseen on). It records the
baselines once, reruns the unchanged tests ``--reruns`` times (each must pass; the spread is the
largest distance from the baseline), then grows each test's body by a kept buffer just under and
just over the allowance the default gives at its smallest baseline (the first must pass, the second
fail), and switches the FSDP2 job to ``reshard_after_forward=False``. Each run is a whole
``pytest --gpumem``; every figure is rank 0's peak of live allocations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests"))

from jobs import HOST_FSDP2 as FSDP2  # noqa: E402

from pytest_gpumem.config.spec import EXACT_TOLERANCE, parse_tolerance  # noqa: E402

CONFTEST = '''
import os

import pytest

MiB = 2**20


@pytest.fixture(autouse=True)
def grown():
    """GROW_MIB of live bytes kept for the whole body: a regression of exactly that size."""
    grow = float(os.environ.get("GROW_MIB", "0"))
    kept = bytearray(int(grow * MiB)) if grow else None
    yield kept
'''
TESTS = ["test_torch_ddp.py::test_torch_ddp", "test_fsdp2.py::test_fsdp2"]


def run(project: Path, label: str, *args: str, **env: str) -> dict[str, dict]:
    """One whole ``pytest --gpumem``: {test: {"status", "sizes": {nproc: gated MiB}}}."""
    report = project / f"{label}.json"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "--gpumem", "-q", "-p", "no:cacheprovider",
                           "--gpumem-launcher=torchrun", f"--gpumem-report={report}", *args, *TESTS],
                          cwd=project, capture_output=True, text=True, timeout=1800,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}, **env})
    if not report.exists():
        raise SystemExit(f"{label}: no report\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    out = {}
    for rec in json.loads(report.read_text())["tests"]:
        out[rec["test"].split("::")[-1]] = {"status": rec["status"],
                                            "sizes": {s["nproc"]: s["gated_mib"] for s in rec["sizes"]}}
    print(f"{label:28} {time.perf_counter() - started:6.1f} s  " + "  ".join(
        f"{name} {r['status']} " + "/".join(f"{m:.2f}" for m in r["sizes"].values()) for name, r in out.items()),
        flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reruns", type=int, default=20)
    args = parser.parse_args()
    exact = parse_tolerance(EXACT_TOLERANCE)
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        shutil.copy(ROOT / "examples" / "test_torch_ddp.py", project / "test_torch_ddp.py")
        (project / "test_fsdp2.py").write_text(FSDP2)
        (project / "conftest.py").write_text(CONFTEST)
        (project / "pytest.ini").write_text("[pytest]\n")  # every gpumem setting at its default
        base = run(project, "refresh", "--gpumem-refresh")
        reruns = [run(project, f"healthy rerun {i + 1}") for i in range(args.reruns)]
        spread = {name: max(abs(r[name]["sizes"][n] - mib) for r in reruns for n, mib in base[name]["sizes"].items())
                  for name in base} if reruns else {}
        green = {name: sum(r[name]["status"] == "passed" for r in reruns) for name in base}
        smallest = min(mib for r in base.values() for mib in r["sizes"].values())
        allowance = exact.allowance(smallest)  # the tightest allowance of any size here
        below = run(project, f"grown {allowance - 1:.1f} MiB", GROW_MIB=f"{allowance - 1:.3f}")
        above = run(project, f"grown {allowance + 1:.1f} MiB", GROW_MIB=f"{allowance + 1:.3f}")
        reshard = run(project, "reshard_after_forward=False", "-k", "fsdp2", RESHARD_AFTER_FORWARD="0")
    print(f"\ndefault tolerance: auto = {EXACT_TOLERANCE} here (same machine as the baseline: live allocations)")
    print(f"{'test':16} {'nproc':>5} {'baseline':>9} {'allowance':>9} {'spread':>7} {'green':>6} "
          f"{'+' + format(allowance - 1, '.1f') + ' MiB':>10} {'+' + format(allowance + 1, '.1f') + ' MiB':>10} "
          f"{'reshard=False':>22}")
    for name, rec in base.items():
        for n, mib in rec["sizes"].items():
            moved = (f"+{reshard[name]['sizes'][n] - mib:.1f} {reshard[name]['status']}" if name in reshard else "-")
            print(f"{name:16} {n:5} {mib:9.2f} {exact.allowance(mib):9.2f} {spread.get(name, 0):7.2f} "
                  f"{green[name]:>3}/{len(reruns):<2} {below[name]['status']:>10} {above[name]['status']:>10} "
                  f"{moved:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
