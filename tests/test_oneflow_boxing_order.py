"""A failing nn.Graph example names its largest new conversion first (real OneFlow, 2 CPU ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("oneflow")
pytestmark = [pytest.mark.oneflow, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "test_oneflow_graph_dp.py"


def test_the_graph_example_lists_its_largest_new_conversion_first(pytester, launch_tag):
    """No baseline: compared with nproc=1. The batch (2048, 16384) float32 comes before the labels
    (2048,) int64; the LR scalar sent from rank 0 to every rank is no news against one rank."""
    pytester.makepyfile(test_graph=EXAMPLE.read_text())
    # --runxfail: the inflated example is xfail(strict) for the demo; here its failure text is the subject.
    result = pytester.runpytest("--gpumem", "--runxfail", "-p", "no:cacheprovider", "-k", "inflated")
    result.assert_outcomes(failed=1, deselected=1)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "nn.Graph boxing (SBP conversions) at nproc=2" in line)
    assert lines[start].strip() == "nn.Graph boxing (SBP conversions) at nproc=2 against nproc=1 (no audited baseline):"
    audit = [line.strip() for line in lines[start + 1:start + 4]]
    assert audit[0] == "new: S(0)->B x2 (was 0); 128.0 MiB moved", audit
    assert audit[1].startswith("128.0 MiB  ") and audit[1].split(" into ")[0].endswith("(2048, 16384) float32"), audit
    assert audit[2].startswith("16.0 KiB  ") and audit[2].split(" into ")[0].endswith("(2048,) int64"), audit
    # the LR sent from rank 0 to every rank and the gradients' P->B: what any size above 1 does (issue 57)
    section = "\n".join(lines[start:start + 8])
    assert "B->B [cpu:0 -> cpu:0-1]" not in section and "P->B" not in section, section
