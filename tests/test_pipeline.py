"""Pipeline stages in a simulated world: torch.distributed.pipelining (PipelineStage with its shapes
declared, Schedule1F1B) at nproc=2 on real gloo ranks and simulated, every rank measured
(``rank="all"``). Each rank's host figure agrees, the largest rank is the same one (found, not
assumed), and a job keeping every microbatch's output fails the baseline the healthy one passes,
each rank held to its own figure, the failure leading with the line that allocates them.

The wider table (GPipe, 2/4/8 ranks, real against simulated per rank) is
benchmarks/results/parallelism_validation.txt; one H200 is tests/test_gpu.py -k pipeline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jobs import TORCH_PP

from conftest import GLOO_TRANSIENT_MIB  # gloo's own buffers, which a simulated rank has none of

# Imported before pytester's first snapshot of sys.modules (see test_reference.py).
pytest.importorskip("torch")

MARGIN_MIB = 1.0  # real - simulated, per rank: 0.2 MiB at 2 and 4 (parallelism_validation.txt)


def run(pytester: pytest.Pytester, tests: str, report: Path) -> tuple[pytest.RunResult, dict[str, dict]]:
    pytester.makepyfile(test_pp=TORCH_PP + tests)
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore",
                                f"--gpumem-report={report}")
    sizes = {t["test"].split("::")[1]: {**t["sizes"][0], "status": t["status"]}
             for t in json.loads(report.read_text())["tests"]}
    for name, size in sizes.items():
        print(name, size["gated_label"], {r: round(v, 2) for r, v in size["host_ranks"].items()})
    return result, sizes


def marked(name: str, call: str, simulate: str, limit: str = "") -> str:
    return f'''
@pytest.mark.gpumem(nproc=2, device="cpu", rank="all", simulate="{simulate}"{limit})
def test_{name}():
    {call}
'''


@pytest.mark.torch
@pytest.mark.slow
def test_pipeline_stages_simulated_read_each_ranks_real_figure_and_kept_microbatches_fail(pytester, launch_tag,
                                                                                         tmp_path):
    result, sizes = run(pytester, marked("real", 'pp_job("1f1b")', "off") + marked("simulated", 'pp_job("1f1b")', "on"),
                        tmp_path / "first.json")
    result.assert_outcomes(passed=2)
    real, simulated = sizes["test_real"], sizes["test_simulated"]
    assert simulated["simulated"] == [0, 1] and real["simulated"] == []
    for rank in ("0", "1"):
        gap = real["host_ranks"][rank] - simulated["host_ranks"][rank]
        assert -MARGIN_MIB <= gap <= MARGIN_MIB + GLOO_TRANSIENT_MIB, (rank, gap)
    assert real["gated_label"] == simulated["gated_label"]  # the same stage found the largest



@pytest.mark.torch
@pytest.mark.slow
def test_a_stage_keeping_every_microbatchs_output_fails_its_own_baseline_naming_the_line(pytester, launch_tag,
                                                                                        monkeypatch, tmp_path):
    """The healthy 1F1B job refreshed, then its stages keep every microbatch's output (KEEP=1): each
    rank is held to its own stored figure, and the failure leads with the sites of the rank that grew
    most, against that rank's own stored sites: the line that allocates the kept outputs."""
    tests = (marked("healthy", 'pp_job("1f1b")', "on")
             + marked("stages", 'pp_job("1f1b", keep_outputs=os.environ.get("KEEP") == "1")', "on"))
    pytester.makepyfile(test_pp=TORCH_PP + tests)
    args = ("--gpumem", "-p", "no:cacheprovider")
    pytester.runpytest(*args, "--gpumem-refresh").assert_outcomes(passed=2)
    monkeypatch.setenv("KEEP", "1")
    report = tmp_path / "kept.json"
    result = pytester.runpytest(*args, f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    record = next(t for t in json.loads(report.read_text())["tests"] if t["test"].endswith("test_stages"))
    failed = {c["text"].split(" at nproc=")[0] for c in record["sizes"][0]["checks"] if not c["ok"]}
    print("failed checks:", sorted(failed), "grown:", record["grown_against"], record["grown_sites"][:1])
    assert failed == {"rank 0", "rank 1 (largest)"}  # the largest as such, every other rank at its own figure
    # The kept outputs are the layers' own: the line that allocates them (KEPT.append keeps them alive).
    kept = next(n for n, text in enumerate(TORCH_PP.lstrip("\n").splitlines(), 1) if "y = self.linear(x)" in text)
    lines = result.stdout.lines
    headline = next(i for i, line in enumerate(lines) if line.startswith("gpumem: "))
    assert re.fullmatch(r"  peak sites of rank \d at nproc=2 that grew since its baseline:", lines[headline + 1])
    site = lines[headline + 2]
    assert re.match(rf"    \+\d+\.\d MiB  test_pp\.py:{kept} forward", site), lines[headline:headline + 3]


@pytest.mark.torch
@pytest.mark.slow
def test_a_stage_that_does_not_declare_its_shapes_stops_the_simulated_rank_saying_what_to_declare(pytester,
                                                                                                 launch_tag):
    pytester.makepyfile(test_pp=TORCH_PP + marked("undeclared", 'pp_job("1f1b", declared=False)', "on"))
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*give every PipelineStage input_args= and output_args= (requiring grad where "
                                 "one flows back: every output, and every input but the first stage's)*"])
