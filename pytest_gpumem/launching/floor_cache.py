"""Floors kept across pytest sessions: the empty job's figure, measured once per machine, driver,
framework version, Python, launch parameters and world size.

Why a cache and not a probe beside the first launch: the floor must be measured the way the test
is (same GPUs, alone on them, same sampler), so it cannot share the test's GPUs or cores while
the test runs; measured after the test, it cost a whole launch per size and session (~10 s on an
H200: torch's import and a CUDA context). Its figure moves only when what it measures changes
(the driver, CUDA, the framework build, the launcher and its environment), and all of that is in
the key: a changed key is a miss, measured again.

Where: the ``gpumem_floor_cache`` setting; by default ``$XDG_CACHE_HOME/pytest-gpumem/floors.json``,
``~/.cache/pytest-gpumem/floors.json`` when XDG_CACHE_HOME is unset (``settings.default_floor_cache``).
``--gpumem-floor=on`` measures again and rewrites the entry. The file is data only (JSON, validated field by field on
read); a broken file is named in a note, its floor measured again and the file rewritten: it is
never trusted, and never stops a test. Writers take a lock and replace the file atomically, so
readers, which take no lock, see the old file or the new one.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..rankside.floor_job import FRAMEWORKS, PROBE_VERSION
from ..storage.cache_file import now, replace_entry

SCHEMA = 1
MAX_ENTRIES = 256  # the oldest go first: one per framework build, driver, launcher and size
LOCK_TIMEOUT_S = 30.0
_MAX_MIB = 2.0**40
# Provenance entries (rank 0's, and the driver's for GPU figures) that move the floor.
_KEY_PROVENANCE = ("python", "platform", "nvidia_driver", "cuda_driver", "torch", "torch_cuda", "torch_commit",
                   "nccl", "oneflow", "oneflow_commit")
_ENV_PREFIX = "env."
_RULE = "JSON as pytest-gpumem writes it"


def cache_key(*, device: str, platform: str, world_size: int, method: str, launch: tuple[Any, ...],
              provenance: Mapping[str, str]) -> dict[str, str]:
    """What a floor depends on, as strings: the machine, the figure's device, platform and method,
    the probe's launch parameters (launcher, env, ...), the versions and the env knobs that move memory."""
    key = {
        "machine": socket.gethostname(),
        "device": device,
        "platform": platform,
        "world_size": str(world_size),
        "method": method,
        "launch": json.dumps(list(launch), default=str),
        "probe": str(PROBE_VERSION),
    }
    for name, value in sorted(provenance.items()):
        if name in _KEY_PROVENANCE or name.startswith(_ENV_PREFIX):
            key[name] = str(value)
    return key


@dataclass(frozen=True)
class CachedFloor:
    framework: str
    ranks: dict[int, float]
    measured: str  # ISO 8601, UTC

    @property
    def date(self) -> str:
        return self.measured[:10]


class FloorCacheError(ValueError):
    """A cache file that cannot be used; the message names the file, the field and what is accepted."""


def _bad(path: Path, where: str, what: str, expected: str = _RULE) -> FloorCacheError:
    return FloorCacheError(f"floor cache {path}: {where}: {what}; expected {expected}")


def _entry(path: Path, where: str, raw: Any) -> tuple[dict[str, str], CachedFloor]:
    if not isinstance(raw, dict):
        raise _bad(path, where, f"{type(raw).__name__} is not an object")
    key = raw.get("key")
    if not isinstance(key, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in key.items()):
        raise _bad(path, f"{where}.key", "not an object of strings")
    framework = raw.get("framework")
    if framework not in FRAMEWORKS:
        raise _bad(path, f"{where}.framework", f"{framework!r}", "one of " + ", ".join(FRAMEWORKS))
    ranks = raw.get("ranks")
    if not isinstance(ranks, dict) or not ranks:
        raise _bad(path, f"{where}.ranks", "not a non-empty object", "rank -> MiB")
    parsed: dict[int, float] = {}
    for rank, mib in ranks.items():
        if not (isinstance(rank, str) and rank.isdigit()):
            raise _bad(path, f"{where}.ranks", f"key {rank!r} is not a rank", "keys like '0'")
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not math.isfinite(mib) \
                or not 0 <= mib < _MAX_MIB:
            raise _bad(path, f"{where}.ranks[{rank!r}]", f"{mib!r} is not a number of MiB",
                       "a finite number of MiB, 0 <= value < 2**40")
        parsed[int(rank)] = float(mib)
    measured = raw.get("measured")
    try:
        datetime.datetime.fromisoformat(str(measured))
    except ValueError:
        raise _bad(path, f"{where}.measured", f"{measured!r} is not a date", "an ISO 8601 date and time") from None
    return key, CachedFloor(str(framework), parsed, str(measured))


class FloorCache:
    """One cache file. ``get`` and ``put`` never raise: a problem comes back as a sentence for the report."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _load(self) -> list[tuple[dict[str, str], CachedFloor]]:
        """Every entry, validated; [] when there is no file; FloorCacheError names what is broken."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise _bad(self.path, "(file)", f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from exc
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _bad(self.path, f"line {exc.lineno} column {exc.colno}", exc.msg) from exc
        except (ValueError, RecursionError) as exc:
            raise _bad(self.path, "(file)", f"not readable as JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("floors"), list):
            raise _bad(self.path, "(document)", "not a floor cache",
                       f'{{"schema": {SCHEMA}, "floors": [...]}} as pytest-gpumem writes it')
        return [_entry(self.path, f"floors[{i}]", raw) for i, raw in enumerate(doc["floors"])]

    def get(self, key: Mapping[str, str]) -> tuple[CachedFloor | None, str | None]:
        """The floor stored under ``key`` (None: not there), and what was wrong with the file, if anything."""
        try:
            entries = self._load()
        except FloorCacheError as exc:
            return None, f"{exc}: not used; the floor is measured again and the file rewritten"
        return next((floor for k, floor in entries if k == dict(key)), None), None

    def put(self, key: Mapping[str, str], framework: str, ranks: Mapping[int, float]) -> str | None:
        """Store (or replace) the floor under ``key``; returns a problem sentence, or None."""
        entry = {"key": dict(sorted(key.items())), "framework": framework,
                 "ranks": {str(r): float(m) for r, m in sorted(ranks.items())},  # as measured: no rounding
                 "measured": now()}

        def kept() -> list[dict[str, Any]]:
            try:
                entries = [e for e in self._load() if e[0] != entry["key"]]
            except FloorCacheError:
                entries = []  # reported by get(); a broken file is replaced, not merged
            return [{"key": k, "framework": f.framework, "ranks": {str(r): m for r, m in f.ranks.items()},
                     "measured": f.measured} for k, f in entries]

        from filelock import Timeout

        try:
            replace_entry(self.path, schema=SCHEMA, list_key="floors", entry=entry, kept=kept,
                          max_entries=MAX_ENTRIES, lock_timeout_s=LOCK_TIMEOUT_S)
        except Timeout:
            return (f"floor cache {self.path}: its lock was not acquired within {LOCK_TIMEOUT_S:g} s; "
                    "the floor measured now is used in this session only")
        except OSError as exc:
            return (f"floor cache {self.path}: cannot be written ({exc.strerror or exc}); "
                    "the floor measured now is used in this session only (set gpumem_floor_cache to a writable "
                    "file, or off)")
        return None
