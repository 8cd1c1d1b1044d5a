"""``gpumem measure``: a script-mode launch at several sizes, no pytest, cleaned up like a test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import OWN_CACHES, TAG_ENV, processes_tagged
from pytest_gpumem import measure
from pytest_gpumem.judging.record_reader import load_report

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def gpumem(*args: str, cwd: Path, tmp: Path, tag: str, timeout: float = 300,
           **given: str) -> subprocess.CompletedProcess:
    """``gpumem ARGS`` in a fresh interpreter, with a private TMPDIR, every process tagged, and of the
    GPUMEM_* variables only the caches and ``given``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") or k in OWN_CACHES}
    env.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               **{TAG_ENV: tag}, **given)
    return subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def private_tmp(tmp_path):
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    return folder


def test_measure_prints_the_scaling_table_of_a_script_and_leaves_nothing(tmp_path, private_tmp, launch_tag):
    pytest.importorskip("torch")
    report, markdown = tmp_path / "out" / "m.json", tmp_path / "out" / "m.md"
    done = gpumem("measure", "--nproc", "1,2,4", "--max-nproc", "2", "--report", str(report),
                  "--markdown", str(markdown), "--", "examples/train_net.py", "--steps", "2",
                  cwd=REPO, tmp=private_tmp, tag=launch_tag)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # No limit was given: nothing was judged, and nothing says "pass".
    assert lines[0] == ("gpumem measure: examples/train_net.py --steps 2 (direct launcher): measured "
                        "(no limits given: nothing judged)")
    assert lines[1].split()[:3] == ["nproc", "gated", "MiB"]
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in lines[3:])}
    assert sorted(rows) == ["1", "2", "4 (predicted)"]
    assert rows["1"][1].endswith("(rank 0)") and rows["1"][4] == "-" and rows["1"][6].startswith("cpu, ")
    assert re.fullmatch(r"\d+\.\d\dx", rows["2"][4]) and rows["2"][2] != "-"  # ratio; rank 1's peak
    assert rows["4 (predicted)"][6] == "cpu, predicted by a + b*N from nproc 1,2; LOO error n/a: two sizes"
    records = load_report(report)  # the plugin's format: gpumem diff reads it
    assert [(s.nproc, s.predicted) for s in records[0].sizes] == [(1, False), (2, False), (4, True)]
    assert (records[0].status, records[0].cause) == ("measured", None)
    assert "| measured |" in markdown.read_text() and "pass" not in markdown.read_text()
    assert len(records[0].sizes[1].measured.peaks) == 2
    assert "**predicted**" in markdown.read_text()
    # The launch folders are gone (torch itself may leave its compile cache folder there).
    assert [p.name for p in private_tmp.iterdir() if p.name.startswith("gpumem")] == []


SHARDED = """
import os

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
kept = torch.empty(256 * 2**20 // 4 // dist.get_world_size(), device="cuda")  # 256 MiB over the world
dist.destroy_process_group()
"""


def test_a_cuda_script_is_measured_on_a_fake_gpu_and_says_so(tmp_path, private_tmp, launch_tag):
    pytest.importorskip("torch")
    (tmp_path / "shard.py").write_text(SHARDED)
    report = tmp_path / "m.json"
    done = gpumem("measure", "--nproc", "1,2,4", "--device", "gpu", "--fake-gpu", "on", "--report", str(report),
                  "--", "shard.py", cwd=tmp_path, tmp=private_tmp, tag=launch_tag)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in done.stdout.splitlines()[3:])}
    assert [rows[n][1] for n in ("1", "2", "4")] == ["256.0 (rank 0)", "128.0 (rank 0)", "64.0 (rank 0)"]
    assert all("fake GPU NVIDIA H200" in rows[n][-1] for n in rows), rows
    assert [s.measured.fake_gpu for s in load_report(report)[0].sizes] == ["NVIDIA H200"] * 3


def test_a_failing_program_exits_1_with_its_output(tmp_path, private_tmp, launch_tag):
    (tmp_path / "train.py").write_text("import os, sys\n"
                                       "print('loading shard', os.environ['RANK'], flush=True)\n"
                                       "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = gpumem("measure", "--nproc", "1,2", "--", "train.py", cwd=tmp_path, tmp=private_tmp, tag=launch_tag)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 of 2 failed (exit code 3); last lines of its output:" in done.stderr
    assert "loading shard 1" in done.stderr
    assert list(private_tmp.iterdir()) == []


def test_measure_honours_the_fail_fast_grace_a_test_session_does(tmp_path, private_tmp, launch_tag):
    """``gpumem measure`` builds its runner where ``pytest --gpumem`` does (Session.from_settings), so the
    fail-fast grace is the session's: rank 1 fails at once, rank 0 ends 3 s later on its own, inside
    a 30 s grace; at the 2 s default it is stopped (issue 37: measure used to ignore the setting)."""
    (tmp_path / "train.py").write_text("import os, sys, time\n"
                                       "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                                       "time.sleep(3)\nprint('rank 0 saved its checkpoint', flush=True)\n")
    graced = gpumem("measure", "--nproc", "2", "--", "train.py", cwd=tmp_path, tmp=private_tmp, tag=launch_tag,
                    GPUMEM_FAIL_FAST_GRACE="30")
    assert graced.returncode == 1, graced.stdout + graced.stderr
    assert "rank 1 of 2 failed (exit code 3)" in graced.stderr
    assert "stopped by pytest-gpumem" not in graced.stderr, graced.stderr
    stopped = gpumem("measure", "--nproc", "2", "--", "train.py", cwd=tmp_path, tmp=private_tmp, tag=launch_tag)
    assert "rank 0 of 2: stopped by pytest-gpumem after rank 1 failed" in stopped.stderr, stopped.stderr
    assert list(private_tmp.iterdir()) == []


def test_a_hanging_program_times_out_and_every_process_is_gone(tmp_path, private_tmp, launch_tag):
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(600)\n")
    done = gpumem("measure", "--nproc", "2", "--timeout", "3", "--", "hang.py",
                  cwd=tmp_path, tmp=private_tmp, tag=launch_tag, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "launch timed out after 3 s at nproc=2" in done.stderr
    assert processes_tagged(launch_tag) == []
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_mid_launch_leaves_no_process_and_no_folder(signum, tmp_path, private_tmp, launch_tag):
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") or k in OWN_CACHES}
    env.update(TMPDIR=str(private_tmp), PYTHONPATH=str(REPO), **{TAG_ENV: launch_tag})
    proc = subprocess.Popen([sys.executable, "-m", "pytest_gpumem.cli", "measure", "--nproc", "2", "--", "hang.py"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while len(processes_tagged(launch_tag)) < 3 and time.monotonic() < deadline:  # gpumem and both ranks
        time.sleep(0.2)
    assert len(processes_tagged(launch_tag)) >= 3, proc.communicate(timeout=30)[0]
    proc.send_signal(signum)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, output
    assert processes_tagged(launch_tag) == []
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1,x", "--", "t.py"],
     "argument --nproc: '1,x' is not accepted: expected world sizes separated by commas"),
    (["--nproc", "0,2", "--", "t.py"],
     "argument --nproc: nproc=[0, 2] is not accepted: expected an int or a list of ints from 1 to 1024"),
    (["--nproc", "2", "--launcher", "mpirun", "--", "t.py"],
     "argument --launcher: launcher='mpirun' is not accepted: expected one of direct, oneflow, srun, torchrun"),
    (["--nproc", "2", "--timeout", "soon", "--", "t.py"],
     "argument --timeout: 'soon' is not accepted: expected a number of seconds > 0"),
    (["--nproc", "2", "--max-nproc", "-1", "--", "t.py"],
     "argument --max-nproc: '-1' is not accepted: expected an int >= 1, or gpus"),
    (["--nproc", "1,2", "--rank", "1", "--", "t.py"],
     "argument --rank: rank=1 is not accepted: the smallest world size launched is 1"),
    (["--nproc", "2", "--fake-gpu", "sometimes", "--", "t.py"],
     "argument --fake-gpu: 'sometimes' is not accepted: expected one of auto, on, off"),
    (["--nproc", "2", "--device", "gpu", "--fake-gpu-model", "NVIDIA Z9", "--", "t.py"],
     "argument --fake-gpu-model: fake GPU model 'NVIDIA Z9' is not built in or in "),
    (["--nproc", "2"], "the program is missing: expected it after --"),
    (["--nproc", "2", "--", "python", "t.py"], "the program starts at 'python': start it at the script"),
    (["--nproc", "2", "--", "nothere.py"], "the program 'nothere.py' is not a file under"),
    (["--", "t.py"], "the following arguments are required: --nproc"),
])
def test_bad_arguments_name_the_argument_and_what_is_accepted(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    try:
        code = measure.main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_bad_environment_default_names_its_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    monkeypatch.setenv("GPUMEM_TIMEOUT", "soon")
    assert measure.main(["--nproc", "2", "--", "t.py"]) == 2
    assert "Invalid gpumem_timeout 'soon' from the GPUMEM_TIMEOUT environment variable" in capsys.readouterr().err


def test_cli_lists_measure_in_its_help():
    done = subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "per-rank scaling table" in done.stdout


def test_a_bad_allocator_setting_for_a_fake_gpu_names_its_variable_and_what_is_accepted(tmp_path, monkeypatch, capsys):
    """The fake GPU's caching allocator runs with the job's PYTORCH_CUDA_ALLOC_CONF: checked before a launch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:lots")
    assert measure.main(["--nproc", "2", "--device", "gpu", "--fake-gpu", "on", "--", "t.py"]) == 2
    assert ("PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb accepts a whole number of MiB >= large_segment_size_mb, "
            "got 'lots'") in capsys.readouterr().err
