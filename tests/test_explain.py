"""Why did it inflate: provenance differences, declared config first, per-rank peak timing."""

from __future__ import annotations

import pytest

from pytest_gpumem.explain import config_provenance, imbalance, peak_times, provenance_diff, timeline_lines
from pytest_gpumem.sampling import Peak
from pytest_gpumem.verdict import SizeResult


def test_config_differences_come_first_then_versions_then_env():
    old = {"date": "2026-01-01", "torch": "2.12.0", "env.NCCL_BUFFSIZE": "4194304",
           "config.activation_checkpoint": "True"}
    new = {"date": "2026-02-01", "torch": "2.13.0", "config.activation_checkpoint": "False"}
    assert provenance_diff(old, new) == [
        "config.activation_checkpoint: True -> False",
        "torch: 2.12.0 -> 2.13.0",
        "env.NCCL_BUFFSIZE: 4194304 -> (unset)",
    ]


def test_config_is_flattened_for_the_baseline():
    assert config_provenance({"micro_batch": 4, "ckpt": True}) == {"config.ckpt": "True", "config.micro_batch": "4"}


def test_peak_timing_and_imbalance():
    result = SizeResult(
        world_size=2, device="cpu", duration_s=3.0,
        peaks={0: Peak(900.0, "high-water mark"), 1: Peak(600.0, "high-water mark")},
        timeline=((0.5, {0: 300.0, 1: 300.0}), (1.5, {0: 900.0, 1: 500.0}), (2.5, {0: 400.0, 1: 600.0})),
    )
    assert peak_times(result) == {0: 1.5, 1: 2.5}
    assert imbalance(result) == pytest.approx(1 / 3)
    assert timeline_lines([result]) == [
        "nproc=2 (3.0 s): rank 0 900.0 MiB at 1.50s, rank 1 600.0 MiB at 2.50s; imbalance 33.3%"]


@pytest.mark.slow
def test_failure_report_names_the_changed_flag_first(pytester, launch_tag, monkeypatch):
    pytester.makepyfile('''
import os
import pytest

@pytest.mark.gpumem(nproc=2, config={"micro_batch": 4})
def test_gpt2(gpumem_config):
    checkpointing = os.environ["CKPT"] == "1"
    gpumem_config({"activation_checkpoint": checkpointing})
    activations = bytearray((0 if checkpointing else 300) * 1024 * 1024)
''')
    monkeypatch.setenv("CKPT", "1")
    pytester.runpytest("--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("CKPT", "0")
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*peak * MiB > baseline * MiB + tolerance *",
        "*changed since the baseline (declared config first):*",
        "*config.activation_checkpoint: True -> False*",
        "*per-rank peaks over the run:*",
        "*nproc=2 (*s): rank 0 * MiB at *s, rank 1 * MiB at *s; imbalance *%*",
    ])
    stored = (pytester.path / "baselines" / "test_failure_report_names_the_changed_flag_first.py.json").read_text()
    assert '"config.activation_checkpoint": "True"' in stored and '"config.micro_batch": "4"' in stored
