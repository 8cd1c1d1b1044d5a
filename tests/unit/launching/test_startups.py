"""The start-up figures kept across sessions (launching.startups): what is reused, and when not."""

from __future__ import annotations

import json

from pytest_gpumem.launching.startups import Startups
from pytest_gpumem.rankside.rank import _startup_given

LAUNCH = ("direct", "auto", (), None, None, (), 1)


def _learnt(tmp_path, figures=None):
    (tmp_path / "test_job.py").write_text("import os\n")
    startups = Startups("cached", tmp_path / "cache" / "startups.json", tmp_path)
    startups.learn("test_job.py::test_a", LAUNCH, 2, figures or {0: (80.5, 81.25), 1: (79.0, 80.0)},
                   {"test_job.py": _sha(tmp_path / "test_job.py")})
    return startups


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_unknown_start_up_asks_for_a_probe_then_hands_each_rank_its_figures(tmp_path):
    startups = Startups("cached", tmp_path / "startups.json", tmp_path)
    assert startups.env("test_job.py::test_a", LAUNCH, 2) == "probe"
    startups = _learnt(tmp_path)
    assert startups.env("test_job.py::test_a", LAUNCH, 2) == "0=80.5/81.25;1=79.0/80.0"
    assert _startup_given("0=80.5/81.25;1=79.0/80.0", 1) == (79.0, 80.0)
    assert _startup_given("0=80.5/81.25", 1) is None  # not this rank's: it tracks whole
    assert _startup_given("probe", 0) is None


def test_a_later_session_reads_them_from_the_file_for_the_same_test_launch_and_size(tmp_path):
    _learnt(tmp_path)
    later = Startups("cached", tmp_path / "cache" / "startups.json", tmp_path)
    assert later.env("test_job.py::test_a", LAUNCH, 2) == "0=80.5/81.25;1=79.0/80.0"
    assert later.env("test_job.py::test_a", LAUNCH, 1) == "probe"  # another size
    assert later.env("test_job.py::test_b", LAUNCH, 2) == "probe"  # another test
    assert later.env("test_job.py::test_a", ("torchrun",) + LAUNCH[1:], 2) == "probe"  # another launch
    assert later.notes == []


def test_a_changed_file_that_the_ranks_imported_is_measured_again(tmp_path):
    _learnt(tmp_path)
    (tmp_path / "test_job.py").write_text("import os\nBLOB = bytearray(40 << 20)\n")
    later = Startups("cached", tmp_path / "cache" / "startups.json", tmp_path)
    assert later.env("test_job.py::test_a", LAUNCH, 2) == "probe"


def test_a_broken_cache_file_is_named_not_trusted_and_rewritten(tmp_path):
    path = tmp_path / "cache" / "startups.json"
    path.parent.mkdir()
    path.write_text('{"schema": 1, "startups": [{"key": {}, "ranks": {"0": [1.0]}, "files": {}, '
                    '"measured": "2026-12-01T00:00:00+00:00"}]}')
    startups = Startups("cached", path, tmp_path)
    assert startups.env("test_job.py::test_a", LAUNCH, 2) == "probe"
    assert startups.take_notes() == [
        f"start-up cache {path}: startups[0].ranks['0']: [1.0]; expected a rank like '0' -> [live MiB, peak MiB], "
        "finite, 0 <= value < 2**40: not used; start-ups are measured again and the file rewritten"]
    startups.learn("test_job.py::test_a", LAUNCH, 1, {0: (1.0, 2.0)}, {})
    assert [len(e["ranks"]) for e in json.loads(path.read_text())["startups"]] == [1]


def test_an_unwritable_cache_keeps_the_figures_for_this_session_and_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    startups = Startups("cached", blocker / "startups.json", tmp_path)
    startups.learn("test_job.py::test_a", LAUNCH, 1, {0: (1.0, 2.0)}, {})
    assert startups.env("test_job.py::test_a", LAUNCH, 1) == "0=1.0/2.0"
    assert "cannot be written" in startups.take_notes()[0]


def test_a_failed_probe_tracks_those_ranks_whole_for_the_session_and_is_said_once(tmp_path):
    startups = Startups("cached", None, tmp_path)
    startups.failed("test_job.py::test_a", LAUNCH, 2, ["rank 1: memray tracker did not start (busy)"])
    assert startups.env("test_job.py::test_a", LAUNCH, 2) == ""
    startups.failed("test_job.py::test_a", LAUNCH, 2, ["rank 1: memray tracker did not start (busy)"])
    assert startups.take_notes() == [
        "the start-up probe of test_job.py::test_a at nproc=2 measured nothing "
        "(rank 1: memray tracker did not start (busy)): its ranks were tracked whole"]
    assert startups.take_notes() == []


def test_tracked_hands_no_figures_and_launches_no_probe(tmp_path):
    startups = _learnt(tmp_path)
    startups.mode = "tracked"
    assert startups.env("test_job.py::test_a", LAUNCH, 2) == ""
