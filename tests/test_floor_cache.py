"""The floor cache: a floor measured in one session is reused by the next ones, keyed by what moves it.

The store on its own (round trip, every kind of broken file, an unwritable place, its bound), then
sessions of real launches through the runner: the second launches no floor and labels the cached
one; a refresh, a changed key and a corrupt file each measure it again.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging.assemble import build
from pytest_gpumem.judging.verdict import judge
from pytest_gpumem.launching import floor_cache
from pytest_gpumem.launching.driver import TestDriver
from pytest_gpumem.launching.floor_cache import FloorCache, cache_key
from pytest_gpumem.launching.rank_setup import RankSetup

PROVENANCE = {"python": "3.11.7", "platform": "Linux-x86_64", "torch": "2.13.0", "torch_cuda": "12.8",
              "nvidia_driver": "580.159.04", "cuda_driver": "13.0", "env.OMP_NUM_THREADS": "1",
              "date": "2026-12-01", "boxing.graphs": "1", "config.batch": "8"}


def key(**changes: str) -> dict[str, str]:
    prov = {**PROVENANCE, **changes}
    return cache_key(device="gpu", platform="gpu:NVIDIA H200", world_size=2, method="process sampled",
                     launch=("direct", "gpu", (), None, "pytest_gpumem.rankside.floor_job", ("torch", "gpu"), None),
                     provenance=prov)


def test_a_stored_floor_comes_back_under_its_key_only(tmp_path):
    cache = FloorCache(tmp_path / "sub" / "floors.json")
    assert cache.get(key()) == (None, None)  # no file yet: a miss, nothing to report
    assert cache.put(key(), "torch", {0: 1452.0, 1: 1452.0}) is None
    found, problem = cache.get(key())
    assert problem is None and found is not None
    assert (found.framework, found.ranks) == ("torch", {0: 1452.0, 1: 1452.0})
    assert found.date == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert cache.put(key(), "torch", {0: 1460.0, 1: 1460.0}) is None  # the same key is replaced
    assert len(json.loads(cache.path.read_text())["floors"]) == 1
    assert cache.get(key())[0].ranks == {0: 1460.0, 1: 1460.0}


@pytest.mark.parametrize("change", [
    {"python": "3.12.1"}, {"nvidia_driver": "575.51.03"}, {"cuda_driver": "12.9"}, {"torch": "2.14.0"},
    {"torch_cuda": "13.0"}, {"env.NCCL_ALGO": "Ring"}, {"env.OMP_NUM_THREADS": "4"}],
    ids=lambda c: next(iter(c)))
def test_what_moves_the_floor_is_in_the_key(change):
    assert key(**change) != key()


def test_what_does_not_move_it_is_not():
    """The date, the boxing audit and the test's declared settings belong to the test, not to the empty job."""
    assert key(date="2027-01-01", **{"boxing.graphs": "9", "config.batch": "64"}) == key()


BROKEN = {
    "truncated": ('{"schema": 1, "floors": [', "line 1 column 26"),
    "not JSON": ("floors, please", "line 1 column 1"),
    "another document": ('{"tests": {}}', "(document): not a floor cache"),
    "unknown framework": ('{"schema": 1, "floors": [{"key": {}, "framework": "jax", "ranks": {"0": 1.0},'
                          ' "measured": "2026-12-01T00:00:00+00:00"}]}', "floors[0].framework: 'jax'"),
    "negative MiB": ('{"schema": 1, "floors": [{"key": {}, "framework": "torch", "ranks": {"0": -1},'
                     ' "measured": "2026-12-01T00:00:00+00:00"}]}', "floors[0].ranks['0']: -1 is not a number of MiB"),
    "no date": ('{"schema": 1, "floors": [{"key": {}, "framework": "torch", "ranks": {"0": 1.0},'
                ' "measured": "yesterday"}]}', "floors[0].measured: 'yesterday' is not a date"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_file_is_named_never_trusted_and_rewritten_by_the_next_put(tmp_path, name):
    text, where = BROKEN[name]
    cache = FloorCache(tmp_path / "floors.json")
    cache.path.write_text(text)
    found, problem = cache.get(key())
    assert found is None
    assert problem is not None and problem.startswith(f"floor cache {cache.path}: {where}"), problem
    assert "measured again and the file rewritten" in problem
    assert cache.put(key(), "torch", {0: 612.0}) is None
    assert cache.get(key())[0].ranks == {0: 612.0}


def test_an_unwritable_cache_is_a_sentence_not_an_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    cache = FloorCache(tmp_path / "a-file" / "floors.json")
    problem = cache.put(key(), "torch", {0: 612.0})
    assert problem is not None and "cannot be written" in problem and "used in this session only" in problem
    found, problem = cache.get(key())
    assert found is None and f"floor cache {cache.path}: (file): cannot be read (Not a directory)" in str(problem)


def test_the_file_keeps_the_newest_entries_only(tmp_path, monkeypatch):
    monkeypatch.setattr(floor_cache, "MAX_ENTRIES", 3)
    cache = FloorCache(tmp_path / "floors.json")
    for n in range(5):
        assert cache.put(key(torch=f"2.{n}"), "torch", {0: float(n)}) is None
    kept = [e["key"]["torch"] for e in json.loads(cache.path.read_text())["floors"]]
    assert kept == ["2.2", "2.3", "2.4"]


# ---------------------------------------------------------------------------- sessions of real launches

JOB = "import torch\nx = torch.ones(256, 1024)\n"  # torch in the rank's provenance: the floor is torch's


def session(tmp_path: Path, cache: FloorCache, *, refresh: bool = False,
            env: dict[str, str] | None = None) -> tuple:
    """One pytest session's runner (floors for host figures too, from the cache unless refreshing):
    the test's run and the programs launched, in order."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    runner = TestDriver(cwd=tmp_path, setup=RankSetup(rootdir=tmp_path, rank_pytest_args=lambda _: []), floor="on",
                    floor_cache=cache, refresh_floors=refresh)
    launched: list[str] = []
    real = runner._launch

    def counting(test_id, spec, *rest, **given):  # a spy: every launch still runs for real
        launched.append(spec.module or Path(spec.script).name)
        return real(test_id, spec, *rest, **given)

    runner._launch = counting
    spec = parse_marker((), {"nproc": 1, "script": str(script), "device": "cpu", "env": env or {}}, Defaults())
    test = runner.run("job.py::test_job", spec)
    assert not test.problems and test.skip_reason is None, test.problems
    return test, launched


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.long  # make test-long: the cache's unit tests above and the session-path test below run in make test
def test_the_next_session_reuses_the_floor_and_says_it_is_cached(tmp_path, launch_tag):
    pytest.importorskip("torch")
    cache = FloorCache(tmp_path / "cache" / "floors.json")
    probe = "pytest_gpumem.rankside.floor_job"

    first, launched = session(tmp_path, cache)
    assert launched == ["job.py", probe]
    measured = first.results[0].floor
    assert measured is not None and measured.cached is None and measured.ranks[0] > 0

    second, launched = session(tmp_path, cache)
    assert launched == ["job.py"]  # no floor launched
    floor = second.results[0].floor
    stored = json.loads(cache.path.read_text())["floors"]
    assert len(stored) == 1 and floor is not None
    assert (floor.ranks, floor.cached) == (measured.ranks, stored[0]["measured"][:10])
    rendered = judge(second.spec, second.results).render()
    assert f"(floor: an empty job, torch start-up; cached, measured {floor.cached})" in rendered, rendered
    record = build(second, judge(second.spec, second.results), "passed").to_json()
    assert record["sizes"][0]["floor"]["cached"] == floor.cached

    _, launched = session(tmp_path, cache, refresh=True)  # --gpumem-floor=on: measured again, entry rewritten
    assert launched == ["job.py", probe]
    assert len(json.loads(cache.path.read_text())["floors"]) == 1

    _, launched = session(tmp_path, cache, env={"OMP_NUM_THREADS": "2"})  # another key: measured, kept apart
    assert launched == ["job.py", probe]
    assert len(json.loads(cache.path.read_text())["floors"]) == 2

    cache.path.write_text('{"schema": 1, "floors": [')  # a corrupt file: named, not trusted, rewritten
    broken, launched = session(tmp_path, cache)
    assert launched == ["job.py", probe]
    notes = [note for run in broken.runs for note in run.notes]
    assert any(note.startswith(f"floor cache {cache.path}: line 1 column 26") for note in notes), notes
    assert broken.results[0].floor is not None and broken.results[0].floor.cached is None
    assert len(json.loads(cache.path.read_text())["floors"]) == 1


@pytest.mark.torch
@pytest.mark.slow
def test_the_session_writes_its_floors_where_the_setting_says(pytester, launch_tag, tmp_path):
    """The plugin's wiring: --gpumem-floor-cache names the file; the floor measured now is not labelled."""
    pytest.importorskip("torch")
    cache = tmp_path / "elsewhere" / "floors.json"
    report = tmp_path / "report.json"
    pytester.makepyfile('''
import pytest
import torch

@pytest.mark.gpumem(nproc=1)
def test_small():
    torch.ones(1024, 1024)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=on",
                                f"--gpumem-floor-cache={cache}", f"--gpumem-report={report}")
    result.assert_outcomes(passed=1)
    floor = json.loads(report.read_text())["tests"][0]["sizes"][0]["floor"]
    assert floor["framework"] == "torch" and floor["cached"] is None
    (entry,) = json.loads(cache.read_text())["floors"]
    assert entry["framework"] == "torch" and entry["key"]["world_size"] == "1" and entry["key"]["device"] == "cpu"
    assert entry["ranks"]["0"] == pytest.approx(floor["ranks"]["0"], abs=0.05)
