"""OneFlow's new SBP conversions reach the Markdown summary and JUnit's properties."""

from __future__ import annotations

from pytest_gpumem.config.spec import Defaults, parse_marker
from pytest_gpumem.judging.record import TestRecord
from pytest_gpumem.presentation import outputs

LINES = tuple(f"S(0)->B at model.py:{n} forward: +{n}.0 MiB at nproc=2 (none at nproc=1); to_global of (8, 8) "
              "float32, x1" for n in (25, 26, 27, 28))


def test_a_failure_carries_its_top_three_conversions_into_the_summary_and_all_into_junit():
    rec = TestRecord(test="t.py::test_eager", status="failed", cause="limit",
                     spec=parse_marker((), {"nproc": [1, 2]}, Defaults()), messages=("over",), conversions=LINES)
    text = outputs.markdown([rec])
    assert f"new SBP conversions (OneFlow): `{LINES[0]}`" in text
    assert LINES[2] in text and LINES[3] not in text and "and 1 more" in text
    props = dict(outputs.junit_properties(rec))
    assert [props[f"gpumem_conversion_{i}"] for i in range(1, 5)] == list(LINES)
    bare = TestRecord(test="t.py::t", status="failed", cause="limit", spec=parse_marker((), {}, Defaults()),
                      messages=("over",))
    assert "new SBP conversions" not in outputs.markdown([bare])
