"""A launcher of a team's own, added from a conftest (``pytest_gpumem_launchers``) without a fork of
the plugin: a gpumem test runs through it, and a name nobody registered is refused naming the ones
that are (issue 37)."""

from __future__ import annotations

import json

import pytest

CONFTEST = '''
import os

from pytest_gpumem.launching.launchers.direct import Direct


class Traced(Direct):
    """The direct launcher under a name of its own, writing each launch's size to TRACED_LOG."""

    name = "traced"

    def start(self, request, on_rank, options):
        with open(os.environ["TRACED_LOG"], "a") as log:
            log.write(f"{request.nproc}\\n")
        return super().start(request, on_rank, options)


def pytest_gpumem_launchers():
    return [Traced()]
'''

JOB = '''
import os

import pytest


@pytest.mark.gpumem(nproc=[1, 2], launcher="traced", max_ratio=1.5, allow_mib=16)
def test_job():
    ballast = bytearray(32 * 2**20)
    assert os.environ["WORLD_SIZE"] in ("1", "2")
'''


def test_a_launcher_added_from_a_conftest_runs_a_gpumem_test(pytester, monkeypatch, launch_tag, tmp_path):
    log = tmp_path / "traced.log"
    monkeypatch.setenv("TRACED_LOG", str(log))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_job=JOB)
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline=warn",
                                f"--gpumem-report={tmp_path / 'report.json'}")
    result.assert_outcomes(passed=1)
    assert {"1", "2"} <= set(log.read_text().split()), "both sizes went through the conftest's launcher"
    (record,) = json.loads((tmp_path / "report.json").read_text())["tests"]
    assert record["launcher"] == "traced" and [s["nproc"] for s in record["sizes"]] == [1, 2]


def test_a_launcher_nobody_registered_is_refused_naming_those_that_are(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_job=JOB.replace('launcher="traced"', 'launcher="mpirun"'))
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*launcher='mpirun' is not accepted: expected one of direct, oneflow, srun, "
                                 "torchrun, traced*"])
    unset = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-launcher=mpirun")
    assert unset.ret == pytest.ExitCode.USAGE_ERROR
    unset.stderr.fnmatch_lines(["*gpumem_launcher='mpirun' is not registered: expected one of direct, oneflow, "
                                "srun, torchrun, traced*"])


def test_a_conftest_cannot_take_a_built_in_launchers_name(pytester):
    pytester.makeconftest(CONFTEST.replace('name = "traced"', 'name = "torchrun"'))
    pytester.makepyfile(test_job=JOB)
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*pytest_gpumem_launchers: launcher name 'torchrun' is pytest-gpumem's own; "
                                 "choose another name*"])
