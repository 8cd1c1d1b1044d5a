"""Reports written before schema 4, read into today's record (pytest-gpumem was never released with
them; the tests' recorded reports, tests/data/, are of schemas 1 and 2).

Schemas 1 to 3 spelled outcomes ``pass``, ``FAIL``, ``ERROR``, ``skip``, ``XFAIL``, ``XPASS``;
schema 1 named the gated rank by its label and kept only a ``failed`` flag per size.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from .record import FAILED, Cause, CheckRecord, SizeRecord, Status

OLD_STATUSES: dict[str, Status] = {"pass": "passed", "FAIL": "failed", "ERROR": "failed", "skip": "skipped",
                                   "XFAIL": "xfailed", "XPASS": "xpassed"}  # schemas 1 to 3
_LABEL = re.compile(r"rank (\d+)")


def schema1_checks(raw: Mapping[str, Any], gated_mib: float | None,
                   failed: bool) -> tuple[int | None, tuple[CheckRecord, ...]]:
    """A schema-1 size's gated rank (read from its label) and its one check (its ``failed`` flag)."""
    match = _LABEL.match(str(raw.get("gated_rank") or ""))
    check = CheckRecord("schema1", not failed, gated_mib, None,
                        "failed (schema 1 record: the limit was not recorded)" if failed else "passed")
    return (int(match.group(1)) if match else None), (check,)


def old_status(status: str, messages: tuple[str, ...],
               sizes: tuple[SizeRecord, ...]) -> tuple[Status, Cause | None]:
    """A schema-1/2/3 status in today's words, and the cause its record shows: ``FAIL`` was a limit;
    ``ERROR`` a failed launch or a baseline problem (told apart by its message); an ``XFAIL`` failed
    either way."""
    new = OLD_STATUSES[status]
    if new not in FAILED:
        return new, None
    if status == "FAIL" or (status == "XFAIL" and any(size.failed for size in sizes)):
        return new, "limit"
    first = messages[0] if messages else ""
    if first.startswith(("baseline file unusable", "baseline not refreshed")):
        return new, "baseline-error"
    if first.startswith(("no baseline stored", "baseline of ")):
        return new, "baseline-missing"
    return new, "crash"
