"""The plugin's NCCL defaults and what a real GPU size says of them (issue 54: the blocking wait
changes the job, so the figure says it was measured with it, and by how much a job read higher as run)."""

from __future__ import annotations

from pytest_gpumem.launching.rank_setup import NCCL_DEFAULTS_NOTE, nccl_defaults, nccl_defaults_note

APPLIED = {"env.TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_the_default_reaches_gpu_ranks_unless_the_session_sets_it():
    assert nccl_defaults(True, {}) == {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert nccl_defaults(True, {"TORCH_NCCL_BLOCKING_WAIT": "0"}) == {}
    assert nccl_defaults(False, {}) == {}


def test_a_size_measured_under_the_default_says_so_with_the_measured_difference():
    note = nccl_defaults_note(APPLIED, {}, {})
    assert note == NCCL_DEFAULTS_NOTE
    assert "+3.1%" in note and "TORCH_NCCL_BLOCKING_WAIT': '0'" in note


def test_no_note_where_the_job_or_session_chose_the_setting_or_the_ranks_lacked_it():
    assert nccl_defaults_note(APPLIED, {"TORCH_NCCL_BLOCKING_WAIT": "1"}, {}) is None
    assert nccl_defaults_note(APPLIED, {}, {"TORCH_NCCL_BLOCKING_WAIT": "1"}) is None
    assert nccl_defaults_note({"env.TORCH_NCCL_BLOCKING_WAIT": "0"}, {}, {}) is None
    assert nccl_defaults_note({}, {}, {}) is None
