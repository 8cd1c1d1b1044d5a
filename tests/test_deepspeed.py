"""DeepSpeed ZeRO under the plugin (issue 35): tests/jobs.py TORCH_ZERO, a 128 MiB model under
ZeRO-3, on DeepSpeed's CPU accelerator with gloo.

ZeRO-3 -> ZeRO-1 (the config's stage, declared on the marker) is the regression: every rank then
keeps the whole model and its gradients. At nproc=4 it reads 605 MiB against ZeRO-3's 526-545; at 2
the two are alike (733 MiB), so the test gates 4, simulated (``assume="alike"``: ZeRO-3 reads rank
0's broadcast lists to check the ranks agree). Real gloo against simulated at 2, 4 and 8 (within
0.3 MiB at 2, 18 MiB under at 4 and 8: gloo's reduce-scatter fallback holds a layer's gradient) is
benchmarks/results/framework_validation_deepspeed.txt, not repeated here (each DeepSpeed launch
costs about 20 s on 2 cores). One H200: tests/test_gpu.py -k deepspeed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import TORCH_ZERO

pytestmark = [pytest.mark.slow, pytest.mark.torch]

FRAMEWORKS = Path(sys.prefix) / "frameworks"  # make venvs puts DeepSpeed there (tests/frameworks.txt)

TESTS = '''

@pytest.mark.gpumem(nproc=4, device="cpu", simulate="on", assume="alike", config={"zero_stage": STAGE})
def test_zero():
    zero_job()
'''


@pytest.fixture
def deepspeed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (FRAMEWORKS / "deepspeed").is_dir():
        pytest.skip(f"DeepSpeed is not in {FRAMEWORKS} (make venvs)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FRAMEWORKS), os.environ.get("PYTHONPATH")])))


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, stage: str,
        *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    monkeypatch.setenv("ZERO_STAGE", stage)
    monkeypatch.delenv("CI", raising=False)
    report = pytester.path / f"zero{stage}.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                                           *args, timeout=900)
    records = {rec["test"].split("::")[-1]: rec for rec in json.loads(report.read_text())["tests"]}
    for name, rec in records.items():
        print(f"ZeRO-{stage} {name}: {rec['status']}",
              [(s["nproc"], round(s["gated_mib"], 2), s["simulated"]) for s in rec["sizes"]])
    return result, records


def test_zero3_to_zero1_fails_its_baseline_at_4_naming_the_config_change(pytester, monkeypatch, deepspeed_path,
                                                                         launch_tag):
    pytester.makepyfile(test_ds=TORCH_ZERO + TESTS)
    first, records = run(pytester, monkeypatch, "3", "--gpumem-refresh")
    first.assert_outcomes(passed=1)
    zero3 = records["test_zero"]["sizes"][0]
    assert zero3["simulated"] == [0], zero3["simulated"]  # assume=: the gated rank alone

    switched, records = run(pytester, monkeypatch, "1")
    switched.assert_outcomes(failed=1)
    zero1 = records["test_zero"]["sizes"][0]
    assert zero1["gated_mib"] > zero3["gated_mib"] + 40, (zero1["gated_mib"], zero3["gated_mib"])  # 605 vs 526-545
    lines = switched.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert lines[headline + 1].endswith("config.zero_stage: 3 -> 1"), lines[headline:headline + 2]
