"""No shape rule stricter than CUDA's kernels (issue 63): torch's own op database run on the fake GPU
against what the CUDA build accepted on a GPU (``tests/op_rules.py``; the GPU's table and its command
in ``benchmarks/results/op_rules_gpu.json`` and ``op_rules.txt``).

A sample CUDA accepted must run on the fake GPU with the outputs' shapes and dtypes CUDA gave, or stop
with the fake GPU's word that it needs values it does not have (a data-dependent size, named with the
op: docs/fake-gpu.md). Anything else is a rule a team would meet as a crash. ``make test`` runs every
4th op of the database; the whole database is ``make test-long``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # what torch's op database imports
pytestmark = [pytest.mark.torch, pytest.mark.skipif(torch.cuda.is_available(),
                                                   reason="a real GPU here: the fake GPU is for machines without")]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import op_rules  # noqa: E402 - beside this file

GPU_TABLE = ROOT / "benchmarks" / "results" / "op_rules_gpu.json"
# Samples whose fake answer is not CUDA's, with why (docs/fake-gpu.md lists them). One that comes right
# fails the test, so that the list stays true.
APART: dict[str, str] = {}


def _compare(tmp_path: Path, stride: int) -> dict[str, Any]:
    out = tmp_path / "fake.json"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "op_rules.py"), "--stride", str(stride),
                           "--out", str(out), "--against", str(GPU_TABLE)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(op_rules.COMPARISON)]
    return json.loads(line.removeprefix(op_rules.COMPARISON))


def _check(found: dict[str, Any]) -> None:
    assert found["same"] > 0
    missed = [line for line in found["stricter"] + found["different"] if line.split(":")[0] not in APART]
    assert missed == [], "a fake rule stricter than, or different from, CUDA's kernel"


def test_every_4th_op_of_torchs_database_runs_on_the_fake_gpu_as_cuda_ran_it(tmp_path: Path) -> None:
    _check(_compare(tmp_path, 4))


@pytest.mark.long  # make test-long: the whole database (about 8,000 samples a dtype, 2 dtypes)
def test_every_op_of_torchs_database_runs_on_the_fake_gpu_as_cuda_ran_it(tmp_path: Path) -> None:
    _check(_compare(tmp_path, 1))
