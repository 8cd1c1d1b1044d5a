"""A probe (issue 65): a new mend is a module here and its line in ``MENDS``; reverted by the next commit."""

from __future__ import annotations

from types import ModuleType

from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    context.supplied.add("probe: a mend armed at torch's import")


MEND: Mend = Mend(
    name="probe",
    needed_by="tests/unit/rankside/test_fakegpu.py (the registry's test reads it)",
    on_import=(("torch", _patch),),
)
