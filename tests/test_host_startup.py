"""The ranks' start-up measured once (gpumem_host_startup=cached): real launches, plain-Python jobs.

Each process imports the test module once, so a line appended at import counts the processes a
session started: pytest's own ("1", collecting), then per size a probe (stopped at the test's setup)
and the test's own launch on a cold cache, the launch alone on a warm one.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

MODULE = '''
import os
import time

import pytest

with open(os.environ["STARTS"], "a") as f:
    f.write(os.environ.get("WORLD_SIZE", "1") + "\\n")
{extra}

@pytest.mark.gpumem(nproc=[1, 2], tolerance="16MiB")
def test_job():
    mib = int(open(os.environ["SIZE_FILE"]).read())  # data, not code: no cached start-up depends on it
    held = bytearray(mib << 20)
    time.sleep(0.002)
    del held
'''


@pytest.fixture
def job(pytester, tmp_path, monkeypatch, launch_tag):
    starts, size = tmp_path / "starts.txt", tmp_path / "size.txt"
    monkeypatch.setenv("STARTS", str(starts))
    monkeypatch.setenv("SIZE_FILE", str(size))
    monkeypatch.setenv("GPUMEM_STARTUP_CACHE", str(tmp_path / "startups.json"))
    size.write_text("0")
    pytester.makepyfile(test_job=MODULE.format(extra=""))

    def run(*args: str, mib: int = 0, extra: str | None = None) -> tuple[pytest.RunResult, list[str], dict]:
        size.write_text(str(mib))
        if extra is not None:
            pytester.makepyfile(test_job=MODULE.format(extra=extra))
        starts.write_text("")
        report = tmp_path / "report.json"
        result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=off",
                                    f"--gpumem-report={report}", *args)
        sizes = json.loads(report.read_text())["tests"][0]["sizes"]
        return result, sorted(starts.read_text().split()), {s["nproc"]: s["ranks"] for s in sizes}

    return run


def test_a_warm_session_launches_no_probe_and_reads_the_cold_sessions_figures(job):
    cold, cold_starts, cold_figures = job("--gpumem-refresh")
    cold.assert_outcomes(passed=1)
    assert cold_starts == ["1", "1", "1", "2", "2", "2", "2"]  # per size: a probe, then the test's launch
    warm, warm_starts, warm_figures = job()
    warm.assert_outcomes(passed=1)
    assert warm_starts == ["1", "1", "2", "2"]
    for nproc, ranks in cold_figures.items():
        for rank, mib in ranks.items():
            assert warm_figures[nproc][rank] == pytest.approx(mib, abs=0.05), (nproc, rank)


def test_a_regression_in_the_body_is_caught_with_a_cached_start_up(job):
    """40 MiB more, held for 2 ms, by the body of a test whose start-up comes from the cache."""
    job("--gpumem-refresh")[0].assert_outcomes(passed=1)
    result, starts, figures = job(mib=40)
    assert starts == ["1", "1", "2", "2"]  # no probe: the start-up was cached
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=1 (cpu): peak * MiB > baseline * MiB + 16 MiB*"])
    fine, _, baseline_figures = job()
    fine.assert_outcomes(passed=1)
    assert figures[1]["0"] - baseline_figures[1]["0"] == pytest.approx(40, abs=1)


def test_a_changed_module_has_its_start_up_measured_again(job):
    """A module-level 40 MiB (the start-up grew): its file changed, so its start-up is probed again."""
    job("--gpumem-refresh")[0].assert_outcomes(passed=1)
    result, starts, _ = job(extra="BLOB = bytearray(40 << 20)")
    assert starts == ["1", "1", "1", "2", "2", "2", "2"]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=1 (cpu): peak * MiB > baseline * MiB + 16 MiB*"])


def test_tracked_tracks_every_rank_whole_and_launches_no_probe(job):
    result, starts, figures = job("--gpumem-host-startup=tracked")
    result.assert_outcomes(passed=1)
    assert starts == ["1", "1", "2", "2"]
    assert all(mib > 0 for ranks in figures.values() for mib in ranks.values())


def test_a_rank_that_cannot_start_ends_with_the_probe_not_a_second_launch(job, pytester):
    """A crash at import: the probe shows it, and the test's own launch is not run to show it again."""
    result, starts, _ = job(extra='if "GPUMEM_WORKDIR" in os.environ:\n    raise RuntimeError("broken at import")')
    result.assert_outcomes(failed=1)
    assert starts == ["1", "1"]  # pytest's, then the probe's one rank at nproc=1; nothing after it
    result.stdout.fnmatch_lines(["*broken at import*"])
