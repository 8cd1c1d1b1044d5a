"""The order of a failed launch's text, from the launch's own record of how it ended (plain Python;
the real launches that produce these records are in test_faults.py and test_rank_start.py)."""

from __future__ import annotations

from pathlib import Path

from pytest_gpumem.launching.failures import CUDA_HINT, LaunchContext, import_hint, problems
from pytest_gpumem.launching.launchers import launcher
from pytest_gpumem.launching.supervise import LaunchResult, absolute_pythonpath
from pytest_gpumem.rankside.protocol import RankResult


def ctx(tmp_path: Path, **kw) -> LaunchContext:
    return LaunchContext(**{"launcher": launcher("direct"), "marker_env": {}, "cwd": tmp_path, "workdir": tmp_path,
                            "timeout": 60.0, "body_mode": True, "python": "/venv/bin/python", **kw})


def launch(**kw) -> LaunchResult:
    return LaunchResult(**{"nproc": 3, "command": [], "pids": {0: 10, 1: 11, 2: 12}, **kw})


def test_the_first_failure_leads_the_others_follow_in_order_and_the_stopped_come_last(tmp_path):
    run = launch(end="fail-fast", failed_at={2: 0.5, 0: 0.9}, ended_at={0: 1.0, 2: 0.6}, stopped=frozenset({1}),
                 returncodes={0: 1, 1: -9, 2: 1})
    outcomes = {0: RankResult("failed", "[call] E   ValueError", "ValueError: late"),
                1: RankResult("missing", "killed by SIGKILL"),
                2: RankResult("failed", "[call] E   RuntimeError", "RuntimeError: first")}
    found = problems(run, outcomes, ctx(tmp_path))
    assert [text.splitlines()[0] for text in found] == [
        "rank 2 of 3 failed: RuntimeError: first",
        "rank 0 of 3 failed: ValueError: late",
        "rank 1 of 3: stopped by pytest-gpumem after rank 2 failed (SIGTERM, then SIGKILL 3 s later)",
    ]


def test_a_failed_rank_stuck_after_its_failure_keeps_its_exception_first_and_says_where_each_was_stopped(tmp_path):
    """Rank 1 raised, then its teardown waited in a barrier; rank 0 waited in all_reduce: both were
    stopped after the grace, with their stacks; rank 1's exception leads."""
    run = launch(nproc=2, pids={0: 10, 1: 11}, end="fail-fast", failed_at={1: 0.4}, stopped=frozenset({0, 1}),
                 returncodes={0: -15, 1: -15}, stacks={0: '  File "t.py", line 9 in all_reduce',
                                                      1: '  File "conftest.py", line 9 in process_group'})
    outcomes = {0: RankResult("missing", "killed by SIGTERM"),
                1: RankResult("failed", "[call] E   RuntimeError: rank 1 lost its shard",
                              "RuntimeError: rank 1 lost its shard")}
    found = problems(run, outcomes, ctx(tmp_path, fail_fast_grace=2.5))
    assert found == [
        "rank 1 of 2 failed: RuntimeError: rank 1 lost its shard\n[call] E   RuntimeError: rank 1 lost its shard\n"
        "rank 1 of 2 was still running 2.5 s after the first failure: stopped by pytest-gpumem (SIGTERM)\n"
        "--- rank 1 Python stack when stopped ---\n  File \"conftest.py\", line 9 in process_group",
        "rank 0 of 2: stopped by pytest-gpumem after rank 1 failed (SIGTERM)\n"
        "--- rank 0 Python stack when stopped ---\n  File \"t.py\", line 9 in all_reduce",
    ]


def test_a_timeout_names_the_hung_rank_with_its_stack_not_the_one_that_finished(tmp_path):
    run = launch(nproc=2, pids={0: 10, 1: 11}, end="timeout", timed_out=True, duration_s=60.0,
                 stopped=frozenset({1}), ended_at={0: 2.0}, stacks={1: '  File "t.py", line 3 in wait'})
    found = problems(run, {0: RankResult("passed"), 1: RankResult("missing", "killed by SIGTERM")},
                     ctx(tmp_path))
    assert found == ["rank 1 of 2 hung: no result when the launch timed out after 60 s at nproc=2 (launcher direct)"
                     "\n--- rank 1 Python stack when the timeout hit ---\n  File \"t.py\", line 3 in wait"]


def test_a_timeout_after_every_rank_reported_says_so(tmp_path):
    run = launch(nproc=1, pids={0: 10}, end="timeout", timed_out=True, stopped=frozenset({0}))
    (found,) = problems(run, {0: RankResult("passed")}, ctx(tmp_path))
    assert found == ("launch timed out after 60 s at nproc=1 (launcher direct); ranks still running after their "
                     "result: [0]")


def test_a_rank_that_never_announced_itself_shows_its_output_and_why(tmp_path):
    (tmp_path / "rank-0.log").write_text("python: Error while finding module specification for "
                                         "'pytest_gpumem.rankside.rank' (ModuleNotFoundError: No module named "
                                         "'pytest_gpumem')\n")
    run = launch(nproc=1, pids={}, returncodes={0: 1}, ended_at={0: 0.1}, pythonpath="/nonexistent")
    (found,) = problems(run, {0: RankResult("missing", "exit code 1")},
                        ctx(tmp_path, marker_env={"PYTHONPATH": "/nonexistent"}))
    lines = found.splitlines()
    assert lines[0] == ("rank 0 of 1 ended without a result (exit code 1) before the plugin's rank code started; "
                        "last lines of its output:")
    assert "No module named 'pytest_gpumem'" in lines[1]
    assert lines[2].startswith("hint: the rank could not import pytest_gpumem with PYTHONPATH='/nonexistent', "
                               "which the marker's env= sets in place of the session's: install the plugin into "
                               "/venv/bin/python")


def test_the_hint_names_who_set_the_pythonpath(tmp_path):
    output = "ModuleNotFoundError: No module named 'pytest_gpumem'"
    assert "relative entries 'src' are read from the ranks' folder" in import_hint(
        output, "src", ctx(tmp_path, marker_env={"PYTHONPATH": "src"}))
    assert "PYTHONPATH='/abs/src' (the session's, relative entries made absolute)" in import_hint(
        output, "/abs/src", ctx(tmp_path))
    assert "with no PYTHONPATH" in import_hint(output, None, ctx(tmp_path))
    assert import_hint("ModuleNotFoundError: No module named 'torch'", None, ctx(tmp_path)) == ""


def test_relative_pythonpath_entries_are_made_absolute_as_python_does():
    assert absolute_pythonpath(".:src::/abs/x", "/repo") == "/repo:/repo/src:/repo:/abs/x"
    assert absolute_pythonpath("src", None) == "src"


def test_the_launchers_output_is_shown_once_for_ranks_without_a_log(tmp_path):
    """torchrun that never started its ranks before the timeout: both ranks point at one copy."""
    (tmp_path / "launcher.log").write_text("torchrun: starting\nReceived 15 death signal\n")
    run = launch(nproc=2, pids={}, end="timeout", timed_out=True, launcher_returncode=-9)
    missing = {r: RankResult("missing", "torchrun launcher killed by SIGKILL") for r in (0, 1)}
    text = "\n".join(problems(run, missing, ctx(tmp_path, launcher=launcher("torchrun"))))
    assert text.count("Received 15 death signal") == 1
    assert text.splitlines()[0] == ("launch timed out after 60 s at nproc=2 (launcher torchrun); no rank had "
                                    "started the plugin's rank code")
    assert ("rank 1 of 2 ended without a result (torchrun launcher killed by SIGKILL) before the plugin's rank code "
            "started; it left no log of its own (the launcher's output is above)") in text


FINISHING_CAPTURE = '''Thread 0x00007f3a1c7fe640 (most recent call first):
  File "/venv/lib/python3.11/site-packages/pytest_gpumem/sampling/host.py", line 88 in _poll
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap

Current thread 0x00007f3a2e1b9740 (most recent call first):
  File "/venv/lib/python3.11/site-packages/pytest_gpumem/sampling/allocations.py", line 122 in _close
  File "/venv/lib/python3.11/site-packages/pytest_gpumem/rankside/rank.py", line 301 in main
  File "/venv/lib/python3.11/site-packages/_pytest/main.py", line 273 in wrap_session
  File "<frozen runpy>", line 88 in _run_code
'''


def test_a_rank_stopped_while_finishing_the_plugins_own_work_is_said_in_one_line(tmp_path):
    """The issue-36 noise: the failed rank was stopped while its allocation capture was being
    written; its stack held only the plugin's frames, which say nothing about the user's job."""
    from pytest_gpumem.launching.supervise import _user_frames

    assert _user_frames(FINISHING_CAPTURE) == ""
    run = launch(nproc=1, pids={0: 10}, end="fail-fast", failed_at={0: 0.4}, stopped=frozenset({0}),
                 returncodes={0: -15}, stacks={0: _user_frames(FINISHING_CAPTURE)})
    outcomes = {0: RankResult("failed", "[call] E   AssertionError", "AssertionError")}
    (found,) = problems(run, outcomes, ctx(tmp_path, fail_fast_grace=2.0))
    assert found.splitlines()[-1] == ("rank 0 of 1 was still running 2 s after the first failure: stopped by "
                                      "pytest-gpumem (SIGTERM)")
    assert "pytest_gpumem" not in found


def test_a_stopped_ranks_stack_in_the_users_code_keeps_only_the_users_frames():
    from pytest_gpumem.launching.supervise import _user_frames

    dump = FINISHING_CAPTURE.replace(
        '  File "/venv/lib/python3.11/site-packages/pytest_gpumem/sampling/allocations.py", line 122 in _close\n',
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 4120 in barrier\n'
        '  File "/work/job/test_train.py", line 31 in test_train\n')
    assert _user_frames(dump).splitlines() == [
        "Current thread 0x00007f3a2e1b9740 (most recent call first):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 4120 in barrier',
        '  File "/work/job/test_train.py", line 31 in test_train',
    ]


def test_a_simulated_process_is_named_by_the_rank_it_stood_for(tmp_path):
    run = launch(nproc=2, pids={0: 10, 1: 11}, simulated=(3, 7), world_size=8, returncodes={1: 1},
                 ended_at={1: 0.2})
    outcomes = {0: RankResult("passed"), 1: RankResult("failed", "[call] E   KeyError", "KeyError: 'w'")}
    (found,) = problems(run, outcomes, ctx(tmp_path))
    assert found.splitlines()[0] == "rank 7 of 8 (simulated) failed: KeyError: 'w'"


def test_a_cuda_job_under_device_auto_without_a_gpu_is_told_to_run_on_a_fake_gpu(tmp_path):
    """Issue 55: torch's CPU build raised AttributeError: module 'torch._C' has no attribute
    '_cuda_setDevice', with no word of device="gpu"."""
    error = "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'"
    outcome = {0: RankResult("failed", f"[call] ...\nE   {error}", error)}
    run = launch(nproc=1, pids={0: 10}, returncodes={0: 1}, failed_at={0: 0.5})
    (found,) = problems(run, outcome, ctx(tmp_path, without_gpu=True))
    assert found.splitlines()[:2] == [f"rank 0 of 1 failed: {error}", CUDA_HINT]
    assert CUDA_HINT.startswith('hint: this job uses CUDA and this machine has no GPU: mark it device="gpu"')
    (on_a_gpu,) = problems(run, outcome, ctx(tmp_path))  # device="gpu", or GPUs here: the error alone
    assert CUDA_HINT not in on_a_gpu
    (tmp_path / "rank-0.log").write_text("RuntimeError: Found no NVIDIA driver on your system.\n")  # script mode
    (script,) = problems(run, {0: RankResult("failed", "exit code 1")}, ctx(tmp_path, without_gpu=True,
                                                                           body_mode=False))
    assert script.splitlines()[-1] == CUDA_HINT
