"""A cache file of keyed entries (floors, start-ups): one entry replaced under the file's lock.

Writers take ``<file>.lock`` and replace the file atomically, so readers, which take no lock,
see the old file or the new one. The oldest entries go first once the file holds ``max_entries``.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Callable

from .atomic import write_atomic


def now() -> str:
    """When an entry was measured: ISO 8601, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def replace_entry(path: Path, *, schema: int, list_key: str, entry: dict[str, Any],
                  kept: Callable[[], list[dict[str, Any]]], max_entries: int, lock_timeout_s: float) -> None:
    """Write ``{"schema", list_key: [the kept entries, oldest first, then entry]}`` under the lock.

    ``kept`` is called under the lock: the file's other entries, as rows, read the moment before
    the write. Raises ``filelock.Timeout`` and ``OSError`` for the caller to word.
    """
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=lock_timeout_s, mode=0o600):
        rows = sorted(kept(), key=lambda e: str(e["measured"]))[-(max_entries - 1):] + [entry]
        data = json.dumps({"schema": schema, list_key: rows}, indent=1, sort_keys=True) + "\n"
        write_atomic(path, data.encode("utf-8"))
