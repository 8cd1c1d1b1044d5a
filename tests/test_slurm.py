"""launcher=srun through a real Slurm: run inside an allocation of two nodes and four tasks.

``make test-slurm`` brings up the local cluster of two emulated nodes (tools/slurm/up) and runs
this module under ``salloc -N2 -n4 --overcommit``; elsewhere it is skipped, saying how to run it.
Every launch is a real job step: ``srun`` places ranks 0-1 on n1 and 2-3 on n2. The emulated nodes
share this host, so ``processes_tagged`` (this host's process table) sees every node's tasks, and
``steps()`` asks Slurm what it still runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ONEFLOW_WORKLOAD, TORCH_DDP

from conftest import processes_tagged

IN_ALLOCATION = bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(not IN_ALLOCATION, reason="needs a Slurm allocation of 2 nodes: make test-slurm "
                       "(or salloc -N2 -n4 --overcommit pytest -m slurm tests/test_slurm.py)"),
]
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
needs_oneflow = pytest.mark.skipif(importlib.util.find_spec("oneflow") is None, reason="needs OneFlow")
SUBPROCESS_TIMEOUT_S = 120


def steps() -> list[str]:
    """The job's steps that Slurm still lists (``JOB.STEP NAME``), the allocation's own aside."""
    out = subprocess.run(["squeue", "--noheader", "--steps", f"--jobs={os.environ['SLURM_JOB_ID']}",
                          "--format=%i %j"], capture_output=True, text=True, timeout=30).stdout
    return [line.strip() for line in out.splitlines() if "gpumem-" in line]


@pytest.fixture
def nothing_left(launch_tag):
    """After the test: no task of its launches on either node, no step of them in Slurm."""
    yield launch_tag
    assert steps() == [], "a job step of the test outlived it"
    assert processes_tagged(launch_tag) == [], "a task outlived the test"


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--gpumem", "-p", "no:cacheprovider", *args)


def sizes(report) -> dict[str, dict[int, dict]]:
    doc = json.loads(report.read_text())
    return {t["test"]: {s["nproc"]: s for s in t["sizes"]} for t in doc["tests"]}


@pytest.mark.torch
@needs_torch
def test_torch_across_two_nodes_healthy_passes_inflating_fails(pytester, nothing_left, tmp_path):
    report = tmp_path / "report.json"
    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.gpumem(nproc=[1, 2, 4], max_ratio=1.2, launcher="srun", nnodes=2)
def test_healthy():
    assert os.environ["SLURMD_NODENAME"] == ("n1" if int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"]) / 2
                                             or os.environ["WORLD_SIZE"] == "1" else "n2")
    step(False)

@pytest.mark.gpumem(nproc=[1, 2, 4], max_ratio=1.2, launcher="srun", nnodes=2)
def test_inflating():
    step(True)
''')
    result = run(pytester, f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "gpumem: * MiB > ratio limit * MiB (rank 0, nproc=4); 1 more limit exceeded",
        "*rank 0 at nproc=2 (cpu): peak * MiB > 1.20 x * MiB (nproc=1) + 0 MiB = * MiB (ratio *x)*",
        "*nproc=4 cpu MiB per rank {0: * on n1, 1: * on n1, 2: * on n2, 3: * on n2}*",
        "*gpumem: peak memory per rank*",
        "*test_healthy*4*pass*",
        "*test_inflating*4*failed (limit)*",
    ])
    healthy = sizes(report)["test_torch_across_two_nodes_healthy_passes_inflating_fails.py::test_healthy"]
    assert healthy[4]["nodes"] == {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}
    assert healthy[2]["nodes"] == {"0": "n1", "1": "n2"}
    assert healthy[1]["nodes"] == {"0": "n1"}
    for size in healthy.values():  # every rank's own exit report, nothing sampled from here
        assert set(size["methods"].values()) == {"live allocations (memray)"}
        assert all(mib > 150 for mib in size["ranks"].values())


# The two emulated nodes share one host, and OneFlow tells nodes apart by host: it sees one node
# on which n1's and n2's local rank 0 collide (rank 1 of 2 then reads 0.0 for a global sum; checked
# by hand with two plain processes, RANK 0/1 and LOCAL_RANK 0/0). On a real cluster SLURM_LOCALID is
# right; here, and only here, each rank is made locally unique before OneFlow starts.
ONEFLOW_DP = '''
import os
if "GPUMEM_WORKDIR" in os.environ:  # in a rank (not in pytest collecting it)
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # emulated nodes on one host: see above
''' + ONEFLOW_WORKLOAD


@pytest.mark.oneflow
@needs_oneflow
def test_oneflow_across_two_nodes_healthy_passes_inflating_fails(pytester, nothing_left, tmp_path):
    report = tmp_path / "report.json"
    pytester.makepyfile(ONEFLOW_DP + '''
@pytest.mark.gpumem(nproc=[1, 2, 4], max_ratio=1.2, launcher="srun", nnodes=2)
def test_healthy():
    step(False)

@pytest.mark.gpumem(nproc=[1, 2, 4], max_ratio=1.2, launcher="srun", nnodes=2)
def test_inflating():
    step(True)
''')
    result = run(pytester, f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 0 at nproc=2 (cpu): peak * MiB > 1.20 x * MiB (nproc=1) + 0 MiB = * MiB (ratio *x)*",
        "*test_healthy*4*pass*",
    ])
    healthy = sizes(report)["test_oneflow_across_two_nodes_healthy_passes_inflating_fails.py::test_healthy"]
    assert healthy[4]["nodes"] == {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}


FAULTS = '''
import os
import signal
import time
from pathlib import Path

import pytest


def on_second_node():
    return os.environ["SLURMD_NODENAME"] == "n2"
'''

NEXT = '''

@pytest.mark.gpumem(nproc=4, launcher="srun", nnodes=2, timeout=60)
def test_next():
    pass
'''


def test_rank_killed_on_the_second_node_is_named_with_its_node(pytester, nothing_left):
    pytester.makepyfile(test_fault=FAULTS + '''

@pytest.mark.gpumem(nproc=4, launcher="srun", nnodes=2, timeout=60)
def test_killed():
    if on_second_node() and os.environ["LOCAL_RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)   # the others wait in vain: the plugin ends the step 2 s after rank 3 died
''' + NEXT)
    started = time.monotonic()
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 3 of 4 (node n2) ended without a result (killed by SIGKILL (kill -9, or the kernel's OOM killer*"
        "*last lines of the launcher's output (the rank left no log of its own):",
        "srun: error: n2: task 3: Killed",
        "*rank 0 of 4 (node n1): stopped by pytest-gpumem after rank 3 failed (SIGTERM)*",
    ])
    assert time.monotonic() - started < 30, "fail-fast ended the step; nobody waited for the sleep"


def test_rank_failing_on_the_second_node_shows_its_traceback(pytester, nothing_left):
    pytester.makepyfile(test_fault=FAULTS + '''

@pytest.mark.gpumem(nproc=4, launcher="srun", nnodes=2, timeout=60)
def test_fails():
    assert not on_second_node(), f"rank {os.environ['RANK']} broke on n2"
''')
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 2 of 4 (node n2) failed:*", "*AssertionError: rank 2 broke on n2*"])


def test_hang_on_the_second_node_ends_at_the_timeout_with_nothing_left(pytester, nothing_left):
    pytester.makepyfile(test_hang=FAULTS + '''

def wait_for_peer():
    time.sleep(600)


@pytest.mark.gpumem(nproc=4, launcher="srun", nnodes=2, timeout=6)
def test_hangs():
    if on_second_node():
        wait_for_peer()
''' + NEXT)
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 2 of 4 (node n2) hung: no result when the launch timed out after 6 s at nproc=4 (launcher srun)*",
        "*--- rank 2 Python stack when the timeout hit ---*",
        "*line * in wait_for_peer*",
    ])


BODY = '''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2, 4], max_ratio=1.3)
def test_job():
    ballast = bytearray((40 + 10 * int(os.environ["RANK"])) * 2**20)
'''


def test_baselines_and_reports_are_those_of_a_local_launch(pytester, nothing_left, tmp_path):
    """Baselines recorded by a local (direct) launch gate the srun launch of the same test, and
    the report has the same fields, plus the node of each rank."""
    pytester.makepyfile(test_job=BODY)
    local = run(pytester, "--gpumem-refresh", f"--gpumem-report={tmp_path / 'local.json'}")
    local.assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "baselines" / "test_job.py.json").read_text())
    before = json.dumps(stored, sort_keys=True)
    spread = run(pytester, "--gpumem-launcher=srun", "--gpumem-nnodes=2", "--gpumem-missing-baseline=fail",
                 f"--gpumem-report={tmp_path / 'srun.json'}")
    spread.assert_outcomes(passed=1)
    spread.stdout.fnmatch_lines(["*test_job.py::test_job*4*1.*x*cpu*pass*"])
    assert json.dumps(json.loads((pytester.path / "baselines" / "test_job.py.json").read_text()),
                      sort_keys=True) == before, "a run without --gpumem-refresh never writes"
    a, b = (sizes(tmp_path / "local.json")["test_job.py::test_job"],
            sizes(tmp_path / "srun.json")["test_job.py::test_job"])
    assert set(a[4]) == set(b[4]), "the same fields"
    assert a[4]["nodes"] == {} and b[4]["nodes"] == {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}
    for n in (1, 2, 4):
        assert b[n]["baseline_mib"] == pytest.approx(a[n]["gated_mib"], abs=0.1)  # stored to 0.1 MiB
        for rank, mib in b[n]["ranks"].items():  # the same rank, the same memory, wherever it ran
            assert mib == pytest.approx(a[n]["ranks"][rank], abs=16)


def start_long_launch(pytester: pytest.Pytester) -> subprocess.Popen:
    """A pytest whose 4 ranks (2 per node) sleep; returns once every rank has started."""
    marker = pytester.path / "started"
    pytester.makepyfile(test_long=f'''
import os, time
import pytest

@pytest.mark.gpumem(nproc=4, launcher="srun", nnodes=2, timeout=120)
def test_long():
    open({str(marker)!r} + os.environ["RANK"], "w").close()
    time.sleep(120)
''')
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "test_long.py"],
                            cwd=pytester.path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not all(os.path.exists(f"{marker}{rank}") for rank in range(4)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError("the ranks never started")
        time.sleep(0.1)
    assert len(steps()) == 1
    return proc


def wait_until_nothing_left(tag: str) -> None:
    end = time.monotonic() + 30
    while (steps() or processes_tagged(tag)) and time.monotonic() < end:
        time.sleep(0.2)


def test_pytest_killed_mid_launch_leaves_no_step_running(pytester, nothing_left):
    """SIGKILL to pytest: srun dies with it (bound to its parent), and Slurm ends the step."""
    proc = start_long_launch(pytester)
    try:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_until_nothing_left(nothing_left)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_mid_launch_ends_the_step_then_the_session(pytester, nothing_left):
    """SIGINT to pytest: the step is cancelled before pytest reports the interruption."""
    proc = start_long_launch(pytester)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == pytest.ExitCode.INTERRUPTED
        assert steps() == [], "the step was ended before pytest exited"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_script_mode_runs_the_program_on_both_nodes(pytester, nothing_left, tmp_path):
    out = tmp_path / "runs.txt"
    pytester.makepyfile(train_net=f'''
import os, sys
with open({str(out)!r}, "a") as f:
    f.write(f"{{os.environ['RANK']}}/{{os.environ['WORLD_SIZE']}} {{os.environ['SLURMD_NODENAME']}} "
            f"{{' '.join(sys.argv[1:])}}\\n")
''')
    pytester.makepyfile(test_script='''
import pytest

@pytest.mark.gpumem(nproc=[1, 2], script="train_net.py", args=["--config-file", "gpt2.py"],
                    launcher="srun", nnodes=2)
def test_train_net():
    raise AssertionError("the body is not run in script mode")
''')
    result = run(pytester)
    result.assert_outcomes(passed=1)
    assert sorted(out.read_text().splitlines()) == [
        "0/1 n1 --config-file gpt2.py", "0/2 n1 --config-file gpt2.py", "1/2 n2 --config-file gpt2.py"]


def test_measure_honours_the_srun_arguments_a_test_session_does(tmp_path, nothing_left):
    """``gpumem measure --launcher srun`` builds its runner where ``pytest --gpumem`` does
    (Session.from_settings): GPUMEM_SRUN_ARGS reach the job step (issue 37: measure used to drop them). The
    program exits 3 unless srun exported the variable those arguments set."""
    (tmp_path / "train.py").write_text("import os, sys\n"
                                       "sys.exit(0 if os.environ.get('GPUMEM_SRUN_MARK') == 'given' else 3)\n")
    env = {**os.environ, "GPUMEM_SRUN_ARGS": "--export=ALL,GPUMEM_SRUN_MARK=given", "GPUMEM_NNODES": "2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "measure", "--nproc", "1,4", "--launcher", "srun",
                           "--report", str(tmp_path / "measure.json"), "--", "train.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    nodes = json.loads((tmp_path / "measure.json").read_text())["tests"][0]["sizes"][1]["nodes"]
    assert nodes == {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}
