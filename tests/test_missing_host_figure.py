"""A rank that ends well but leaves no peak of live allocations: its size errors, naming the rank and
why, and is never gated on its resident high-water mark (issue 64: a healthy OneFlow job read its
VmHWM, 538 MiB, against a 266 MiB limit). A rank that died keeps its labelled VmHWM.

Real launches: the job itself cuts its rank's exit short, as a framework's shutdown could.
"""

import json

import pytest

pytestmark = pytest.mark.usefixtures("launch_tag")

JOBS = '''
import atexit
import os
import signal

import pytest

# The cap is far above any figure here: a VmHWM gated in place of the missing figure would pass.
@pytest.mark.gpumem(nproc=2, max_mib=100000)
def test_cuts_its_exit_short():
    if os.environ["RANK"] == "1":
        atexit.register(os._exit, 0)  # runs before the plugin's exit report, which never comes

@pytest.mark.gpumem(nproc=2, max_mib=100000)
def test_killed_at_its_exit():
    if os.environ["RANK"] == "1":
        atexit.register(os.kill, os.getpid(), signal.SIGKILL)

@pytest.mark.gpumem(nproc=2, max_mib=100000)
def test_healthy():
    pass
'''


def test_a_rank_that_ended_well_without_its_peak_errors_and_a_dead_one_keeps_its_vmhwm(pytester):
    pytester.makepyfile(JOBS)
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "-rA", "--gpumem-report=report.json")
    result.assert_outcomes(passed=2, failed=1)
    text = result.stdout.str()
    cut = text.split("test_cuts_its_exit_short _")[1].split("short test summary")[0]
    assert ("rank 1 of 2: its host figure, the peak of live allocations, is missing (its test ended and its "
            "launch exited 0, but it wrote no exit report") in cut, cut
    assert "rank 0 of 2" not in cut  # the rank that reported is not named
    table = text.split("gpumem: peak memory per rank")[1]
    healthy = next(line for line in table.splitlines() if "test_healthy" in line)
    killed = next(line for line in table.splitlines() if "test_killed_at_its_exit" in line)
    assert "VmHWM" not in healthy and "passed" in healthy, healthy
    # rank 1 was killed before it reported: its figure is its VmHWM, shown as such (docs/measurement.md)
    assert "passed" in killed and "VmHWM" in killed, killed
    # ...and a note names the rank and how it ended: its test passed, so nothing else says it died
    tests = {t["test"].split("::")[-1]: t for t in json.loads((pytester.path / "report.json").read_text())["tests"]}
    said = [n for n in tests["test_killed_at_its_exit"]["notes"] if n.startswith("rank 1 of 2: its test passed")]
    assert said and "killed by SIGKILL" in said[0] and "high-water mark (VmHWM)" in said[0], said
    assert not any("its test passed, but" in n for n in tests["test_healthy"]["notes"])


def test_a_rank_whose_tracker_was_switched_off_keeps_its_vmhwm(pytester):
    """Tracking off (a job that runs memray itself): the high-water mark is the figure, no error."""
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=1, max_mib=100000, env={"GPUMEM_TRACK_ALLOCATIONS": "0"})
def test_untracked():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
