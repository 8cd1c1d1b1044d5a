"""Faults and bad input: nothing hangs, nothing leaks, nothing is lost (docs/reliability.md).

Every fault is a real launch: a rank that exits, dies by a signal, hangs, runs out of memory,
loses its launcher, leaves a child behind; pytest itself interrupted or terminated; the
rendezvous port taken; NVML missing or broken; the baseline folder unusable. Each asserts the
message the user reads (rank, exit code, signal or timeout), that the session goes on to the
next test, and that no process of the launch is left (``processes_tagged``).

Bodies are plain Python except where a framework is the point; a pytest that is signalled, or a
launch that hangs, runs in a subprocess (``runpytest_subprocess``, bounded by ``timeout``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import processes_tagged
from pytest_gpumem.config.settings import OPTIONS
from pytest_gpumem.judging.baseline import BaselineStore, Entry
from pytest_gpumem.launching.leases import GpuLeases, default_lease_dir
from pytest_gpumem.sampling.identity import platform_key

pytestmark = pytest.mark.slow

# Not pytest.importorskip: a framework imported by one test is dropped again by pytester's
# sys.modules snapshot, and torch cannot be imported twice in one process.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
needs_oneflow = pytest.mark.skipif(importlib.util.find_spec("oneflow") is None, reason="needs OneFlow")
TORCH = [pytest.mark.torch, needs_torch]
ONEFLOW = [pytest.mark.oneflow, needs_oneflow]

SUBPROCESS_TIMEOUT_S = 90  # the outer bound: a regression that hangs fails here, it does not hang CI

# Shared by every body: how a rank finds the launcher above it, and the pytest above that.
HELPERS = '''
import os
import resource
import signal
import subprocess
import sys
import time

import psutil
import pytest

LAUNCHERS = ("torch.distributed.run", "oneflow.distributed.launch")


def launcher_pid():
    """The launcher process above this rank (torchrun or OneFlow's launch module)."""
    for proc in psutil.Process().parents():
        if any(word in part for part in proc.cmdline() for word in LAUNCHERS):
            return proc.pid
    raise AssertionError("no launcher above this rank")


def pytest_pid():
    """The user's pytest: the first ancestor running pytest that is neither a rank nor a launcher."""
    for proc in psutil.Process().parents():
        cmd = " ".join(proc.cmdline())
        if "pytest" in cmd and "pytest_gpumem.rankside.rank" not in cmd and not any(w in cmd for w in LAUNCHERS):
            return proc.pid
    raise AssertionError("no pytest above this rank")


def wait_for_peer():
    time.sleep(600)
'''

NEXT = '''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_next():
    pass
'''


def run_inline(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--gpumem", "-p", "no:cacheprovider", *args)


def run_subprocess(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", *args,
                                         timeout=SUBPROCESS_TIMEOUT_S)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR of the pytest under test (and of its launches): what a fault leaves there is seen,
    and goes away with this test's own tmp_path."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def seed_baseline(pytester: pytest.Pytester, test: str, mib: float = 1234.5) -> tuple[Path, bytes]:
    """A stored baseline for ``test`` at nproc=2: a failed launch must leave it as it is."""
    store = BaselineStore(pytester.path / "baselines")
    ranks = {0: mib, 1: mib}
    store.update(test, platform_key("cpu"),
                 {2: Entry(mib, ranks, 0, "cpu", "live allocations (memray)", {"date": "2026-01-01"})})
    file = store.file_for(test)
    return file, file.read_bytes()


# --- 1, 2, 4: a rank exits, dies by a signal, runs out of host memory (direct launcher) -----------

DIRECT_FAULTS = {
    "sys-exit": ('''
    if os.environ["RANK"] == "1":
        sys.exit(3)''', ["*rank 1 of 2 failed:*", "*SystemExit: 3*"]),
    "os-exit": ('''
    if os.environ["RANK"] == "1":
        os._exit(3)''', ["*rank 1 of 2 ended without a result (exit code 3)*"]),
    "sigsegv": ('''
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSEGV)''',
                ["*rank 1 of 2 ended without a result (killed by SIGSEGV); last lines of its output:*",
                 "*Fatal Python error: Segmentation fault*",
                 "*test_fault.py\", line * in test_fault*"]),
    "sigkill": ('''
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)''',
                ["*rank 1 of 2 ended without a result (killed by SIGKILL (kill -9, or the kernel's OOM killer*"]),
    "memory-error": ('''
    if os.environ["RANK"] == "1":
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        size = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (size + 200 * 2**20, hard))
        ballast = bytearray(1024 * 2**20)   # 1 GiB against a 200 MiB allowance''',
                     ["*rank 1 of 2 failed:*", "*MemoryError*"]),
}


def direct_fault_project(pytester: pytest.Pytester, case: str) -> tuple[list[str], Path, bytes]:
    """test_fault.py with DIRECT_FAULTS[case] in rank 1, then test_next, and a stored baseline for
    test_fault: (the lines the failure must show, the baseline file, its bytes before the run)."""
    body, lines = DIRECT_FAULTS[case]
    pytester.makepyfile(test_fault=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_fault():{body}
    time.sleep(0.5)  # the healthy rank is still running when its peer fails
''' + NEXT)
    stored, before = seed_baseline(pytester, "test_fault.py::test_fault")
    return lines, stored, before


@pytest.mark.parametrize("case", sorted(DIRECT_FAULTS))
def test_rank_fault_is_named_the_session_goes_on_and_baselines_stay(pytester, launch_tag, case):
    lines, stored, before = direct_fault_project(pytester, case)
    result = run_inline(pytester, "--gpumem-refresh")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(lines)
    assert processes_tagged(launch_tag) == []
    doc = json.loads(stored.read_text())
    assert json.loads(before)["tests"]["test_fault"] == doc["tests"]["test_fault"], "a failed launch never refreshes"
    assert "test_next" in doc["tests"], "the next test ran and refreshed its own entry"


def test_rank_killed_as_the_oom_killer_would_keeps_its_peak(pytester, launch_tag, tmp_path):
    """SIGKILL after 250 MiB: the test fails naming rank and signal, and the rank's peak is kept."""
    report = tmp_path / "report.json"
    pytester.makepyfile(test_oom=HELPERS + '''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_oom_killed():
    if os.environ["RANK"] == "1":
        ballast = bytearray(250 * 2**20)   # zero-filled: resident
        time.sleep(0.5)                     # seen by the parent's sampler
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
''' + NEXT)
    result = run_inline(pytester, f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 2 ended without a result (killed by SIGKILL (*OOM killer*"])
    sizes = {r["test"]: r["sizes"] for r in json.loads(report.read_text())["tests"]}
    assert sizes["test_oom.py::test_oom_killed"][0]["ranks"]["1"] > 250
    assert processes_tagged(launch_tag) == []


# --- 1, 2, 3, 5 under torchrun ---------------------------------------------------------------------

TORCHRUN_FAULTS = {
    "os-exit": ('''
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(30)''', ["*rank 1 of 2 ended without a result (torchrun launcher exit code 1)*",
                        "*Root Cause (first observed failure):*", "*rank      : 1 (local_rank: 1)*",
                        "*exitcode  : 3 (pid: *"]),
    "sigsegv": ('''
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(30)''', ["*rank 1 of 2 ended without a result (torchrun launcher exit code 1)*",
                        "*Root Cause (first observed failure):*", "*rank      : 1 (local_rank: 1)*",
                        "*exitcode  : -11 (pid: *SIGSEGV*"]),
    "launcher-killed": ('''
    if os.environ["RANK"] == "1":
        os.kill(launcher_pid(), signal.SIGKILL)
    time.sleep(30)''', ["*rank 0 of 2 ended without a result (torchrun launcher killed by SIGKILL*",
                        "*rank 1 of 2 ended without a result (torchrun launcher killed by SIGKILL*"]),
}


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("case", sorted(TORCHRUN_FAULTS))
def test_torchrun_fault_is_named_and_the_session_goes_on(pytester, launch_tag, case):
    body, lines = TORCHRUN_FAULTS[case]
    pytester.makepyfile(test_fault=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, launcher="torchrun", timeout=60)
def test_fault():{body}


@pytest.mark.gpumem(nproc=2, launcher="torchrun", timeout=60)
def test_next():
    pass
''')
    result = run_inline(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(lines)
    assert "timed out" not in result.stdout.str(), "a dead rank or launcher ends the launch at once"
    assert processes_tagged(launch_tag) == []


@pytest.mark.torch
@needs_torch
def test_torchrun_hang_ends_at_timeout_with_the_stack(pytester, launch_tag):
    pytester.makepyfile(test_hang=HELPERS + '''

@pytest.mark.gpumem(nproc=2, launcher="torchrun", timeout=10)  # torchrun starts slowly on a busy machine
def test_hangs():
    if os.environ["RANK"] == "1":
        wait_for_peer()


@pytest.mark.gpumem(nproc=2, launcher="torchrun", timeout=60)
def test_next():
    pass
''')
    result = run_subprocess(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 1 of 2 hung: no result when the launch timed out after 10 s at nproc=2 (launcher torchrun)*",
        "*rank 1 Python stack when the timeout hit*",
        "*in wait_for_peer*",
    ])
    assert processes_tagged(launch_tag) == []


# --- The rank that failed first is named first (issue 22) ----------------------------------------
# A rank that raises, dies by a signal or hangs while its peer finishes: the failure and pytest's
# short summary name that rank and its error first; the rank the plugin itself stopped comes last,
# labelled so, never as a failure of its own.

FIRST_FAILURES = {
    "raises": ('''
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom in rank 1")
    time.sleep(30)''', 60, "rank 1 of 2 failed: RuntimeError: boom in rank 1", True),
    "segfaults": ('''
    if os.environ["RANK"] == "1":
        import ctypes
        ctypes.string_at(0)  # a real segmentation fault: reads address 0
    time.sleep(30)''', 60, "rank 1 of 2 ended without a result (killed by SIGSEGV); last lines of its output:", True),
    "hangs": ('''
    if os.environ["RANK"] == "1":
        wait_for_peer()''', 6, "rank 1 of 2 hung: no result when the launch timed out after 6 s at nproc=2 "
                               "(launcher direct)", False),
}


@pytest.mark.parametrize("case", sorted(FIRST_FAILURES))
def test_the_rank_that_failed_first_is_named_first(pytester, launch_tag, monkeypatch, case):
    body, timeout, first, rank0_stopped = FIRST_FAILURES[case]
    pytester.makepyfile(test_first=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, timeout={timeout})
def test_fault():{body}
''' + NEXT)
    monkeypatch.setenv("COLUMNS", "200")  # pytest trims the summary line to the terminal's width
    result = run_subprocess(pytester, "-rf")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    section = out[out.index("_ test_fault _"):]
    assert section.splitlines()[1] == first, section[:2000]
    stopped = "rank 0 of 2: stopped by pytest-gpumem after rank 1 failed (SIGTERM)"
    assert (stopped in section) == rank0_stopped
    assert "rank 0 of 2 ended without a result" not in out and "rank 0 of 2 failed" not in out
    if case == "hangs":
        result.stdout.fnmatch_lines([first, "--- rank 1 Python stack when the timeout hit ---", "*in wait_for_peer*"])
    assert f"FAILED test_first.py::test_fault - {first}" in out
    assert processes_tagged(launch_tag) == []


# --- Fail fast: a rank's exception is not lost behind its fixture's teardown (issue 27) -----------
# The newcomer's case: the README's process_group fixture (yield, then dist.barrier() and
# destroy_process_group()); rank 1 raises while rank 0 goes into all_reduce. Rank 1's teardown waits
# in the barrier for a peer that waits in all_reduce. Before the rank reported its failure ahead of
# its teardown, this ran into the launch's 600 s timeout and read "rank 0 of 2 hung" (the exception
# lost). The marker keeps the default timeout on purpose: the launch must end on the failure.

# The test's own call: 8-15 s alone on a busy 2-core machine (two ranks starting torch), up to ~60 s
# with the file under -n 2 beside other sessions; the launch's timeout it must not reach is 600 s.
FAIL_FAST_LIMIT_S = 150
FAIL_FAST_BOUND_S = 300  # the pytest under test, start-up and collection included

NEWCOMER_BODY = '''

@pytest.mark.gpumem(nproc=2{launcher})
def test_shard(process_group):
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 lost its shard")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)  # rank 0 waits here for a peer that raised
'''

NEWCOMER_LAUNCHES = {  # how the ranks start: (marker launcher argument, extra command-line options)
    "direct-exec": ("", ["--gpumem-start=exec"]),
    "direct-fork": ("", ["--gpumem-start=fork", "--gpumem-track-host=off"]),  # tracking would refuse a fork
    "torchrun": (', launcher="torchrun"', []),
}


# The fixture the README showed when a newcomer met the 10-minute hang (issue 27): a barrier at
# teardown, where a rank whose body failed waits for peers that never come. The documented fixture
# (docs/writing-tests.md) has none now; the plugin must fail fast with this one all the same.
NEWCOMER_FIXTURE = '''
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def process_group():
    """One process group per rank, from MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (env://)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    yield
    dist.barrier()
    dist.destroy_process_group()

'''


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("start", sorted(NEWCOMER_LAUNCHES))
def test_a_rank_exception_behind_a_teardown_barrier_fails_fast_with_that_exception(
        pytester, launch_tag, monkeypatch, start):
    launcher, options = NEWCOMER_LAUNCHES[start]
    pytester.makepyfile(test_newcomer=NEWCOMER_FIXTURE + NEWCOMER_BODY.format(launcher=launcher))
    monkeypatch.setenv("COLUMNS", "200")  # pytest trims the summary line to the terminal's width
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "-rf", "--durations=0",
                                           "--durations-min=0", *options, timeout=FAIL_FAST_BOUND_S)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    section = out[out.index("_ test_shard _"):].splitlines()
    assert section[1] == "rank 1 of 2 failed: RuntimeError: rank 1 lost its shard", "\n".join(section[:30])
    assert "E           RuntimeError: rank 1 lost its shard" in section[:15], "the traceback comes first"
    result.stdout.fnmatch_lines([
        "rank 1 of 2 was still running 2 s after the first failure: stopped by pytest-gpumem (SIGTERM*)",
        "--- rank 1 Python stack when stopped ---", "*in barrier", "*in process_group",
        "rank 0 of 2: stopped by pytest-gpumem after rank 1 failed (SIGTERM*)",
        "--- rank 0 Python stack when stopped ---", "*in all_reduce", "*in test_shard",
    ])
    assert "hung" not in out and "timed out" not in out
    assert "FAILED test_newcomer.py::test_shard - rank 1 of 2 failed: RuntimeError: rank 1 lost its shard" in out
    (took,) = [float(line.split("s ", 1)[0]) for line in out.splitlines()
               if line.endswith(" call     test_newcomer.py::test_shard")]
    assert took < FAIL_FAST_LIMIT_S, f"{took:.1f} s for a failure known in the first seconds (the timeout is 600 s)"
    assert processes_tagged(launch_tag) == []


ONEFLOW_NEWCOMER = '''
import oneflow as flow
import pytest


@pytest.fixture
def synchronised():
    """The README fixture's shape under OneFlow: every rank meets the others once more at teardown."""
    yield
    flow.comm.barrier()


@pytest.mark.gpumem(nproc=2, launcher="oneflow")
def test_shard(synchronised):
    if flow.env.get_rank() == 1:
        raise RuntimeError("rank 1 lost its shard")
    placement = flow.placement("cpu", ranks=[0, 1])
    local = flow.ones(4, 4).to_global(placement=placement, sbp=flow.sbp.split(0))
    local.to_global(sbp=flow.sbp.broadcast).numpy()  # rank 0 waits here for a peer that raised
'''


@pytest.mark.oneflow
@needs_oneflow
def test_a_rank_exception_behind_a_teardown_barrier_fails_fast_under_oneflows_launcher(pytester, launch_tag):
    pytester.makepyfile(test_newcomer=ONEFLOW_NEWCOMER)
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", "--durations=0", "--durations-min=0",
                                           timeout=FAIL_FAST_BOUND_S)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    section = out[out.index("_ test_shard _"):].splitlines()
    assert section[1] == "rank 1 of 2 failed: RuntimeError: rank 1 lost its shard", "\n".join(section[:30])
    assert "E           RuntimeError: rank 1 lost its shard" in section[:15], "the traceback comes first"
    assert "hung" not in out and "timed out" not in out
    (took,) = [float(line.split("s ", 1)[0]) for line in out.splitlines()
               if line.endswith(" call     test_newcomer.py::test_shard")]
    assert took < FAIL_FAST_LIMIT_S, f"{took:.1f} s for a failure known in the first seconds (the timeout is 600 s)"
    assert processes_tagged(launch_tag) == []


# --- 2, 5 under OneFlow's launcher (each OneFlow launch costs seconds: two cases only) -------------

ONEFLOW_FAULTS = {
    "launcher-killed": ('''
    if os.environ["RANK"] == "1":
        os.kill(launcher_pid(), signal.SIGKILL)
    time.sleep(60)''', ["*rank 0 of 2 ended without a result (oneflow launcher killed by SIGKILL*",
                        "*rank 1 of 2 ended without a result (oneflow launcher killed by SIGKILL*"]),
    "rank-sigkill": ('''
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)''', ["*rank 1 of 2 ended without a result (oneflow launcher exit code 1)*"]),
}


@pytest.mark.oneflow
@needs_oneflow
@pytest.mark.parametrize("case", sorted(ONEFLOW_FAULTS))
def test_oneflow_launcher_fault_is_named_and_the_session_goes_on(pytester, launch_tag, case):
    body, lines = ONEFLOW_FAULTS[case]
    pytester.makepyfile(test_fault=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, launcher="oneflow", timeout=120)
def test_fault():{body}
''' + NEXT)
    result = run_subprocess(pytester)  # OneFlow's launcher kills its whole process group on a failure
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(lines)
    assert "timed out" not in result.stdout.str()
    assert processes_tagged(launch_tag) == []
    assert not (pytester.path / "log").exists()


# --- 6: pytest interrupted or terminated mid-launch ------------------------------------------------

@pytest.mark.parametrize("launcher", ["direct", pytest.param("torchrun", marks=TORCH)])
def test_ctrl_c_mid_launch_ends_the_session_and_every_process(pytester, launch_tag, private_tmp, launcher):
    pytester.makepyfile(test_interrupt=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, launcher={launcher!r}, timeout=60)
def test_interrupted():
    if os.environ["RANK"] == "1":
        os.kill(pytest_pid(), signal.SIGINT)   # what Ctrl-C in the terminal sends pytest
    time.sleep(30)
''' + NEXT)
    result = run_subprocess(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*", "*no tests ran*"])
    assert processes_tagged(launch_tag) == []


def test_second_ctrl_c_during_the_cleanup_does_not_leave_ranks(pytester, launch_tag, private_tmp):
    """An impatient user: Ctrl-C, then Ctrl-C again while the plugin is still killing the ranks.

    The ranks live in sessions of their own (the terminal's SIGINT never reaches them), so a
    cleanup cut short would leave them running. Here rank 1 answers the plugin's SIGTERM with a
    second SIGINT to pytest and keeps running.
    """
    pytester.makepyfile(test_twice=HELPERS + '''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_interrupted_twice():
    if os.environ["RANK"] == "1":
        target = pytest_pid()
        signal.signal(signal.SIGTERM, lambda *_: os.kill(target, signal.SIGINT))
        os.kill(target, signal.SIGINT)
    time.sleep(30)
''')
    result = run_subprocess(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*"])
    assert processes_tagged(launch_tag) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_pytest_terminated_mid_launch_kills_the_launch_first(pytester, launch_tag, private_tmp, sig):
    """A CI runner's cancel, `timeout`, a closed terminal: pytest still dies by that signal, but
    only after every process of the launch is gone (before: the ranks were orphaned)."""
    pytester.makepyfile(test_terminated=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_terminated():
    if os.environ["RANK"] == "1":
        os.kill(pytest_pid(), {int(sig)})
    time.sleep(30)
''')
    result = run_subprocess(pytester)
    assert result.ret == -sig
    assert processes_tagged(launch_tag) == []
    assert sorted(p.name for p in private_tmp.iterdir()) == [], "the launch's folder goes too"


@pytest.mark.parametrize("launcher", ["direct", pytest.param("torchrun", marks=TORCH)])
def test_pytest_killed_mid_launch_takes_its_ranks_along(pytester, launch_tag, launcher, private_tmp):
    """SIGKILL leaves pytest no cleanup at all: each rank dies with its parent (PR_SET_PDEATHSIG);
    under torchrun the launcher dies with pytest and the ranks with the launcher. The launch's
    folder is left behind, and the next session's first launch sweeps it."""
    pytester.makepyfile(test_killed=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, timeout=60, launcher="{launcher}")
def test_killed():
    if os.environ["RANK"] == "1":
        os.kill(pytest_pid(), signal.SIGKILL)
    time.sleep(30)
''')
    result = run_subprocess(pytester)
    assert result.ret == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while processes_tagged(launch_tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_tagged(launch_tag) == []
    assert [p.name for p in private_tmp.glob("gpumem-*")], "SIGKILL left the folder (nothing could remove it)"

    pytester.makepyfile(test_killed="import pytest\n\n@pytest.mark.gpumem(nproc=1)\ndef test_next():\n    pass\n")
    run_subprocess(pytester).assert_outcomes(passed=1)
    assert [p.name for p in private_tmp.glob("gpumem-*")] == [], "the next session sweeps the orphan"


def test_ctrl_c_mid_launch_leaves_no_temporary_folder(pytester, launch_tag, private_tmp):
    pytester.makepyfile(test_interrupt=HELPERS + '''

@pytest.mark.gpumem(nproc=1, timeout=60)
def test_interrupted():
    os.kill(pytest_pid(), signal.SIGINT)
    time.sleep(30)
''')
    result = run_subprocess(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert processes_tagged(launch_tag) == []
    assert sorted(p.name for p in private_tmp.iterdir()) == []


# --- 7: the rendezvous port ------------------------------------------------------------------------

SQUATTER = '''
import socket, sys, time
sock = socket.socket()
sock.bind(("0.0.0.0", int(sys.argv[1])))
sock.listen()
print("listening", flush=True)
time.sleep(600)
'''


@pytest.mark.torch
@needs_torch
def test_rendezvous_port_taken_by_another_program_fails_rank_0(pytester, launch_tag):
    """Another program binds MASTER_PORT between the plugin choosing it and rank 0 binding it."""
    pytester.makepyfile(test_port=HELPERS + f'''
SQUATTER = {SQUATTER!r}


@pytest.mark.gpumem(nproc=2, timeout=60)
def test_port_taken():
    import torch.distributed as dist  # in the ranks only: torch cannot be imported twice in this process

    if os.environ["RANK"] == "0":
        other = subprocess.Popen([sys.executable, "-c", SQUATTER, os.environ["MASTER_PORT"]],
                                 stdout=subprocess.PIPE)
        assert other.stdout.readline() == b"listening\\n"
    dist.init_process_group("gloo")
''' + NEXT)
    result = run_inline(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 of 2 failed: *DistNetworkError*", "*EADDRINUSE*",
                                 "*rank 1 of 2: stopped by pytest-gpumem after rank 0 failed (SIGTERM)*"])
    assert "timed out" not in result.stdout.str()
    assert processes_tagged(launch_tag) == [], "the squatter started by the rank is gone too"


@pytest.mark.torch
@needs_torch
def test_rendezvous_port_taken_before_any_body_started_is_relaunched_on_another_port(pytester, launch_tag,
                                                                                     monkeypatch, tmp_path):
    """Another program binds MASTER_PORT while the fixtures set up (no test body has run): the launch is
    run again on another port, and each rank's body runs once."""
    seen = tmp_path / "seen"
    monkeypatch.setenv("SEEN", str(seen))
    pytester.makepyfile(test_port=HELPERS + f'''
SQUATTER = {SQUATTER!r}


@pytest.fixture
def process_group():
    import torch.distributed as dist  # in the ranks only: torch cannot be imported twice in this process

    squat = os.environ["RANK"] == "0" and not os.path.exists(os.environ["SEEN"] + ".squatted")
    if squat:  # the first launch only: a program takes the port before rank 0 binds it
        open(os.environ["SEEN"] + ".squatted", "w").close()
        other = subprocess.Popen([sys.executable, "-c", SQUATTER, os.environ["MASTER_PORT"]], stdout=subprocess.PIPE)
        assert other.stdout.readline() == b"listening\\n"
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"setup {{os.environ['RANK']}} {{os.environ['MASTER_PORT']}}\\n")
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=2, timeout=60)
def test_port_taken(process_group):
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"body {{os.environ['RANK']}} {{os.environ['MASTER_PORT']}}\\n")
''')
    result = run_inline(pytester)
    result.assert_outcomes(passed=1)
    lines = [line.split() for line in seen.read_text().splitlines()]
    bodies = [line for line in lines if line[0] == "body"]
    assert sorted(rank for _, rank, _ in bodies) == ["0", "1"], lines
    first_port = lines[0][2]
    assert all(port != first_port for _, _, port in bodies), "the relaunch has another port"
    assert processes_tagged(launch_tag) == [], "the squatter started by the rank is gone too"


@pytest.mark.torch
@needs_torch
def test_users_rendezvous_variables_are_replaced_by_a_free_port(pytester, launch_tag, monkeypatch, tmp_path):
    """MASTER_PORT, WORLD_SIZE, RANK left in the environment by an outer job: the launch sets its own."""
    import socket

    seen = tmp_path / "ports"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": str(port), "WORLD_SIZE": "8",
                            "RANK": "5", "LOCAL_RANK": "5", "SEEN": str(seen)}.items():
            monkeypatch.setenv(name, value)
        pytester.makepyfile(test_env='''
import os
import pytest


def rendezvous():
    import torch.distributed as dist  # in the ranks only

    with open(os.environ["SEEN"], "a") as f:
        f.write(f"{os.environ['MASTER_PORT']} {os.environ['WORLD_SIZE']}\\n")
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=[1, 2], timeout=60)
def test_direct():
    rendezvous()


@pytest.mark.gpumem(nproc=2, launcher="torchrun", timeout=60)
def test_torchrun():
    rendezvous()
''')
        result = run_inline(pytester)
    result.assert_outcomes(passed=2)
    lines = seen.read_text().split("\n")[:-1]
    assert len(lines) == 1 + 2 + 2  # direct at nproc 1 and 2, torchrun at 2: every rank wrote
    assert all(line.split()[0] != str(port) and line.split()[1] in ("1", "2") for line in lines), lines


# --- 8: NVML missing or broken ---------------------------------------------------------------------

NVML_SHIMS = {
    "import-fails": 'raise ImportError("libnvidia-ml.so.1: cannot open shared object file")',
    "library-fails-to-load": 'raise OSError("libnvidia-ml.so.1: cannot open shared object file")',
    "init-raises-nvml-error": ('class NVMLError(Exception):\n    pass\n\n\n'
                               'def nvmlInit():\n    raise NVMLError("Driver Not Loaded")\n'),
    "init-raises-other-error": 'def nvmlInit():\n    raise RuntimeError("Driver/library version mismatch")\n',
    "module-without-api": '"""An unrelated module that happens to be called pynvml."""\n',
}


@pytest.mark.parametrize("shim", NVML_SHIMS.values(), ids=NVML_SHIMS.keys())
def test_nvml_missing_or_broken_still_gates_host_memory(pytester, launch_tag, monkeypatch, tmp_path, shim):
    fake = tmp_path / "shim"
    fake.mkdir()
    (fake / "pynvml.py").write_text(shim)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_host='''
import pytest


@pytest.mark.gpumem(nproc=1, max_mib=150, timeout=60)
def test_spike():
    buf = bytearray(300 * 1024 * 1024)


@pytest.mark.gpumem(nproc=1, timeout=60)
def test_small():
    pass


@pytest.mark.gpumem(nproc=1, device="gpu", timeout=60, fake_gpu="off")
def test_needs_a_gpu():
    pass
''')
    result = run_subprocess(pytester, "-rs")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*rank 0 at nproc=1 (cpu): peak * MiB > max_mib 150.0 MiB*",
        "*needs 1 GPU(s) for nproc=1 but this machine has 0*",
    ])
    assert processes_tagged(launch_tag) == []


# --- 9: a child that outlives its rank --------------------------------------------------------------

@pytest.mark.parametrize("new_session", [True, False], ids=["own-session", "rank-group"])
def test_child_that_ignores_sigterm_is_killed(pytester, launch_tag, new_session):
    pytester.makepyfile(test_child=HELPERS + f'''
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(600)")


@pytest.mark.gpumem(nproc=2, timeout=60)
def test_leaves_a_stubborn_child():
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE,
                             start_new_session={new_session})
    assert child.stdout.readline() == b"up\\n"  # SIGTERM is ignored from here on
''' + NEXT)
    result = run_inline(pytester)
    result.assert_outcomes(passed=2)
    assert processes_tagged(launch_tag) == []


# --- 10: the baseline folder (and report, lease folder) cannot be written ---------------------------

UNUSABLE = {
    # a refresh reads the file before launching: a path under a regular file cannot be read
    "a-regular-file": lambda root: (root / "not-a-folder", "(file): cannot be read (Not a directory)"),
    "under-proc": lambda root: (Path("/proc/gpumem-baselines"), "No such file or directory"),
}


@pytest.mark.parametrize("where", sorted(UNUSABLE))
def test_unusable_baseline_folder_fails_each_test_clearly_when_read(pytester, launch_tag, where):
    folder, _ = UNUSABLE[where](pytester.path)
    if where == "a-regular-file":
        folder.write_text("keep me\n")
    pytester.makepyfile(test_job=HELPERS + NEXT + NEXT.replace("test_next", "test_last"))
    result = run_inline(pytester, f"--gpumem-baselines={folder}")
    if where == "a-regular-file":
        result.assert_outcomes(failed=2)
        result.stdout.fnmatch_lines([f"*baseline file unusable (left untouched): {folder}/test_job.py.json: "
                                     "(file): cannot be read (Not a directory)*; fix what it names, or restore it "
                                     f"from version control (git checkout -- {folder}/test_job.py.json)*"])
        assert folder.read_text() == "keep me\n"
    else:  # nothing there to read: a missing baseline, a warning outside CI
        result.assert_outcomes(passed=2)
    assert processes_tagged(launch_tag) == []


@pytest.mark.parametrize("where", sorted(UNUSABLE))
def test_unusable_baseline_folder_fails_a_refresh_clearly(pytester, launch_tag, where):
    folder, reason = UNUSABLE[where](pytester.path)
    if where == "a-regular-file":
        folder.write_text("keep me\n")
    pytester.makepyfile(test_job=HELPERS + NEXT + NEXT.replace("test_next", "test_last"))
    result = run_inline(pytester, "--gpumem-refresh", f"--gpumem-baselines={folder}")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*baseline not refreshed (file left untouched): *{reason}*; fix what it names, "
                                 "or move * aside to record it anew, then refresh again*"])
    assert "Traceback" not in result.stdout.str() and "Error: [Errno" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*gpumem: peak memory per rank*"])  # the table still lists them


def test_unwritable_report_is_a_usage_error_before_any_launch(pytester, launch_tag):
    (pytester.path / "not-a-folder").write_text("")
    pytester.makepyfile(test_job=HELPERS + NEXT)
    result = run_inline(pytester, "--gpumem-report=not-a-folder/report.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gpumem_report*not-a-folder/report.json*"])


def test_lease_folder_is_not_used_without_gpus(pytester, launch_tag):
    """On a machine without GPUs no lease is taken, so an unusable lease folder changes nothing."""
    from pytest_gpumem.sampling.nvml import visible_gpus

    if visible_gpus():
        pytest.skip("this machine has GPUs: leases are taken")
    (pytester.path / "not-a-folder").write_text("")
    pytester.makepyfile(test_job=HELPERS + NEXT)
    result = run_inline(pytester, "--gpumem-lease-dir=not-a-folder/leases")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "not-a-folder").stat().st_size


# --- Privacy: what a launch writes is the user's alone, and goes away ---------------------------------

def test_launch_folder_and_rank_logs_are_private(pytester, launch_tag):
    pytester.makepyfile(test_private='''
import os
import stat
import pytest


@pytest.mark.gpumem(nproc=2, timeout=60)
def test_private():
    folder = os.environ["GPUMEM_WORKDIR"]
    info = os.stat(folder)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), oct(info.st_mode)
    log = os.stat(os.path.join(folder, f"rank-{os.environ['RANK']}.log"))
    assert stat.S_IMODE(log.st_mode) == 0o600, oct(log.st_mode)
''')
    run_inline(pytester).assert_outcomes(passed=1)


@pytest.mark.parametrize("launcher", ["direct", pytest.param("torchrun", marks=TORCH)])
def test_launches_leave_nothing_in_the_temp_dir(pytester, launch_tag, private_tmp, launcher):
    """Passed or failed. torchrun's own log folder (torchelastic_*) used to stay behind every launch."""
    pytester.makepyfile(test_tidy=HELPERS + f'''

@pytest.mark.gpumem(nproc=2, launcher={launcher!r}, timeout=60)
def test_fails():
    assert os.environ["RANK"] == "0"
''' + NEXT)
    result = run_subprocess(pytester)
    result.assert_outcomes(passed=1, failed=1)
    assert sorted(p.name for p in private_tmp.iterdir()) == []


def test_lease_folder_is_private():
    """The lease folder holds one lock per GPU; created for this user only (checked without GPUs)."""
    assert str(os.getuid()) in default_lease_dir().name
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "leases"
        GpuLeases(folder, [], wait_s=1).acquire(0, "t").release()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


# --- Bad input: settings from the ini file, the environment, the command line ------------------------

BAD_VALUES = {
    "launcher": "two words",  # not a name; one nobody registered: test_launcher_plugin.py
    "timeout": "soon",
    "max_ratio": "-1",
    "allow_mib": "-5",
    "tolerance": "12 parsecs",
    "allocated_tolerance": "tight",
    "device": "tpu",
    "floor": "sometimes",
    "gpu_sampler": "both",
    "interval_ms": "fast",
    "missing_baseline": "maybe",
    "lease_wait": "0",
    "fast_exit": "sometimes",
    "boxing": "maybe",
    "sites": "some",
    "python_allocations": "bytes",
    "host_startup": "sometimes",
    "nnodes": "two",
    "srun_args": '--gpus-per-task="1',  # an unclosed quote
    "max_nproc": "-2",
    "predict": "maybe",
    "track_host": "sometimes",
    "start": "spawn",
    "fail_fast_grace": "-1",
    "simulate": "always",
    "unlaunched": "ignore",
    "fake_gpu": "sometimes",
}
# Any text is a path (or, for fake_gpu_model, a name checked against the known models: test_fake_gpu);
# what goes wrong with a path is writing there (baselines, lease folder, report: above).
PATH_OPTIONS = {o.name for o in OPTIONS if o.parse is str}


def test_every_typed_setting_has_a_bad_value_case():
    assert set(BAD_VALUES) == {o.name for o in OPTIONS} - PATH_OPTIONS


SOURCES = ["ini", "env", "cli"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("option", [o for o in OPTIONS if o.name in BAD_VALUES], ids=lambda o: o.name)
def test_bad_setting_is_a_usage_error_naming_key_and_source(pytester, monkeypatch, option, source):
    value = BAD_VALUES[option.name]
    args = ["-p", "no:cacheprovider"]
    if source == "ini":
        pytester.makeini(f"[pytest]\n{option.ini} = {value}\n")
        where = "the ini file"
    elif source == "env":
        monkeypatch.setenv(option.env, value)
        where = f"the {option.env} environment variable"
    elif option.const is not None:
        pytest.skip(f"{option.flag} is a flag without a value: nothing to get wrong on the command line")
    else:
        args.append(f"{option.flag}={value}")
        where = f"the command line ({option.flag})"
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest(*args)  # without --gpumem too: a bad setting is never silently unused
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*Invalid {option.ini} {value!r} from {where}: expected {option.accepted}*"])


# --- Bad input: the gpumem command --------------------------------------------------------------------

def gpumem_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=60)


def test_cli_unknown_subcommand_or_none_is_a_usage_error():
    unknown = gpumem_cli("frobnicate")
    assert unknown.returncode == 2 and "invalid choice: 'frobnicate'" in unknown.stderr
    nothing = gpumem_cli()
    assert nothing.returncode == 2 and "required: command" in nothing.stderr


def test_cli_show_names_a_missing_folder(tmp_path):
    missing = tmp_path / "nonexistent"
    shown = gpumem_cli("show", "--baselines", str(missing))
    assert shown.returncode == 0 and f"no baselines under {missing}" in shown.stdout
    assert not missing.exists(), "show never creates anything"


def test_cli_show_names_a_broken_file(tmp_path):
    broken = tmp_path / "baselines" / "test_x.py.json"
    broken.parent.mkdir()
    broken.write_text('{"schema": 1, "tests": {"t": ')
    shown = gpumem_cli("show", "--baselines", str(broken.parent))
    assert shown.returncode == 2
    assert f"{broken}: line 1 column" in shown.stderr and "truncated?" in shown.stderr
    assert broken.read_text() == '{"schema": 1, "tests": {"t": '
