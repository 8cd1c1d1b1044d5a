"""The whole baseline lifecycle with real launches, concurrent refreshes, broken files, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

JOB = '''
import os
import pytest

@pytest.mark.gpumem(nproc=2, tolerance="10%")
def test_job():
    extra = int(open(os.environ["EXTRA_FILE"]).read())
    buf = bytearray(extra * 1024 * 1024)   # a live allocation while the test runs
'''


@pytest.fixture
def job(pytester, monkeypatch, tmp_path):
    extra = tmp_path / "extra"
    extra.write_text("0")
    monkeypatch.setenv("EXTRA_FILE", str(extra))
    pytester.makepyfile(test_job=JOB)
    return extra


def run(pytester, *args):
    return pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "-W", "always", *args)


def test_a_baseline_of_another_metric_is_never_compared(pytester, job, monkeypatch, launch_tag):
    """An entry recorded as resident memory (RSS, before 0.2) next to a live-allocation figure:
    not compared; a warning locally, a failure in CI, both saying to refresh."""
    from pytest_gpumem.judging.baseline import BaselineStore, Entry
    from pytest_gpumem.sampling.identity import platform_key

    store = BaselineStore(pytester.path / "baselines")
    store.update("test_job.py::test_job", platform_key("cpu"),
                 {2: Entry(1.0, {0: 1.0, 1: 1.0}, 0, "cpu", "high-water mark", {"date": "2026-01-01"})})
    before = store.file_for("test_job.py::test_job").read_bytes()
    local = run(pytester)
    local.assert_outcomes(passed=1, warnings=1)  # 1.0 MiB would have failed any comparison
    local.stdout.fnmatch_lines(["*baseline of test_job.py::test_job on cpu:* was measured another way "
                                "(nproc=2 holds 'high-water mark', this run measured 'live allocations (memray)')"
                                ": not compared; record it again with `gpumem refresh test_job.py::test_job`*"])
    monkeypatch.setenv("CI", "true")
    ci = run(pytester)
    ci.assert_outcomes(failed=1)
    ci.stdout.fnmatch_lines(["*was measured another way*fails when CI is set*"])
    assert store.file_for("test_job.py::test_job").read_bytes() == before


def test_lifecycle(pytester, job, monkeypatch, launch_tag):
    stored = pytester.path / "baselines" / "test_job.py.json"

    # missing: a warning locally (at the test's own line, not in the plugin), a failure in CI
    local = run(pytester)
    local.assert_outcomes(passed=1, warnings=1)
    local.stdout.fnmatch_lines(["*warnings summary*", "*test_job.py:*: GpumemWarning: no baseline stored*"])
    assert "plugin.py" not in local.stdout.str()
    monkeypatch.setenv("CI", "true")
    ci = run(pytester)
    ci.assert_outcomes(failed=1)
    ci.stdout.fnmatch_lines(["*no baseline stored for test_job.py::test_job on cpu:* at nproc=2*gpumem refresh*"])
    assert not stored.exists(), "a run that is not a refresh never writes"

    # refresh: written, old -> new shown
    first = run(pytester, "--gpumem-refresh")
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(["*baselines refreshed*", "test_job.py::test_job nproc=2: (new) -> * MiB"])
    doc = json.loads(stored.read_text())
    entry = next(iter(doc["tests"]["test_job"].values()))["2"]
    assert set(entry["ranks"]) == {"0", "1"} and entry["method"] == "live allocations (memray)"

    # same: passes against it
    run(pytester).assert_outcomes(passed=1)

    # inflated: fails and leaves the file as it was
    before = stored.read_bytes()
    job.write_text("200")
    inflated = run(pytester)
    inflated.assert_outcomes(failed=1)
    inflated.stdout.fnmatch_lines(["*rank 0 at nproc=2 (cpu): peak * MiB > baseline * MiB + 10% (* MiB) = * MiB*",
                                   "*if the growth is intended: `gpumem refresh test_job.py::test_job` records the "
                                   "new figure; commit the baseline file with the change"])
    assert stored.read_bytes() == before

    # refresh again: rewritten; next run passes
    again = run(pytester, "--gpumem-refresh")
    again.stdout.fnmatch_lines(["test_job.py::test_job nproc=2: * -> * MiB (+*%)"])
    assert stored.read_bytes() != before
    run(pytester).assert_outcomes(passed=1)

    # back to the old size: an improvement is reported, not failed
    job.write_text("0")
    better = run(pytester)
    better.assert_outcomes(passed=1, warnings=1)
    better.stdout.fnmatch_lines(["*below the baseline * by more than 10% (* MiB); refresh the baseline to tighten it*"])
    # gpumem show lists it
    shown = subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "show", "--baselines",
                            str(pytester.path / "baselines")], capture_output=True, text=True)
    assert shown.returncode == 0 and "test_job.py::test_job" in shown.stdout and "nproc=2" in shown.stdout


def test_broken_file_fails_with_file_and_field_and_is_never_overwritten(pytester, job, launch_tag):
    stored = pytester.path / "baselines" / "test_job.py.json"
    stored.parent.mkdir()
    broken = '{"schema": 2, "tests": {"test_job": {"cpu:x": {"2": {"gated_mib": "lots"}}}}}\n'
    stored.write_text(broken)
    for extra in ((), ("--gpumem-refresh",)):
        result = run(pytester, *extra)
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*test_job.py.json*"])
        assert stored.read_text() == broken


def test_a_broken_file_fails_before_any_launch(pytester, monkeypatch, tmp_path, launch_tag):
    """The newcomer waited 32 s (both sizes launched) for "baseline file unusable": the file is read
    first, and a rank that would have run leaves a marker: none does, in a check or in a refresh."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("MARKER_FILE", str(marker))
    pytester.makepyfile(test_job='''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2])
def test_sizes():
    open(os.environ["MARKER_FILE"] + os.environ["RANK"], "w").close()

@pytest.mark.gpumem(nproc=1)
def test_other():
    pass
''')
    stored = pytester.path / "baselines" / "test_job.py.json"
    stored.parent.mkdir()
    broken = '{"schema": 2, "tests": {"test_sizes": {"cpu:x": {"2": {"gated_mib": "lots"}}}}}\n'
    stored.write_text(broken)
    for extra, what in (((), "file unusable (left untouched)"), (("--gpumem-refresh",), "not refreshed (file left "
                                                                                        "untouched)")):
        result = run(pytester, "-k", "test_sizes", *extra)
        result.assert_outcomes(failed=1, deselected=1)
        result.stdout.fnmatch_lines([f"*baseline {what}: {stored}: tests*test_sizes*.device: missing; "
                                     "expected all of device, *",
                                     "*(read before launching: no rank was started)*"])
        assert list(tmp_path.glob("ran*")) == []  # no rank ran the body
        assert stored.read_text() == broken
    # the launch does run where the file is sound
    stored.unlink()
    run(pytester, "-k", "test_sizes").assert_outcomes(passed=1, deselected=1)
    assert {p.name for p in tmp_path.glob("ran*")} == {"ran0", "ran1"}


def test_truncated_file_names_line_and_column(pytester, job, launch_tag):
    stored = pytester.path / "baselines" / "test_job.py.json"
    stored.parent.mkdir()
    stored.write_text('{"schema": 2, "tests": {"test_j')
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_job.py.json*line 1 column*"])


def test_concurrent_refresh_under_xdist_keeps_every_entry(pytester, launch_tag):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_many='''
import pytest

@pytest.mark.gpumem(nproc=1)
@pytest.mark.parametrize("i", range(16))
def test_one(i):
    pass
''')
    result = pytester.runpytest("-n", "4", "--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=16)
    doc = json.loads((pytester.path / "baselines" / "test_many.py.json").read_text())
    assert sorted(doc["tests"]) == sorted(f"test_one[{i}]" for i in range(16))
    # The controller prints one table covering every worker.
    assert result.stdout.str().count("test_many.py::test_one[") >= 16


def test_refresh_command_runs_pytest_with_refresh(pytester, job, launch_tag):
    proc = subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "refresh", "-p", "no:cacheprovider",
                           "test_job.py"], cwd=pytester.path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_job.py::test_job nproc=2: (new) ->" in proc.stdout
    assert (pytester.path / "baselines" / "test_job.py.json").exists()


def test_a_refresh_of_an_unchanged_test_changes_no_stored_site(pytester, job, launch_tag):
    """Sites are stored rounded and kept when a rerun moves them by noise: the diff of a refresh of an
    unchanged test touches no site (only the figures within their spread and the date may move)."""
    job.write_text("96")
    stored = pytester.path / "baselines" / "test_job.py.json"

    def sites() -> list:
        entry = json.loads(stored.read_text())["tests"]["test_job"]
        return [size["sites"] for platform in entry.values() for size in platform.values()]

    run(pytester, "--gpumem-refresh").assert_outcomes(passed=1)
    first = sites()
    assert first and any(s["where"] == "test_job.py:7" and s["mib"] == 96.0 for s in first[0]), first
    for _ in range(2):
        run(pytester, "--gpumem-refresh").assert_outcomes(passed=1)
        assert sites() == first
    job.write_text("160")  # a real change is written
    run(pytester, "--gpumem-refresh").assert_outcomes(passed=1)
    assert any(s["where"] == "test_job.py:7" and s["mib"] == 160.0 for s in sites()[0])


def test_in_ci_a_baseline_recorded_on_another_cpu_model_is_compared_and_passes(pytester, job, monkeypatch,
                                                                               launch_tag):
    """A team records on a workstation and gates on a CI runner of another CPU model: the host figure
    (live allocations) compares across models of one architecture, so CI compares and passes; a real
    growth still fails there, naming the other CPU model first."""
    job.write_text("64")
    run(pytester, "--gpumem-refresh").assert_outcomes(passed=1)
    stored = pytester.path / "baselines" / "test_job.py.json"
    doc = json.loads(stored.read_text())
    (_, sizes), = doc["tests"]["test_job"].items()
    for entry in sizes.values():
        entry["provenance"]["cpu_model"] = "AMD EPYC 7763 64-Core Processor"
    stored.write_text(json.dumps(doc, indent=2))
    monkeypatch.setenv("CI", "true")
    same = run(pytester, "--gpumem-report=report.json")
    same.assert_outcomes(passed=1)
    record = json.loads((pytester.path / "report.json").read_text())["tests"][0]
    assert record["sizes"][0]["baseline_mib"] is not None  # compared, not "no baseline"
    job.write_text("160")
    grown = run(pytester)
    grown.assert_outcomes(failed=1)
    lines = grown.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert lines[headline + 1].startswith(
        "  changed since the baseline: cpu_model: AMD EPYC 7763 64-Core Processor -> ")


def test_xfail_tests_store_their_baselines_and_are_checked_against_them(pytester, monkeypatch, tmp_path,
                                                                      launch_tag):
    """What docs/writing-tests.md says of xfail: a refresh stores the baseline, a later run compares against it
    (the check is in the record), and a regression past it is part of the expected failure."""
    extra = tmp_path / "extra"
    extra.write_text("0")
    monkeypatch.setenv("EXTRA_FILE", str(extra))
    pytester.makepyfile(test_known='''
import os
import pytest

@pytest.mark.xfail(strict=True, reason="a known inflation")
@pytest.mark.gpumem(nproc=1, max_mib=1, tolerance="10%")
def test_known():
    buf = bytearray(int(open(os.environ["EXTRA_FILE"]).read()) * 1024 * 1024)
''')
    report = tmp_path / "report.json"
    run(pytester, "--gpumem-refresh").assert_outcomes(xfailed=1)
    stored = json.loads((pytester.path / "baselines" / "test_known.py.json").read_text())
    assert "test_known" in stored["tests"], "an xfail test's baseline is stored"

    same = run(pytester, f"--gpumem-report={report}")
    same.assert_outcomes(xfailed=1)
    (record,) = json.loads(report.read_text())["tests"]
    checks = {c["kind"]: c["ok"] for c in record["sizes"][0]["checks"]}
    assert (record["status"], record["cause"]) == ("xfailed", "limit")
    assert checks == {"max_mib": False, "baseline": True} and record["sizes"][0]["baseline_mib"] > 0

    extra.write_text("100")  # grows past the baseline: still the expected failure, now on both limits
    grown = run(pytester, f"--gpumem-report={report}")
    grown.assert_outcomes(xfailed=1)
    (record,) = json.loads(report.read_text())["tests"]
    assert {c["kind"]: c["ok"] for c in record["sizes"][0]["checks"]} == {"max_mib": False, "baseline": False}
