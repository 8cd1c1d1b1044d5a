"""The default tolerance (``auto``) catches a real FSDP2 regression on a small host job (issue 36).

With the old default, ``max(5%, 32MiB)``, FSDP2's ``reshard_after_forward=False`` (+9 MiB on rank 0
of ~340 MiB, at every size) passed. ``auto`` compares a host figure of live allocations against a
baseline from the same CPU model at ``max(1%, 4MiB)``: reruns read within 0.01 MiB, so the change
fails and an unchanged rerun passes (20 reruns: benchmarks/results/tolerance_power.txt).
"""

from __future__ import annotations

import json

import pytest
from jobs import HOST_FSDP2

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, label: str, *args: str,
         reshard: str = "1") -> tuple[pytest.RunResult, dict]:
    monkeypatch.setenv("RESHARD_AFTER_FORWARD", reshard)
    monkeypatch.delenv("CI", raising=False)
    report = pytester.path / f"{label}.json"
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "--gpumem-launcher=torchrun",
                                           f"--gpumem-report={report}", *args, timeout=900)
    return result, json.loads(report.read_text())["tests"][0]


def test_reshard_after_forward_false_fails_the_default_tolerance_and_an_unchanged_rerun_passes(
        pytester, monkeypatch, launch_tag):
    pytester.makepyfile(test_fsdp2=HOST_FSDP2)
    pytester.makeini("[pytest]\n")  # every gpumem setting at its default
    first, _ = _run(pytester, monkeypatch, "refresh", "--gpumem-refresh")
    first.assert_outcomes(passed=1)

    again, record = _run(pytester, monkeypatch, "rerun")
    again.assert_outcomes(passed=1)
    assert record["limits"]["tolerance"] == "auto"

    changed, record = _run(pytester, monkeypatch, "reshard", reshard="0")
    changed.assert_outcomes(failed=1)
    failing = [(s["nproc"], c["kind"]) for s in record["sizes"] for c in s["checks"] if not c["ok"]]
    assert failing == [(1, "baseline"), (2, "baseline")], failing
    changed.stdout.fnmatch_lines(["*rank 0 at nproc=1 (cpu): peak * MiB > baseline * MiB + max(1% = *, 4) MiB = *"])
