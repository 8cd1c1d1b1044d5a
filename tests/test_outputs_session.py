"""Every CI output from one real session, also under xdist: one report covering every worker."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.slow
# Imported once here: pytester forgets modules imported during a test, and numpy cannot load twice.
matplotlib = pytest.importorskip("matplotlib")

SUITE = '''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.5)
@pytest.mark.parametrize("i", range(3))
def test_ok(i):
    pass

@pytest.mark.gpumem(nproc=2, max_mib=20)
def test_over_cap():
    buf = bytearray(100 * 1024 * 1024)
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["no-xdist", "xdist-2"])
def test_report_junit_markdown_plots_and_benchmark(pytester, launch_tag, monkeypatch, workers):
    if workers:
        pytest.importorskip("xdist")
    summary = pytester.path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("COLUMNS", "200")  # pytest cuts its short summary at the terminal's width
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(  # matplotlib/numpy cannot be imported twice in one process
        "--gpumem", "-p", "no:cacheprovider", *workers,
        "--gpumem-report=out/report.json", "--gpumem-markdown=out/summary.md", "--gpumem-plots=out/plots",
        "--gpumem-benchmark-json=out/bench.json", "--junitxml=out/junit.xml",
    )
    result.assert_outcomes(passed=3, failed=1)
    # pytest's one-line summary carries the numbers, not only that a limit broke
    result.stdout.fnmatch_lines(["FAILED test_suite.py::test_over_cap - gpumem: *.* MiB > max_mib 20.0 MiB "
                                 "(rank 0, nproc=2)"])
    out = pytester.path / "out"

    report = json.loads((out / "report.json").read_text())
    assert [t["test"] for t in report["tests"]] == [
        "test_suite.py::test_ok[0]", "test_suite.py::test_ok[1]", "test_suite.py::test_ok[2]",
        "test_suite.py::test_over_cap"]
    over = report["tests"][3]
    assert over["status"] == "failed" and over["cause"] == "limit" and over["sizes"][0]["gated_mib"] > 100
    assert set(over["sizes"][0]["ranks"]) == {"0", "1"} and over["sizes"][0]["timeline"]

    cases = {c.get("name"): c for c in ET.parse(out / "junit.xml").getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_over_cap"].iter("property")}
    assert props["gpumem_nproc2_gated_mib"] and props["gpumem_device"] == "cpu"
    assert "gpumem" not in props, "the whole record stays out of junit.xml"

    markdown = (out / "summary.md").read_text()
    lines = markdown.splitlines()
    first_row = next(line for line in lines if line.startswith("| `"))
    assert "test_over_cap" in first_row, "regressions come first"
    assert summary.read_text().strip() == markdown.strip()

    pngs = sorted((out / "plots").glob("*.png"))
    assert len(pngs) == 4 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    result.stdout.fnmatch_lines(["gpumem: 4 plots written to out/plots"])  # where to look, as the user wrote it
    assert result.stdout.str().count("plots written to") == 1

    bench = json.loads((out / "bench.json").read_text())
    assert {b["unit"] for b in bench} == {"MiB"} and len(bench) == 7  # 3 x 2 sizes + 1

    assert result.stdout.str().count("gpumem: peak memory per rank") == 1
