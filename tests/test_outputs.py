"""CI gate outputs: Markdown summary, benchmark JSON, JUnit properties, plots, ``gpumem diff``.

Fast: records are built through the record's own constructors, plus one real JSON report (torch
DDP on CPU, a healthy test and an inflating one) captured with
``pytest --gpumem --gpumem-report=tests/data/record_torch_ddp.json examples/test_torch_ddp.py``
(re-recorded when the schema changes: no older schema is read), its curves thinned to every 4th
point, each rank's peak kept.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem import cli
from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging import report_diff
from pytest_gpumem.judging.record import SizeRecord, TestRecord
from pytest_gpumem.judging.record_reader import load_report
from pytest_gpumem.judging.verdict import Check
from pytest_gpumem.presentation import outputs, plots
from pytest_gpumem.results.size import FloorResult, SizeResult
from pytest_gpumem.sampling import Peak
from pytest_gpumem.sampling.sites import Site

REAL = Path(__file__).parent / "data" / "record_torch_ddp.json"
HEALTHY = "examples/test_torch_ddp.py::test_torch_ddp"
INFLATED = "examples/test_torch_ddp.py::test_torch_ddp_inflated"


def size(nproc: int, gated: float | None, baseline: float | None = None, *, ratio: float | None = None,
         failed: bool = False, device: str = "gpu", rank: int = 0, largest: bool = False, reused: bool = False,
         method: str = "per-pid sampled") -> SizeRecord:
    check = Check("max_ratio", nproc, f"rank {rank}", device, gated, 1000.0, not failed, "ratio limit {limit} MiB")
    measured = SizeResult(nproc, device, {r: Peak(gated, method) for r in range(nproc)}, duration_s=1.0,
                          reused=reused, timeline=((0.0, {0: 10.0}), (0.5, {0: gated or 0.0})))
    return SizeRecord(measured, gated_rank=rank, gated_label=f"rank {rank}" + (" (largest)" if largest else ""),
                      gated_mib=gated, checks=(check,), ratio=ratio, baseline_mib=baseline, others_max_mib=gated)


def measured(size: SizeRecord, **changes: Any) -> SizeRecord:
    """``size`` with its measurement changed (the record's judged fields as they were)."""
    return dataclasses.replace(size, measured=dataclasses.replace(size.measured, **changes))


def rec(test: str, status: str, *sizes: SizeRecord, messages: list[str] | None = None,
        tolerance: str = "max(5%, 32MiB)", rank: int | str = 0, max_mib: float | None = None) -> TestRecord:
    """``status`` as pytest says it, a failure with its cause: ``failed/limit``, ``xfailed/limit``, ``failed/crash``."""
    status, _, cause = status.partition("/")
    spec = parse_marker((), {"nproc": [s.nproc for s in sizes] or [2], "max_mib": max_mib, "max_ratio": 1.2,
                             "allow_mib": 16.0, "rank": rank, "tolerance": tolerance}, Defaults())
    return TestRecord(test=test, status=status, spec=spec,
                      sizes=sizes, messages=tuple(messages or ()), cause=cause or None)


@pytest.fixture(scope="module")
def real() -> list[TestRecord]:
    return load_report(REAL)


def mixed() -> list[TestRecord]:
    return [
        rec("t/a.py::test_pass", "passed", size(1, 500.0, 500.0), size(2, 530.0, 500.0, ratio=1.06)),
        rec("t/b.py::test_fail", "failed/limit", size(1, 1000.0, 1000.0),
            size(8, 2650.0, 1100.0, ratio=2.65, failed=True),
            messages=["rank 0 at nproc=8 (gpu): peak 2650.0 MiB > 1.20 x 1000.0 MiB\nsecond line"]),
        rec("t/c.py::test_xfail", "xfailed/limit", size(2, 700.0, ratio=1.4, failed=True), messages=["expected"]),
        rec("t/a.py::test_error", "failed/crash"),
        rec("t/e.py::test_skip", "skipped"),
        rec("t/f.py::test_xpass", "xpassed", size(2, 300.0, 300.0)),
    ]


# ---------------------------------------------------------------------------------------------- Markdown


def test_markdown_headline_counts_failures_first_in_pytests_words():
    text = outputs.markdown(mixed())
    assert text.splitlines()[0] == ("❌ **pytest-gpumem**: 2 failed (1 limit, 1 crash), 1 xpassed, 1 xfailed, "
                                    "1 passed, 1 skipped")
    assert outputs.markdown([rec("x::ok", "passed", size(1, 1.0))]).startswith("✅ **pytest-gpumem**: 1 passed")
    assert "no gpumem test ran" in outputs.markdown([])


def test_markdown_rows_regressions_then_xfail_xpass_then_the_rest():
    rows = [line for line in outputs.markdown(mixed()).splitlines() if line.startswith("| `")]
    tests = [row.split("`")[1] for row in rows]
    assert tests == ["t/a.py::test_error", "t/b.py::test_fail", "t/b.py::test_fail",
                     "t/c.py::test_xfail", "t/f.py::test_xpass",
                     "t/a.py::test_pass", "t/a.py::test_pass", "t/e.py::test_skip"]
    # A size that passed inside a failing test says "ok"; the failing size says failed, and on what.
    assert rows[1].endswith("| ok |") and rows[2].endswith("| ❌ failed (limit) |")
    assert rows[0].endswith("| ❌ failed (crash) |") and rows[3].endswith("| xfailed (limit) |")
    assert rows[4].endswith("| ⚠️ xpassed |") and rows[7].endswith("| skipped |")


def test_markdown_delta_against_baseline_and_ratio():
    text = outputs.markdown(mixed())
    row = next(line for line in text.splitlines() if "test_pass` | 2 |" in line)
    assert "| 530.0 (rank 0, gpu) | 500.0 | +30.0 MiB (+6.0%) | 1.06x | ✅ passed |" in row
    row = next(line for line in text.splitlines() if "test_fail` | 8 |" in line)
    assert "+1550.0 MiB (+140.9%)" in row and "2.65x" in row
    assert outputs.format_delta(report_diff.delta(480.0, 500.0)) == "-20.0 MiB (-4.0%)"
    assert outputs.format_delta((-0.004, -0.001)) == "+0.0 MiB (+0.0%)"  # unchanged, not a "-0.0" drop
    assert report_diff.delta(10.0, 0.0) == (10.0, None)  # no percentage of zero
    assert report_diff.delta(10.0, None) is None


def test_markdown_lists_messages_under_their_cause_with_continuation_lines_indented():
    text = outputs.markdown(mixed())
    limits, crashes = text.index("**Limits exceeded**"), text.index("**Crashed or hung**")
    assert limits > text.index("| `t/e.py::test_skip`")
    failed = text.index("- **failed** `t/b.py::test_fail`: rank 0 at nproc=8 (gpu): peak 2650.0 MiB > 1.20 x "
                        "1000.0 MiB\n  second line")
    assert limits < failed < crashes and limits < text.index("- **xfailed** `t/c.py::test_xfail`: expected") < crashes
    assert crashes < text.index("- **failed** `t/a.py::test_error`: no measurement")


def test_markdown_escapes_pipes_in_parametrized_ids():
    text = outputs.markdown([rec("t.py::test_p[a|b]", "passed", size(1, 1.0))])
    row = next(line for line in text.splitlines() if line.startswith("| `"))
    assert "`t.py::test_p[a\\|b]`" in row
    assert row.count(" | ") == 6  # seven cells, the id's pipe does not split one


def test_markdown_stays_under_the_comment_limit_dropping_passing_rows_first():
    many = [rec(f"t/big.py::test_{i:04d}", "passed", size(1, 100.0, 100.0)) for i in range(500)]
    records = many + [rec("t/z.py::test_regressed", "failed/limit", size(1, 900.0, 100.0, failed=True),
                          messages=["grew"])]
    text = outputs.markdown(records, max_chars=5000)
    assert len(text) <= 5000
    assert "t/z.py::test_regressed" in text.split("**Limits exceeded**")[0]  # its row survived
    assert "more rows: see the JSON report" in text


def test_markdown_of_the_real_report(real):
    text = outputs.markdown(real)
    assert text.startswith("✅ **pytest-gpumem**: 1 xfailed, 1 passed")
    assert text.index(INFLATED) < text.index(HEALTHY + "`")
    assert "(rank 0, cpu)" in text and f"{real[1].sizes[1].ratio:.2f}x" in text
    assert f"- **xfailed** `{INFLATED}`: rank 0 at nproc=2 (cpu)" in text


# ---------------------------------------------------------------------------------------------- benchmark


def test_benchmark_json_is_custom_smaller_is_better(real):
    entries = outputs.benchmark_json(real)
    assert [e["name"] for e in entries] == [f"{HEALTHY} nproc=1 rank 0", f"{HEALTHY} nproc=2 rank 0",
                                            f"{INFLATED} nproc=1 rank 0", f"{INFLATED} nproc=2 rank 0"]
    for entry in entries:
        assert set(entry) == {"name", "unit", "value", "extra"}
        assert entry["unit"] == "MiB" and isinstance(entry["value"], float) and entry["value"] > 0
        assert entry["extra"].startswith("cpu, live allocations (memray), rank 0")
    assert f"ratio {real[1].sizes[1].ratio:.2f}x to nproc=1" in entries[3]["extra"]
    json.dumps(entries)  # what the action reads


def test_benchmark_json_names_stay_stable_and_skip_unmeasured():
    records = [
        rec("t::all", "passed", size(2, 900.0, rank=1, largest=True), rank="all"),
        rec("t::crashed", "failed/crash", size(2, 12.0)),
        rec("t::half", "failed/limit", size(1, None), size(2, 50.0)),
    ]
    entries = outputs.benchmark_json(records)
    assert [e["name"] for e in entries] == ["t::all nproc=2 rank all", "t::half nproc=2 rank 0"]
    assert "rank 1 (largest)" in entries[0]["extra"]


# ---------------------------------------------------------------------------------------------- JUnit


def test_junit_properties_per_size():
    props = outputs.junit_properties(mixed()[1])
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in props)
    got = dict(props)
    assert got["gpumem_status"] == "failed" and got["gpumem_cause"] == "limit"
    assert got["gpumem_nproc"] == "1,8"
    assert got["gpumem_device"] == "gpu"
    assert got["gpumem_method"] == "per-pid sampled"
    assert got["gpumem_nproc8_gated_mib"] == "2650.00"
    assert got["gpumem_nproc8_baseline_mib"] == "1100.00"
    assert got["gpumem_nproc8_delta_mib"] == "+1550.00"
    assert got["gpumem_nproc8_delta_pct"] == "+140.91"
    assert got["gpumem_nproc8_ratio"] == "2.650"
    assert "gpumem_nproc1_ratio" not in got


def test_junit_properties_of_an_unmeasured_test():
    assert dict(outputs.junit_properties(rec("t::e", "failed/crash"))) == {
        "gpumem_status": "failed", "gpumem_cause": "crash", "gpumem_nproc": "2", "gpumem_device": "-",
        "gpumem_method": "-", "gpumem_rank": "0"}


def test_junit_properties_land_in_junit_xml(pytester, real):
    """What the plugin will do: user_properties pairs become <property> elements of --junitxml."""
    pytester.makepyfile(f'''
def test_x(record_property):
    for name, value in {outputs.junit_properties(real[0])!r}:
        record_property(name, value)
''')
    pytester.runpytest("-p", "no:cacheprovider", "--junitxml=junit.xml").assert_outcomes(passed=1)
    root = ET.parse(pytester.path / "junit.xml").getroot()
    found = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert found["gpumem_status"] == "passed" and "gpumem_cause" not in found
    assert found["gpumem_nproc2_gated_mib"] == f"{real[0].sizes[1].gated_mib:.2f}"


# ---------------------------------------------------------------------------------------------- plots


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_per_test(real, tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_all(real, tmp_path / "plots")
    assert [p.name for p in paths] == [plots.plot_filename(r.test) for r in real]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_copes_with_missing_samples_and_limits(tmp_path):
    pytest.importorskip("matplotlib")
    bare = dataclasses.replace(measured(size(2, None, device="cpu"), timeline=()), checks=())
    record = rec("t::odd[a/b|c]", "failed/crash", bare, size(4, 900.0, 800.0, ratio=None, failed=True), max_mib=850.0)
    path = tmp_path / plots.plot_filename(record.test)
    plots.plot(record, path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert "/" not in path.name and "|" not in path.name
    assert plots.plot_all([rec("t::skipped", "skipped")], tmp_path) == []  # nothing measured, no file


def test_plots_without_matplotlib_say_how_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import raises ImportError
    with pytest.raises(plots.PlotsUnavailable, match=r"plots need matplotlib: pip install 'pytest-gpumem\[plots\]'"):
        plots.plot(mixed()[0], tmp_path / "x.png")
    with pytest.raises(plots.PlotsUnavailable):
        plots.check_available()
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------- diff


def test_compare_classifies_every_size():
    old = [
        rec("t::grew", "passed", size(1, 1000.0)),
        rec("t::within", "passed", size(1, 1000.0)),
        rec("t::shrank", "passed", size(1, 1000.0)),
        rec("t::gone", "passed", size(2, 10.0)),
        rec("t::sizes", "passed", size(1, 10.0), size(2, 20.0)),
        rec("t::moved", "passed", size(1, 10.0, device="cpu")),
        rec("t::crash", "passed", size(1, 10.0)),
    ]
    new = [
        rec("t::grew", "passed", size(1, 1050.1)),   # 5% of 1000 = 50 > 32: allowance 50
        rec("t::within", "passed", size(1, 1050.0)),
        rec("t::shrank", "passed", size(1, 900.0)),
        rec("t::new", "passed", size(2, 10.0)),
        rec("t::sizes", "passed", size(1, 10.0), size(4, 40.0)),
        rec("t::moved", "passed", size(1, 500.0, device="gpu")),
        rec("t::crash", "failed/crash", size(1, None)),
    ]
    diff = report_diff.diff_reports(old, new)
    kinds = {(r.test, r.nproc): r.kind for r in diff.rows}
    assert kinds == {
        ("t::grew", 1): "regression", ("t::within", 1): "unchanged", ("t::shrank", 1): "improved",
        ("t::gone", 2): "removed", ("t::new", 2): "added", ("t::sizes", 1): "unchanged",
        ("t::sizes", 2): "removed", ("t::sizes", 4): "added", ("t::moved", 1): "device changed",
        ("t::crash", 1): "unmeasured",
    }
    assert diff.rows[0].test == "t::grew"  # regressions first
    grew = diff.regressions[0]
    assert grew.allowance_mib == pytest.approx(50.0)
    assert grew.change == pytest.approx((50.1, 5.01))
    assert diff.summary() == "1 regression, 1 unmeasured, 1 device changed, 1 improved, 2 unchanged, 2 added, 2 removed"


def test_compare_tolerance_is_the_tests_own_unless_overridden():
    old, new = ([rec("t::a", "passed", size(1, 100.0), tolerance="1%")],
                [rec("t::a", "passed", size(1, 110.0), tolerance="1%")])
    assert report_diff.diff_reports(old, new).rows[0].kind == "regression"          # 1% of 100 = 1 MiB
    assert report_diff.diff_reports(old, new, "max(5%, 32MiB)").rows[0].kind == "unchanged"  # 32 MiB wins
    assert report_diff.diff_reports(old, new, "5%").rows[0].kind == "regression"


def write_report(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"schema": json.loads(REAL.read_text())["schema"], "tests": records}))
    return path


@pytest.fixture
def reports(tmp_path) -> dict[str, Path]:
    """The real report, the same with the healthy test 30% bigger at nproc=2, and broken ones (as
    JSON: what a file on disk holds)."""
    inflated = json.loads(REAL.read_text())["tests"]
    inflated[0]["sizes"][1]["gated_mib"] *= 1.3
    bad_field = json.loads(REAL.read_text())["tests"]
    bad_field[1]["sizes"][0]["gated_mib"] = "lots"
    (tmp_path / "not.json").write_text("{ not json")
    (tmp_path / "schema.json").write_text(json.dumps({"schema": 7, "tests": []}))
    return {
        "real": REAL,
        "inflated": write_report(tmp_path / "inflated.json", inflated),
        "bad_field": write_report(tmp_path / "bad_field.json", bad_field),
        "not_json": tmp_path / "not.json",
        "schema": tmp_path / "schema.json",
        "missing": tmp_path / "missing.json",
    }


def test_diff_cli_exit_codes(reports, capsys, tmp_path):
    assert cli.main(["diff", str(reports["real"]), str(reports["real"])]) == 0
    out = capsys.readouterr().out
    assert "gpumem diff: 4 unchanged" in out and "(max(2%, 16MiB))" in out  # the examples' own tolerance

    md = tmp_path / "out" / "diff.md"
    assert cli.main(["diff", str(reports["real"]), str(reports["inflated"]), "--markdown", str(md),
                     "--labels", "main", "PR"]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[2]
    assert first.startswith(HEALTHY) and first.endswith("REGRESSION") and "(+30.0%)" in first
    assert md.read_text().startswith("❌ **gpumem diff** (main → PR): 1 regression, 3 unchanged")
    # The other way round it is an improvement: no regression.
    assert cli.main(["diff", str(reports["inflated"]), str(reports["real"])]) == 0
    # A tolerance wide enough to absorb +30% passes.
    assert cli.main(["diff", str(reports["real"]), str(reports["inflated"]), "--tolerance", "35%"]) == 0


@pytest.mark.parametrize("case, message", [
    ("missing", "missing.json: cannot read: No such file or directory"),
    ("not_json", "not.json: not JSON: "),
    ("schema", "schema.json: schema: expected 4 (a pytest --gpumem-report file of this pytest-gpumem), got 7"),
    ("bad_field", "bad_field.json: tests[1].sizes[0].gated_mib: expected a finite number or null, got 'lots'"),
])
def test_diff_cli_bad_input_names_the_file(reports, capsys, case, message):
    assert cli.main(["diff", str(reports["real"]), str(reports[case])]) == 2
    assert message in capsys.readouterr().err


def test_diff_cli_bad_tolerance(reports, capsys):
    assert cli.main(["diff", str(reports["real"]), str(reports["real"]), "--tolerance", "lots"]) == 2
    assert "--tolerance='lots' is not accepted" in capsys.readouterr().err


def test_diff_as_a_command(reports):
    def run(*args: Path | str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "diff", *map(str, args)],
                              capture_output=True, text=True, timeout=60)

    assert run(reports["real"], reports["real"]).returncode == 0
    regressed = run(reports["real"], reports["inflated"])
    assert regressed.returncode == 1 and "1 regression" in regressed.stdout
    broken = run(reports["schema"], reports["real"])
    assert broken.returncode == 2 and "schema.json: schema: expected 4" in broken.stderr


# ---------------------------------------------------------------------------------------------- peak sites


def _site(where: str, mib: float, function: str = "train_step") -> Site:
    return Site(where, function, "", mib)


def test_a_failure_and_a_diff_name_the_sites_that_grew_top_3_in_markdown():
    from dataclasses import replace

    from pytest_gpumem.judging.record import SiteChange

    old_size = measured(size(2, 300.0), sites={0: (_site("examples/a.py:40", 128.0),)})
    new_size = measured(size(2, 700.0), sites={0: (_site("examples/a.py:40", 128.0), _site("examples/a.py:57", 256.0),
                                                  _site("examples/a.py:60", 100.0), _site("examples/a.py:61", 20.0),
                                                  _site("examples/a.py:62", 10.0))})
    grown = tuple(SiteChange(f"examples/a.py:{line} train_step", 0.0, mib) for line, mib in
                  ((57, 256.0), (60, 100.0), (61, 20.0), (62, 10.0)))
    failing = replace(rec("t/a.py::test_x", "failed/limit", new_size, messages=["over"]), grown_sites=grown,
                      grown_against="nproc=1")
    text = outputs.markdown([failing])
    assert ("  - peak sites that grew since nproc=1: `+256.0 MiB  examples/a.py:57 train_step  (new)`, "
            "`+100.0 MiB  examples/a.py:60 train_step  (new)`, `+20.0 MiB  examples/a.py:61 train_step  (new)`") in text
    assert "a.py:62" not in text
    diff = report_diff.diff_reports([rec("t/a.py::test_x", "passed", old_size)], [failing])
    growth = diff.regressions[0].growth
    assert growth is not None and growth.lines()[:2] == ["+256.0 MiB  examples/a.py:57 train_step  (new)",
                                                          "+100.0 MiB  examples/a.py:60 train_step  (new)"]
    table = outputs.diff_table(diff)
    assert "t/a.py::test_x nproc=2: peak sites that grew" in table
    assert "**Peak sites that grew**" in outputs.diff_markdown(diff)


def test_a_diff_explains_as_the_failure_does_and_its_markdown_puts_a_caller_chain_on_one_line():
    """One explanation everywhere (issue 67, item 4): the diff's text lists the lines the failure
    lists, and its Markdown the lines the failure's Markdown does, each site's callers on its line."""
    from dataclasses import replace

    from pytest_gpumem.judging.growth import site_growth

    chain = ("examples/a.py:80 step", "tests/test_a.py:9 test_x")
    held = (("examples/a.py:70 (list 'kept', append)", 256.0, 4),)
    old = (_site("examples/a.py:40", 128.0),)
    new = (*old, replace(_site("examples/a.py:57", 256.0), callers=chain, held_by=held))
    growth = site_growth(old, new, "nproc=1")
    failing = replace(rec("t/a.py::test_x", "failed/limit", measured(size(2, 700.0), sites={0: new}),
                          messages=["over"]), grown_sites=growth.grown, grown_against="nproc=1")
    diff = report_diff.diff_reports([rec("t/a.py::test_x", "passed", measured(size(2, 300.0), sites={0: old}))],
                                    [failing])
    one_line = ("+256.0 MiB  kept alive by examples/a.py:70 (list 'kept', append; 4 tensors), allocated at "
                "examples/a.py:57 train_step  (new), called from examples/a.py:80 step ← tests/test_a.py:9 test_x")
    assert f"`{one_line}`" in outputs.markdown([failing])
    assert f"- `t/a.py::test_x` nproc=2: `{one_line}`" in outputs.diff_markdown(diff)
    table = outputs.diff_table(diff)
    assert "\n".join(f"  {line}" for line in growth.lines()) in "\n".join(table)


def test_the_markdown_leads_each_failure_with_what_changed_since_the_baseline_and_the_top_grown_site():
    """Issue 55: the declared config change, the whole answer, was missing from the pull request's summary."""
    from pytest_gpumem.judging.record import SiteChange

    failing = dataclasses.replace(
        rec("t/a.py::test_x", "failed/limit", size(8, 700.0, 400.0), messages=["worst: at nproc=8", "also: at 1"]),
        changed_since_baseline=("config.activation_checkpoint: True -> False",),
        grown_sites=(SiteChange("examples/a.py:57 train_step", 0.0, 256.0),), grown_against="the baseline")
    lines = outputs.markdown([failing]).splitlines()
    first = lines.index("- **failed** `t/a.py::test_x`: worst: at nproc=8")
    assert lines[first + 1:first + 4] == [
        "  - changed since the baseline: config.activation_checkpoint: True -> False",
        "  - peak sites that grew since the baseline: `+256.0 MiB  examples/a.py:57 train_step  (new)`",
        "- **failed** `t/a.py::test_x`: also: at 1"]


def test_the_allocator_figure_is_in_every_output():
    """GPU sizes carry torch's allocator figure beside the device figure: the Markdown cell, JUnit
    properties, a benchmark series of its own, and a gpumem diff row judged at its own tolerance."""
    from dataclasses import replace

    base = replace(size(1, 14370.0), allocated_mib=7765.06, allocated_baseline_mib=7765.06)
    grown = replace(size(1, 13982.0), allocated_mib=7905.0)  # the cache shrank, the tensors grew 1.8%
    old, new = rec("t/f.py::test_fsdp", "passed", base), rec("t/f.py::test_fsdp", "failed/limit", grown)
    assert "14370.0 (rank 0, gpu); allocated 7765.1" in outputs.markdown([old])
    props = dict(outputs.junit_properties(old))
    assert props["gpumem_nproc1_allocated_mib"] == "7765.06" and props["gpumem_nproc1_allocated_baseline_mib"]
    series = {b["name"]: b["value"] for b in outputs.benchmark_json([old])}
    assert series["t/f.py::test_fsdp nproc=1 rank 0 allocated"] == 7765.06
    diff = report_diff.diff_reports([old], [new])
    assert [(r.figure, r.kind) for r in diff.rows] == [("allocated", "regression"), ("", "unchanged")]
    assert any("1 allocated" in line and "REGRESSION" in line for line in outputs.diff_table(diff))


# ---------------------------------------------------------------------------------------------- the floor


def test_the_floor_is_shown_as_floor_plus_job_wherever_it_was_measured():
    """CPU or GPU alike (--gpumem-floor): the table and the Markdown split the gated figure; without
    a floor neither grows a column."""
    from pytest_gpumem.presentation.report import table

    plain = size(2, 530.0, device="cpu")
    floored = dataclasses.replace(plain, measured=dataclasses.replace(
        plain.measured, floor=FloorResult("torch", {0: 180.5, 1: 181.0})))
    records = [rec("t::floored", "passed", floored), rec("t::plain", "passed", size(1, 100.0))]
    lines = table(records)
    assert "floor + job MiB" in lines[0]
    assert "180.5 + 349.5" in next(line for line in lines if line.startswith("t::floored"))
    assert any(line.startswith("floor: what an empty job") for line in lines)
    text = outputs.markdown(records)
    assert "| floor + job MiB |" in text and "| 180.5 + 349.5 |" in text
    assert "floor + job" not in "\n".join(table(records[1:])) + outputs.markdown(records[1:])


def test_terminal_lists_crashes_and_limits_under_their_own_headings_in_pytests_words():
    from pytest_gpumem.presentation.report import message_sections, table

    assert message_sections(mixed()) == [  # the crashed test of mixed() has no message: no heading of its own
        ("limits exceeded", ["failed t/b.py::test_fail: rank 0 at nproc=8 (gpu): peak 2650.0 MiB > 1.20 x 1000.0 "
                             "MiB\nsecond line", "xfailed t/c.py::test_xfail: expected"])]
    crashed = rec("t/a.py::test_error", "failed/crash", size(2, 12.0), messages=["rank 1 of 2 failed: RuntimeError"])
    assert message_sections([crashed]) == [("ranks that failed", ["failed t/a.py::test_error: rank 1 of 2 failed: "
                                                                  "RuntimeError"])]
    row = next(line for line in table([crashed]) if line.startswith("t/a.py::test_error"))
    assert row.endswith("failed (crash)") and "ERROR" not in row


def test_a_rank_shown_by_its_resident_memory_is_labelled_so_in_the_table():
    """Rank 1 raised, rank 0 was stopped before it could report its live allocations: the table must
    not put rank 0's resident high-water mark beside rank 1's live allocations unlabelled."""
    from pytest_gpumem.presentation.report import table

    stopped = dataclasses.replace(measured(size(2, 78.8, device="cpu", method="live allocations (memray)"),
                                           peaks={0: Peak(78.8, "high-water mark (no allocation peak reported)"),
                                                  1: Peak(13.2, "live allocations (memray)")}), others_max_mib=13.2)
    lines = table([rec("t::raises", "failed/crash", stopped)])
    row = next(line for line in lines if line.startswith("t::raises"))
    assert "78.8 (rank 0, VmHWM)" in row and "13.2 " in row and "13.2 VmHWM" not in row
    assert any(line.startswith("VmHWM: a rank that ended without reporting") for line in lines)
    swapped = {0: Peak(13.0, "live allocations (memray)"),
               1: Peak(78.8, "high-water mark (no allocation peak reported)")}
    bystander = dataclasses.replace(measured(stopped, peaks=swapped), gated_mib=13.0, others_max_mib=78.8)
    row = next(line for line in table([rec("t::raises", "failed/crash", bystander)]) if line.startswith("t::raises"))
    assert "13.0 (rank 0)" in row and "78.8 VmHWM" in row
    ranks = {0: Peak(13.0, "live allocations (memray)"),
             1: Peak(5.0, "high-water mark (no allocation peak reported)"),
             2: Peak(13.2, "live allocations (memray)")}
    # the resident rank is not the one "others max" shows
    smaller = dataclasses.replace(measured(bystander, world_size=3, peaks=ranks), others_max_mib=13.2)
    row = next(line for line in table([rec("t::raises", "failed/crash", smaller)]) if line.startswith("t::raises"))
    assert "13.2 " in row and "VmHWM" not in row
    healthy = table([rec("t::ok", "passed", size(2, 13.0, device="cpu", method="live allocations (memray)"))])
    assert "VmHWM" not in "\n".join(healthy)


def test_a_refresh_that_stores_a_failing_figure_says_so():
    """`gpumem refresh` stores what it measured even when the run fails a limit (the contract); the
    reviewer of the baseline diff must not take that figure for a healthy one."""
    from pytest_gpumem.judging.record import BaselineChange
    from pytest_gpumem.presentation.report import refresh_lines

    failing = dataclasses.replace(rec("t::inflated", "failed/limit", size(2, 613.2)),
                                  baseline_changes=(BaselineChange(2, None, 613.2),))
    healthy = dataclasses.replace(rec("t::ok", "passed", size(2, 293.2)),
                                  baseline_changes=(BaselineChange(2, 290.0, 293.2),))
    assert refresh_lines([failing, healthy]) == [
        "t::inflated nproc=2: (new) -> 613.2 MiB (this run fails its limits: the baseline now records that; "
        "review before committing)",
        "t::ok nproc=2: 290.0 -> 293.2 MiB (+1.1%)"]


def test_a_failure_just_over_its_baseline_reads_apart_in_the_table_and_the_markdown():
    """The failure text prints 505.44 > 505.38: the session's table and the Markdown print the same
    figures, not 505.4 and 505.4."""
    from pytest_gpumem.config.spec import Defaults, Tolerance, parse_marker
    from pytest_gpumem.judging.assemble import build
    from pytest_gpumem.judging.verdict import BaselineRef, judge
    from pytest_gpumem.presentation.report import table
    from pytest_gpumem.results.size import SizeResult
    from pytest_gpumem.sampling import Peak

    class Run:
        test_id = "t.py::test_lm"
        spec = parse_marker((), {"nproc": 2}, Defaults())
        results = [SizeResult(2, "cpu", {0: Peak(505.44, "live allocations (memray)"),
                                         1: Peak(505.3, "live allocations (memray)")})]
        provenance: dict = {}

    verdict = judge(Run.spec, Run.results, {2: BaselineRef(505.38, Tolerance(mib=0.0))})
    record = build(Run(), verdict, "failed", cause="limit", baselines={2: 505.38})
    assert record.digits == 2 and record.messages[0].startswith("rank 0 at nproc=2 (cpu): peak 505.44 MiB > ")
    row = next(line for line in table([record]) if line.startswith("t.py::test_lm"))
    assert "505.44 (rank 0)" in row and "505.30" in row and "505.38" in row
    markdown = outputs.markdown([record])
    assert "505.44 (rank 0, cpu)" in markdown and "| 505.38 | +0.06 MiB" in markdown
