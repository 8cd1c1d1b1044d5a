"""launcher=srun without a cluster: Slurm's notation, the task shim's own checks, bad input, and
what a session outside an allocation says. (The launches themselves: tests/test_slurm.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpumem.config.settings import SettingsError, resolve
from pytest_gpumem.config.spec import Defaults, SpecError, parse_marker
from pytest_gpumem.launching.slurm import effective_nodes, not_in_allocation, not_shared_problems, srun_lines
from pytest_gpumem.rankside.slurm_env import (
    SlurmEnvError,
    contract,
    expand_hostlist,
    format_addresses,
    parse_addresses,
    tasks_per_node,
)
from pytest_gpumem.rankside.srun_task import LINE_PREFIX, NOT_SHARED_EXIT

TASK_ENV = {  # what Slurm 22.05 gave task 2 of `srun -N2 -n4` on the local two-node cluster
    "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURMD_NODENAME": "n2",
    "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("node-[9-10].cluster", ["node-9.cluster", "node-10.cluster"]),
])
def test_hostlist_expands_like_scontrol_show_hostnames(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-2", "n[a-b]"])
def test_bad_hostlist_names_the_item(text):
    with pytest.raises(SlurmEnvError, match="hostlist item"):
        expand_hostlist(text)


def test_tasks_per_node_and_addresses():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    pairs = {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert parse_addresses(format_addresses(pairs)) == pairs
    assert parse_addresses("") == {}


def test_contract_from_slurm_variables():
    env = contract(TASK_ENV, 29500, {"n1": "127.0.0.1"})
    assert env == {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    # A node whose name is its host name needs no address.
    assert contract(TASK_ENV, 29500, {})["MASTER_ADDR"] == "n1"


def test_contract_outside_srun_names_the_variable():
    with pytest.raises(SlurmEnvError, match="SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is not set"):
        contract({}, 1, {})


def test_nnodes_never_exceeds_nproc():
    assert [effective_nodes(2, n) for n in (1, 2, 4)] == [1, 2, 2]
    assert effective_nodes(None, 4) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 0, "launcher": "srun"}, "nnodes=0 is not accepted: expected an int from 1"),
    ({"nnodes": "two", "launcher": "srun"}, "nnodes='two' is not accepted"),
    ({"nnodes": 2}, "nnodes=2 is not accepted with launcher='direct': nodes are for launcher='srun'"),
    ({"launcher": "mpirun"}, "expected one of direct, oneflow, srun, torchrun"),
])
def test_bad_srun_marker_arguments(kwargs, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_marker((), kwargs, Defaults())


def test_srun_settings_are_resolved_and_checked(tmp_path):
    def settings(**env):
        return resolve({}, env, {}, rootdir=tmp_path, enabled=True, refresh=False)

    got = settings(GPUMEM_SRUN_ARGS="--gpus-per-task=1 --cpus-per-task 8", GPUMEM_NNODES="2",
                   GPUMEM_SLURM_DIR="/shared/ci")
    assert got.srun_args == ("--gpus-per-task=1", "--cpus-per-task", "8")
    assert (got.nnodes, got.slurm_dir) == (2, Path("/shared/ci"))
    assert settings().srun_args == () and settings().slurm_dir is None
    with pytest.raises(SettingsError, match="Invalid gpumem_srun_args '--x=\"' from the GPUMEM_SRUN_ARGS"):
        settings(GPUMEM_SRUN_ARGS='--x="')
    with pytest.raises(SettingsError, match="Invalid gpumem_nnodes 'two' from the GPUMEM_NNODES"):
        settings(GPUMEM_NNODES="two")


def test_outside_an_allocation_says_how_to_run_it(monkeypatch):
    reason = not_in_allocation({"PATH": os.environ.get("PATH", "")})
    assert reason is not None and "salloc -N2 -n4 pytest --gpumem" in reason
    assert "srun on PATH" in not_in_allocation({"PATH": "/nonexistent", "SLURM_JOB_ID": "7"})


def test_srun_test_outside_an_allocation_is_skipped_with_how_to(pytester, monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=2, launcher="srun", nnodes=2)
def test_job():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*launcher='srun' needs * run pytest inside a Slurm allocation, e.g. "
                                 "`salloc -N2 -n4 pytest --gpumem ...`*"])


def test_task_that_cannot_see_the_launch_folder_says_so(tmp_path):
    """A folder that is not shared: the shim exits 3 with a line srun carries back to the parent,
    and the parent names the rank, its node and the setting to change."""
    missing = tmp_path / "only-on-the-submit-host"
    env = {**os.environ, **TASK_ENV, "GPUMEM_WORKDIR": str(missing), "GPUMEM_SLURM_FOLDER_WAIT_S": "0.2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest_gpumem.rankside.srun_task", "29500", "n1=127.0.0.1",
                           "pytest", "x.py"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == NOT_SHARED_EXIT, done.stderr
    assert done.stdout.startswith(LINE_PREFIX)
    fields = json.loads(done.stdout[len(LINE_PREFIX):])
    assert (fields["rank"], fields["node"], fields["event"]) == (2, "n2", "folder-missing")
    log = tmp_path / "launcher.log"
    log.write_text("srun: error: n2: task 2: Exited with exit code 3\n" + done.stdout)
    (problem,) = not_shared_problems(srun_lines(log), missing)
    assert f"the launch folder {missing} is not on a file system that every node shares" in problem
    assert "rank 2 on node n2 could not see it (task exit code 3); set --gpumem-slurm-dir" in problem
