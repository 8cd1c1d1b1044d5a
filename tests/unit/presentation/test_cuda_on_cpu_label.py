"""A OneFlow job written for CUDA run on the CPU (oneflow.cuda_on_cpu): its gated host figure is labelled so
in every output, and a size without the mapping is not."""

from __future__ import annotations

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging.record import SizeRecord, TestRecord
from pytest_gpumem.oneflow.cuda_on_cpu import LABEL
from pytest_gpumem.presentation.outputs import junit_properties, markdown
from pytest_gpumem.presentation.report import table
from pytest_gpumem.results.size import SizeResult


def record(label: str) -> TestRecord:
    sizes = tuple(SizeRecord(SizeResult(n, "cpu", {}, cuda_on_cpu=label), 0, "rank 0", 100.0 * n) for n in (1, 2))
    return TestRecord("t.py::test_dp", "passed", parse_marker((), {"nproc": [1, 2]}, Defaults()), sizes=sizes)


def test_the_host_figure_of_a_cuda_job_mapped_to_the_cpu_is_labelled_in_the_table_markdown_json_and_junit():
    mapped, plain = record(LABEL), record("")
    assert sum(LABEL in line for line in table([mapped])) == 2 and not any(LABEL in line for line in table([plain]))
    assert f"**{LABEL}**" in markdown([mapped]) and LABEL not in markdown([plain])
    assert [size["cuda_on_cpu"] for size in mapped.to_json()["sizes"]] == [LABEL, LABEL]
    assert [size["cuda_on_cpu"] for size in plain.to_json()["sizes"]] == ["", ""]
    assert ("gpumem_nproc2_cuda_on_cpu", LABEL) in junit_properties(mapped)
    assert not any(key.endswith("_cuda_on_cpu") for key, _ in junit_properties(plain))
