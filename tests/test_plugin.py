"""Plugin behaviour with plain-Python bodies: options, marker errors, skips, faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import processes_tagged

pytestmark = pytest.mark.slow


def test_the_markers_help_names_every_marker_argument(pytester):
    """`pytest --markers` is written from the marker argument table, so it cannot drift from the parser."""
    from pytest_gpumem.config.spec import MARKER_ARGUMENTS

    result = pytester.runpytest("--markers", "-p", "no:cacheprovider")
    line = next(x for x in result.outlines if x.startswith("@pytest.mark.gpumem("))
    assert [a.name for a in MARKER_ARGUMENTS if f"{a.name}=" not in line] == []
    assert "figures=None" in line and "allocated_tolerance=[gpumem_allocated_tolerance]" in line


def test_marked_tests_skip_without_the_option(pytester):
    pytester.makepyfile('''
import pytest
from pytest_gpumem import gpumem

@gpumem(nproc=[2, 4], max_ratio=1.1)
def test_big():
    raise AssertionError("never runs in the user's process")

def test_plain():
    pass
''')
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*gpumem test (launches nproc 1, 2, 4): run with pytest --gpumem*"])


@pytest.mark.parametrize(
    "marker, message",
    [
        ("nproc=0", "nproc=0 is not accepted: expected an int or a list of ints from 1 to 1024"),
        ("max_mib='lots'", "max_mib='lots' is not accepted: expected a number"),
        ("max_ratio=-1", "max_ratio=-1 is not accepted: expected a number > 0"),
        ("nprocs=2", "unknown argument 'nprocs'"),
        ("tolerance='12 parsecs'", "tolerance='12 parsecs' is not accepted"),
        ("nproc=[2, 8], max_ratio={2: 0.6}", "max_ratio={2: 0.6} is not accepted: it has no cap for nproc=8; give "
                                             "one for each listed size above the reference nproc=1 (2, 8)"),
    ],
)
def test_bad_marker_is_its_tests_error_naming_test_and_argument(pytester, marker, message):
    pytester.makepyfile(f'''
import pytest

@pytest.mark.gpumem({marker})
def test_job():
    pass

def test_plain():
    pass
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, passed=1)  # the module's other tests run (issue 64)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_job*",
                                 f"*test_bad_marker_*.py::test_job: invalid gpumem marker: {message}*"])


def test_every_bad_marker_of_a_module_is_named(pytester):
    """Three bad markers in one file (one inside a class): three messages, not just the first."""
    pytester.makepyfile(test_three='''
import pytest

@pytest.mark.gpumem(nproc=0)
def test_a():
    pass

@pytest.mark.gpumem(max_mib="lots")
def test_b():
    pass

@pytest.mark.gpumem(nproc=1)
def test_fine():
    pass

class TestGroup:
    @pytest.mark.gpumem(nprocs=2)
    def test_c(self):
        pass
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=3, skipped=1)  # each bad marker its own test's error; the good one skips
    result.stdout.fnmatch_lines_random([
        "*test_three.py::test_a: invalid gpumem marker: nproc=0*",
        "*test_three.py::test_b: invalid gpumem marker: max_mib='lots'*",
        "*test_three.py::TestGroup::test_c: invalid gpumem marker: unknown argument 'nprocs'*",
    ])


def test_a_bad_marker_does_not_stop_the_modules_other_gpumem_tests(pytester, monkeypatch):
    """Issue 64: ``nprocs=`` in one test stopped the whole file's collection; with --gpumem, the file's
    other gpumem test launches and passes, the bad one errors at its setup, naming its argument."""
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_mixed='''
import pytest

@pytest.mark.gpumem(nprocs=2)
def test_typo():
    pass

@pytest.mark.gpumem(nproc=1, device="cpu")
def test_fine():
    pass
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(errors=1, passed=1)
    result.stdout.fnmatch_lines(["*test_mixed.py::test_typo: invalid gpumem marker: unknown argument 'nprocs'*"])


@pytest.mark.parametrize("spelling", ["two words", "equals"])
def test_an_option_value_never_moves_the_baselines_out_of_the_project(pytester, tmp_path, spelling):
    """`--gpumem-plots /tmp/x` without an ini file made pytest take /tmp/x for a test path and put
    the rootdir, and so the baselines, in /tmp: stopped with an error that says how to write it."""
    pytester.path.joinpath("pytest.ini").unlink(missing_ok=True)
    pytester.path.joinpath("tox.ini").unlink(missing_ok=True)
    plots = tmp_path / "elsewhere" / "plots"
    plots.mkdir(parents=True)
    pytester.makepyfile("def test_a(): pass")
    args = ["--gpumem-plots", str(plots)] if spelling == "two words" else [f"--gpumem-plots={plots}"]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    if spelling == "equals":
        result.assert_outcomes(passed=1)
        return
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gpumem-plots {plots}: pytest took * for a test path when it chose the "
                                 f"rootdir*Write --gpumem-plots={plots}, or pass --rootdir*"])


def test_bad_ini_value_is_a_usage_error_naming_the_key(pytester):
    pytester.makeini("[pytest]\ngpumem_timeout = soon\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*Invalid gpumem_timeout 'soon' from the ini file: expected a number of seconds > 0*"])


def test_hung_rank_times_out_with_its_stack_and_nothing_left(pytester, launch_tag):
    pytester.makepyfile('''
import os
import time
import pytest

def wait_for_peer():
    time.sleep(600)

# 20 s: on a loaded 2-core CI machine rank 0 itself once took over 4 s to start and report.
@pytest.mark.gpumem(nproc=2, timeout=20)
def test_hangs():
    if os.environ["RANK"] == "1":
        wait_for_peer()

@pytest.mark.gpumem(nproc=2)
def test_next_one_runs():
    pass
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 1 of 2 hung: no result when the launch timed out after 20 s at nproc=2 (launcher direct)*",
        "*rank 1 Python stack when the timeout hit*",
        "*in wait_for_peer*",
    ])
    assert processes_tagged(launch_tag) == []


def test_rank_killed_by_a_signal_is_named(pytester, launch_tag):
    pytester.makepyfile('''
import os
import signal
import pytest

@pytest.mark.gpumem(nproc=2)
def test_segfaults():
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSEGV)
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 2 ended without a result (killed by SIGSEGV)*"])


def test_child_that_outlives_its_rank_is_killed(pytester, launch_tag):
    pytester.makepyfile('''
import os
import subprocess
import sys
import pytest

@pytest.mark.gpumem(nproc=1)
def test_leaves_a_daemon():
    # A grandchild in a session of its own: not in the launch's process group.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert processes_tagged(launch_tag) == []


def test_host_peak_is_the_peak_of_live_allocations_spike_included(pytester, launch_tag):
    """A 300 MiB buffer held for a moment counts in full; RSS is reported beside it, not gated."""
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=1, max_mib=150)
def test_spike():
    buf = bytearray(300 * 1024 * 1024)
    del buf
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    peak = float(text.split("rank 0 at nproc=1 (cpu): peak ")[1].split(" MiB")[0])
    assert 300 < peak < 300 + 40, peak
    result.stdout.fnmatch_lines(["*[[]live allocations (memray)[]]*",
                                 "*resident high-water mark (VmHWM, not gated*"])


def test_allocated_but_untouched_memory_counts(pytester, launch_tag):
    """What the job asked for counts, touched or not: RSS would miss these 512 MiB entirely."""
    pytester.makepyfile('''
import mmap
import pytest

@pytest.mark.gpumem(nproc=1, max_mib=400)
def test_reserve():
    region = mmap.mmap(-1, 512 * 1024 * 1024)   # anonymous, never written: no page resident
    region.close()
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=1 (cpu): peak 5* MiB > max_mib 400.0 MiB*"])


def test_reference_launch_is_reused_by_tests_with_the_same_program(pytester, launch_tag, tmp_path):
    runs = tmp_path / "runs.txt"
    pytester.makepyfile(job=f'''
import os
with open({str(runs)!r}, "a") as f:
    f.write(os.environ["WORLD_SIZE"] + "\\n")
''')
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=2, script="job.py", max_ratio=1.5)
def test_two():
    pass

@pytest.mark.gpumem(nproc=3, script="job.py", max_ratio=1.5)
def test_three():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert sorted(runs.read_text().split()) == ["1", "2", "2", "3", "3", "3"]  # one nproc=1 launch
    result.stdout.fnmatch_lines(["*test_three*1[*]*pass*", "*reference reused*"])


def test_rank_peak_does_not_inherit_the_memory_of_pytest(pytester, launch_tag):
    """Linux carries a parent's peak into a child's ru_maxrss across fork + exec: not ours."""
    ballast = bytearray(400 * 1024 * 1024)  # this pytest process is now 400 MiB bigger
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=1, max_mib=200)
def test_small():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert len(ballast) > 0


def test_one_to_eight_ranks_report_every_size_and_name_the_largest_growth(pytester, launch_tag):
    """The 1 -> 8 scaling logic on CPU: memory that grows with the world size fails at every size over,
    the headline naming the size furthest over its limit."""
    pytester.makepyfile('''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2, 4, 8], max_ratio=1.5)
def test_grows_with_world():
    per_peer = bytearray(int(os.environ["WORLD_SIZE"]) * 10 * 1024 * 1024)   # a buffer per peer

@pytest.mark.gpumem(nproc=[1, 2, 4, 8], max_ratio=1.5)
def test_flat():
    local = bytearray(10 * 1024 * 1024)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "gpumem: * MiB > * MiB (*nproc=8); 1 more limit exceeded",
        "*rank 0 peak, nproc 1: * MiB | 2: * MiB (*x) | 4: * MiB (*x) FAIL | 8: * MiB (*x) FAIL*",
        "*nproc=8 cpu MiB per rank {0: *, 1: *, 2: *, 3: *, 4: *, 5: *, 6: *, 7: *}*",
    ])


def test_a_cap_per_size_fails_a_sharded_job_that_stops_shrinking_and_refresh_suggests_the_caps(
        pytester, launch_tag):
    """Issue 55: state sharded over the world shrinks with N; the twin that also gathers a buffer from
    every rank passes at 2 and fails at 8 with no baseline stored, and the refresh prints the caps each
    test would pass with."""
    pytester.makepyfile('''
import os
import pytest

MiB = 1024 * 1024
CAPS = {2: 0.65, 8: 0.3}

def shard():
    return bytearray(64 * MiB // int(os.environ["WORLD_SIZE"]))

@pytest.mark.gpumem(nproc=[2, 8], max_ratio=CAPS)
def test_sharded():
    state = shard()

@pytest.mark.gpumem(nproc=[2, 8], max_ratio=CAPS)
def test_gathers_from_every_rank():
    state, gathered = shard(), bytearray(int(os.environ["WORLD_SIZE"]) * 2 * MiB)
''')
    result = pytester.runpytest("--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=8 (cpu): peak * MiB > 0.30 x * MiB (nproc=1) + 0 MiB = * MiB*"])
    assert "at nproc=2 (cpu): peak" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*ratio limits this run suggests*",
                                 "*::test_sharded: max_ratio={2: 0.*, 8: 0.*} (measured 0.5*x at 2, 0.2*x at 8, "
                                 "each + 0.02; the marker has {2: 0.65, 8: 0.3})"])


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a machine with a GPU: device='auto' reads it")
def test_a_cuda_error_under_device_auto_without_a_gpu_says_to_mark_it_device_gpu(pytester, launch_tag):
    """Issue 55: the error torch's CPU build raises (raised here without torch: this machine has no GPU)."""
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=1)
def test_cuda_job():
    raise AttributeError("module 'torch._C' has no attribute '_cuda_setDevice'")
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 0 of 1 failed: AttributeError: module 'torch._C' has no attribute *",
                                 'hint: this job uses CUDA and this machine has no GPU: mark it device="gpu" *'])


def test_v_says_each_launch_s_shows_rank_0_live_and_a_failed_rank_quotes_its_own_output(pytester, launch_tag):
    """Issue 55: 15 s with nothing on the screen, and a rank's prints never shown, even with -s."""
    pytester.makepyfile('''
import os
import pytest

@pytest.mark.gpumem(nproc=2)
def test_prints():
    for step in range(3):
        print(f"rank {os.environ['RANK']} step {step}", flush=True)
    assert os.environ["RANK"] == "0", "rank 1 lost its shard"
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "-v", "-s")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["gpumem: *::test_prints nproc=2: launching",
                                 "[[]rank 0] rank 0 step 0", "[[]rank 0] rank 0 step 2",
                                 "gpumem: *::test_prints nproc=2: failed in * s"])
    assert "[rank 0] rank 1" not in result.stdout.str()  # only rank 0 live
    result.stdout.fnmatch_lines(["rank 1 of 2 failed: AssertionError: rank 1 lost its shard*",
                                 "--- the rank's own output (all of it) ---", "rank 1 step 0", "rank 1 step 1",
                                 "rank 1 step 2"])
    pytester.makepyfile(test_passes="import pytest\n\n@pytest.mark.gpumem(nproc=1)\ndef test_passes():\n    pass\n")
    # a subprocess: pytest's fd capture of the test's output is on, as at a terminal
    verbose = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "-v", "test_passes.py")
    verbose.stdout.fnmatch_lines(["gpumem: *::test_passes nproc=1: launching",
                                  "gpumem: *::test_passes nproc=1: done in * s"])
    quiet = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    assert "launching" not in quiet.stdout.str() and "[rank 0]" not in quiet.stdout.str()


def test_fast_rank_exit_still_runs_the_frameworks_exit_handlers(pytester, launch_tag, tmp_path):
    """Ranks skip the interpreter's teardown, not atexit: frameworks shut down there (OneFlow's env)."""
    pytester.makepyfile(f'''
import atexit
import os
import pytest

@pytest.mark.gpumem(nproc=2)
def test_registers_a_shutdown():
    path = os.path.join({str(tmp_path)!r}, "shutdown-" + os.environ["RANK"])
    atexit.register(lambda: open(path, "w").close())
''')
    pytester.runpytest("--gpumem", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shutdown-0", "shutdown-1"]


def test_failing_program_in_script_mode_shows_its_output(pytester, launch_tag):
    pytester.makepyfile(train='''
import os
raise SystemExit("config file not found: configs/gpt2.py (rank " + os.environ["RANK"] + ")")
''')
    pytester.makepyfile(test_script='''
import pytest

@pytest.mark.gpumem(nproc=2, script="train.py")
def test_train():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 0 of 2 failed (exit code 1); last lines of its output:*",
                                 "*config file not found: configs/gpt2.py (rank 0)*"])


def test_rank_switches_reach_the_ranks_resolved_and_a_marker_env_wins(pytester, launch_tag):
    pytester.makeini("[pytest]\ngpumem_boxing = off\n")
    pytester.makepyfile('''
import os
import pytest

@pytest.mark.gpumem(nproc=1)
def test_session_values():
    assert (os.environ["GPUMEM_FAST_EXIT"], os.environ["GPUMEM_BOXING"]) == ("0", "0")

@pytest.mark.gpumem(nproc=1, env={"GPUMEM_BOXING": "1"})
def test_marker_env_wins():
    assert (os.environ["GPUMEM_FAST_EXIT"], os.environ["GPUMEM_BOXING"]) == ("0", "1")
''')
    result = pytester.runpytest("--gpumem", "--gpumem-fast-exit=false", "-p", "no:cacheprovider",
                                "--gpumem-missing-baseline=ignore")
    result.assert_outcomes(passed=2)


def test_the_record_says_what_pytest_says_of_xfail(pytester, launch_tag, tmp_path):
    """xfailed, xpassed, and a strict xfail that passed: pytest fails it, and so does the record."""
    report = tmp_path / "report.json"
    pytester.makepyfile('''
import pytest

@pytest.mark.xfail(reason="over")
@pytest.mark.gpumem(nproc=1, max_mib=1)
def test_xfailed():
    pass

@pytest.mark.xfail(reason="fixed since")
@pytest.mark.gpumem(nproc=1)
def test_xpassed():
    pass

@pytest.mark.xfail(strict=True, reason="fixed since")
@pytest.mark.gpumem(nproc=1)
def test_strict():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}")
    result.assert_outcomes(xfailed=1, xpassed=1, failed=1)
    got = {r["test"].split("::")[1]: (r["status"], r["cause"]) for r in json.loads(report.read_text())["tests"]}
    assert got == {"test_xfailed": ("xfailed", "limit"), "test_xpassed": ("xpassed", None),
                   "test_strict": ("failed", "xpass-strict")}
