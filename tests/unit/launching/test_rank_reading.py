"""What the parent makes of the ranks' exit reports (plain Python; the real launches that write
them are in test_host_startup.py)."""

from __future__ import annotations

from pytest_gpumem.launching.rank_reading import MANY_SETUP_IMPORTS, setup_imports_note
from pytest_gpumem.rankside.protocol import ExitReport


def test_a_body_that_imports_a_compiler_stack_is_told_to_import_it_at_the_top():
    """torch DDP's constructor, in the body: 819 modules, counted by the rank by package."""
    reports = {0: ExitReport(pid=1, setup_imports={"sympy": 419, "torch": 316, "mpmath": 51, "numpy": 15, "x": 18}),
               1: ExitReport(pid=2, setup_imports={"sympy": 419, "torch": 316, "mpmath": 51, "numpy": 15, "x": 18})}
    assert setup_imports_note(reports) == [
        "rank 0 imported 819 modules after its test's setup began (sympy 419, torch 316, mpmath 51, numpy 15): "
        "the host tracker follows an import's every allocation, 2-3x slower, at every launch. Imported at the "
        "top of the test module, they are part of the start-up, measured once (docs/host.md)"]


def test_a_body_that_imports_a_few_modules_or_none_says_nothing():
    few = {"json": MANY_SETUP_IMPORTS - 1}
    assert setup_imports_note({0: ExitReport(pid=1, setup_imports=few), 1: ExitReport(pid=2)}) == []


def test_the_first_rank_that_imported_many_is_named():
    """Ranks that differ (a rank-0-only import): the rank that did it is named, not rank 0."""
    reports = {0: ExitReport(pid=1), 2: ExitReport(pid=3, setup_imports={"sympy": MANY_SETUP_IMPORTS})}
    assert setup_imports_note(reports)[0].startswith(f"rank 2 imported {MANY_SETUP_IMPORTS} modules")
