"""A job written with Hugging Face accelerate under the plugin (issue 35): tests/jobs.py
TORCH_ACCELERATE, ``Accelerator()`` and ``prepare()`` (DDP over gloo on CPU), launched for real.

The healthy job holds its figure from 1 to 2 ranks (1.00x); its twin gathers every rank's 64 MiB of
outputs (``accelerator.gather``) and keeps them, which grows with the world and fails ``max_ratio``
(1.17x).
Real against simulated at 2, 4 and 8: benchmarks/results/framework_validation_accelerate.txt."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobs import TORCH_ACCELERATE

pytestmark = [pytest.mark.slow, pytest.mark.torch]

FRAMEWORKS = Path(sys.prefix) / "frameworks"  # make venvs puts accelerate there (tests/frameworks-nodeps.txt)

TESTS = '''

@pytest.mark.gpumem(nproc=[1, 2], device="cpu", max_ratio=1.02)
def test_ddp():
    accelerate_job()


@pytest.mark.gpumem(nproc=[1, 2], device="cpu", max_ratio=1.02)
def test_ddp_gathering_the_batch():
    accelerate_job(gather=True)
'''


def test_accelerate_ddp_holds_its_ratio_and_gathering_every_ranks_batch_fails_it(pytester, monkeypatch, launch_tag):
    if not (FRAMEWORKS / "accelerate").is_dir():
        pytest.skip(f"accelerate is not in {FRAMEWORKS} (make venvs)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FRAMEWORKS), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_acc=TORCH_ACCELERATE + TESTS)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline",
                                           "ignore", f"--gpumem-report={report}", timeout=900)
    records = {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}
    ratios = {name: rec["sizes"][-1]["ratio"] for name, rec in records.items()}
    print(ratios)
    result.assert_outcomes(passed=1, failed=1)
    assert records["test_ddp_gathering_the_batch"]["status"] == "failed"
    assert ratios["test_ddp"] <= 1.02 < ratios["test_ddp_gathering_the_batch"]  # 1.00x and 1.17x measured
    result.stdout.fnmatch_lines(["*rank 0 at nproc=2 *: peak * MiB > 1.02 x * MiB (nproc=1)*"])
