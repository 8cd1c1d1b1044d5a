"""A job whose smallest world is above 1 takes its ratio against a listed size (``reference=``):
a tensor-parallel job (TP=2 on a (dp, tp) mesh) marked ``nproc=[2, 8]``, real gloo ranks, no nproc=1
launched; healthy it passes, gathering its activations over dp it fails. Without ``reference`` the
unlisted nproc=1 it cannot run at is launched, and the failure says so and what to write."""

from __future__ import annotations

import json

import pytest
from jobs import TORCH_TP

# Imported before pytester's first snapshot of sys.modules: a torch imported inside one in-process run
# is taken out after it, and importing it again in the same process fails.
pytest.importorskip("torch")

TESTS = '''
@pytest.mark.gpumem(nproc=[2, 8], max_ratio=1.1, reference=2, device="cpu")
def test_tp_healthy():
    tp_job()


@pytest.mark.gpumem(nproc=[2, 8], max_ratio=1.1, reference=2, device="cpu")
def test_tp_gathers_over_dp():
    tp_job(gather_over_dp=True)
'''


@pytest.mark.torch
@pytest.mark.slow
def test_a_tp2_job_is_gated_2_to_8_against_its_reference_with_no_nproc1_launch(pytester, launch_tag, tmp_path):
    pytester.makepyfile(test_tp=TORCH_TP + TESTS)
    report = tmp_path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "warn",
                                f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    tests = {t["test"].split("::")[1]: t for t in json.loads(report.read_text())["tests"]}
    for name, test in tests.items():
        assert [s["nproc"] for s in test["sizes"]] == [2, 8], name  # nothing launched that nobody listed
        assert test["limits"]["reference"] == 2
    healthy, inflated = tests["test_tp_healthy"]["sizes"][1], tests["test_tp_gathers_over_dp"]["sizes"][1]
    print(f"ratio 8/2: healthy {healthy['ratio']:.3f}, gathering over dp {inflated['ratio']:.3f}")
    assert healthy["ratio"] <= 1.1 < inflated["ratio"]
    result.stdout.fnmatch_lines(["*_ test_tp_gathers_over_dp _*",
                                 "gpumem: * MiB > ratio limit * MiB (rank 0, nproc=8)"])
    result.stdout.fnmatch_lines(["*1.10 x * MiB (nproc=2) + 0 MiB = * MiB (ratio *x)*"])
    assert "test_tp_healthy" in result.stdout.str() and "1 ref" not in result.stdout.str()


@pytest.mark.torch
@pytest.mark.slow
def test_without_a_reference_the_unlisted_nproc1_is_launched_and_its_failure_says_what_to_write(
        pytester, launch_tag):
    pytester.makepyfile(test_tp=TORCH_TP + '''
@pytest.mark.gpumem(nproc=[2, 4], max_ratio=1.1, device="cpu")
def test_tp():
    tp_job()
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "warn")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*nproc=1 is not in the marker's nproc=[[]2, 4]: it was launched as max_ratio's "
                                 "reference; a job that cannot run at 1 rank takes its ratio against a listed "
                                 "size: reference=2*"])
