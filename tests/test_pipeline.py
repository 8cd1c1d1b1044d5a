"""Pipeline stages in a simulated world: torch.distributed.pipelining (PipelineStage with its shapes
declared, Schedule1F1B) at nproc=2 on real gloo ranks and simulated, every rank measured
(``rank="all"``). Each rank's host figure agrees, the largest rank is the same one (found, not
assumed), and a job keeping every microbatch's output fails a limit the healthy one passes.

The wider table (GPipe, 2/4/8 ranks, real against simulated per rank) is
benchmarks/results/parallelism_validation.txt; one H200 is tests/test_gpu.py -k pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import TORCH_PP

# Imported before pytester's first snapshot of sys.modules (see test_reference.py).
pytest.importorskip("torch")

MARGIN_MIB = 1.0  # real - simulated, per rank: 0.2 MiB at 2 and 4 (parallelism_validation.txt)
GLOO_TRANSIENT_MIB = 4.0  # gloo's own buffers, which a simulated rank has none of


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

    # The kept outputs: 32 microbatches x 4 layers x 0.25 MiB on the stage; half of it above the healthy figure.
    limit = f", max_mib={max(real['gated_mib'], simulated['gated_mib']) + 16:.2f}"
    result, sizes = run(pytester, marked("healthy", 'pp_job("1f1b")', "on", limit)
                        + marked("keeping_outputs", 'pp_job("1f1b", keep_outputs=True)', "on", limit),
                        tmp_path / "second.json")
    result.assert_outcomes(passed=1, failed=1)
    assert sizes["test_keeping_outputs"]["status"] == "failed"
    result.stdout.fnmatch_lines(["*gpumem: * MiB > * MiB (rank * (largest), nproc=2*"])


@pytest.mark.torch
@pytest.mark.slow
def test_a_stage_that_does_not_declare_its_shapes_stops_the_simulated_rank_saying_what_to_declare(pytester,
                                                                                                 launch_tag):
    pytester.makepyfile(test_pp=TORCH_PP + marked("undeclared", 'pp_job("1f1b", declared=False)', "on"))
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-missing-baseline", "ignore")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*give every PipelineStage input_args= and output_args= (requiring grad where "
                                 "one flows back: every output, and every input but the first stage's)*"])
