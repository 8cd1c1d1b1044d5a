"""A pytest rank's start-up, measured once: what it holds live, and its peak, when its test's setup begins.

Why: the host tracker (memray) costs 3-4x on Python-heavy work, and a rank's start-up (the
interpreter, pytest, the conftests, the test module and the framework it imports; for OneFlow,
its rendezvous) is the heaviest part of a short job and the same bytes at every launch. So the
first launch of a test at a world size tracks its ranks from their start and splits each capture
where the test's setup begins (``GPUMEM_STARTUP=split``); each rank reports its start-up's live and
peak MiB. A later launch of the same test, size and launch hands those figures to its ranks
(``GPUMEM_STARTUP=0=LIVE/PEAK;1=...``), which track from the setup only. Either way a rank's figure
is ``max(start-up peak, start-up live + the job's peak)``, where the job's capture counts what the
job allocated and holds, not what it freed of the start-up's (``sampling.allocations``).

The figures are kept across sessions in a JSON file beside the floor cache (``startups.json``),
keyed by the machine, Python, the installed versions that move memory, the plugin's own sources,
the test, its launch parameters and size, and the environment knobs; an entry is used only while
every rootdir file the ranks imported hashes as it did (``files``). A broken file is named in a
note and rewritten, never trusted. ``--gpumem-host-startup=tracked`` tracks every rank whole.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any, Mapping

from ..storage.cache_file import now, replace_entry

SCHEMA = 1
MAX_ENTRIES = 512  # the oldest go first
LOCK_TIMEOUT_S = 30.0
_MAX_MIB = 2.0**40
_VERSIONED = ("pytest", "memray", "torch", "oneflow", "numpy")
# Environment knobs a start-up may depend on (libraries' pools and code paths, Python's own).
_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "TORCH", "ONEFLOW_", "GLOG_",
                 "ATEN_", "ONEDNN_", "DNNL_")
Figures = dict[int, tuple[float, float]]  # rank -> (live MiB, peak MiB) at the setup


class StartupCacheError(ValueError):
    """A cache file that cannot be used; the message names the file, the field and what is accepted."""


def _bad(path: Path, where: str, what: str, expected: str) -> StartupCacheError:
    return StartupCacheError(f"start-up cache {path}: {where}: {what}; expected {expected}")


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _session_key() -> dict[str, str]:
    """What every entry of this session depends on: machine, Python, versions, the plugin's sources."""
    from importlib import metadata

    key = {"machine": socket.gethostname(), "python": f"{sys.executable} {sys.version.split()[0]}",
           "schema": str(SCHEMA)}
    for name in _VERSIONED:
        try:
            key[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    plugin = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for source in sorted(package.rglob("*.py")):
        plugin.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    key["pytest_gpumem"] = plugin.hexdigest()[:16]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    key["env"] = hashlib.sha256(json.dumps(env).encode()).hexdigest()[:16]
    return key


def _entry(path: Path, where: str, raw: Any) -> tuple[dict[str, str], Figures, dict[str, str], str]:
    if not isinstance(raw, dict):
        raise _bad(path, where, f"{type(raw).__name__} is not an object", "an object")
    key, ranks, files, measured = raw.get("key"), raw.get("ranks"), raw.get("files"), raw.get("measured")
    if not isinstance(key, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in key.items()):
        raise _bad(path, f"{where}.key", "not an object of strings", "an object of strings")
    if not isinstance(ranks, dict) or not ranks:
        raise _bad(path, f"{where}.ranks", "not a non-empty object", "rank -> [live MiB, peak MiB]")
    figures: Figures = {}
    for rank, pair in ranks.items():
        ok = (isinstance(rank, str) and rank.isdigit() and isinstance(pair, list) and len(pair) == 2
              and all(isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m)
                      and 0 <= m < _MAX_MIB for m in pair))
        if not ok:
            raise _bad(path, f"{where}.ranks[{rank!r}]", f"{pair!r}",
                       "a rank like '0' -> [live MiB, peak MiB], finite, 0 <= value < 2**40")
        figures[int(rank)] = (float(pair[0]), float(pair[1]))
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise _bad(path, f"{where}.files", "not an object of strings", "rootdir-relative path -> SHA-256")
    try:
        datetime.datetime.fromisoformat(str(measured))
    except ValueError:
        raise _bad(path, f"{where}.measured", f"{measured!r} is not a date", "an ISO 8601 date and time") from None
    return key, figures, files, str(measured)


class Startups:
    """The session's start-up figures, by test, launch and size; from this session or the cache file."""

    def __init__(self, mode: str, path: Path | None, rootdir: Path) -> None:
        self.mode = mode  # cached | tracked
        self.path = path  # None: kept in this session only
        self.rootdir = rootdir
        self._found: dict[str, Figures | None] = {}  # by key id; None: its probe failed
        self._session: dict[str, str] | None = None
        self.notes: list[str] = []  # problems with the cache file or a probe, not yet said
        self._said: set[str] = set()

    def env(self, test_id: str, launch: tuple[Any, ...], world: int) -> str:
        """``GPUMEM_STARTUP`` for the ranks of this launch: the figures where known, ``probe`` where
        a probe must measure them first, "" where the ranks are tracked whole."""
        if self.mode != "cached":
            return ""
        key = self._key(test_id, launch, world)
        figures = self._found.get(key["id"]) if key["id"] in self._found else self._cached(key)
        if figures is None:
            return "" if key["id"] in self._found else "probe"
        self._found[key["id"]] = figures
        return ";".join(f"{rank}={live!r}/{peak!r}" for rank, (live, peak) in sorted(figures.items()))

    def learn(self, test_id: str, launch: tuple[Any, ...], world: int, figures: Figures,
              files: Mapping[str, str]) -> None:
        """Keep what a probe measured (every rank's), for this session and the cache file."""
        key = self._key(test_id, launch, world)
        self._found[key["id"]] = dict(figures)
        if self.path is not None:
            self._put(key, figures, files)

    def failed(self, test_id: str, launch: tuple[Any, ...], world: int, problems: list[str]) -> None:
        """A probe that gave no figures: this session tracks those ranks whole, and says why once."""
        self._found[self._key(test_id, launch, world)["id"]] = None
        why = problems[0].splitlines()[0] if problems else "a rank reported none"
        self._say(f"the start-up probe of {test_id} at nproc={world} measured nothing ({why}): "
                  "its ranks were tracked whole")

    def take_notes(self) -> list[str]:
        """What went wrong since the last call (cache file, probes), each said once."""
        notes, self.notes = self.notes, []
        return notes

    def _key(self, test_id: str, launch: tuple[Any, ...], world: int) -> dict[str, str]:
        if self._session is None:
            self._session = _session_key()
        key = {**self._session, "test": test_id, "launch": json.dumps(list(launch), default=str),
               "world_size": str(world)}
        key["id"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return key

    def _load(self) -> list[tuple[dict[str, str], Figures, dict[str, str], str]]:
        assert self.path is not None
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise _bad(self.path, "(file)", f"cannot be read ({getattr(exc, 'strerror', None) or exc})",
                       "a readable UTF-8 file") from exc
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise _bad(self.path, "(file)", f"not JSON ({exc})", "JSON as pytest-gpumem writes it") from exc
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("startups"), list):
            raise _bad(self.path, "(document)", "not a start-up cache", f'{{"schema": {SCHEMA}, "startups": [...]}}')
        return [_entry(self.path, f"startups[{i}]", raw) for i, raw in enumerate(doc["startups"])]

    def _cached(self, key: Mapping[str, str]) -> Figures | None:
        """The cache file's figures for ``key``, if every file they depended on is unchanged."""
        if self.path is None:
            return None
        try:
            entries = self._load()
        except StartupCacheError as exc:
            self._say(f"{exc}: not used; start-ups are measured again and the file rewritten")
            return None
        for stored, figures, files, _ in entries:
            if stored == dict(key):
                unchanged = all(_sha(self.rootdir / name) == digest for name, digest in files.items())
                return figures if unchanged else None
        return None

    def _put(self, key: Mapping[str, str], figures: Figures, files: Mapping[str, str]) -> None:
        assert self.path is not None
        entry = {"key": dict(sorted(key.items())), "files": dict(sorted(files.items())),
                 "ranks": {str(r): [live, peak] for r, (live, peak) in sorted(figures.items())}, "measured": now()}

        def kept() -> list[dict[str, Any]]:
            try:
                entries = [e for e in self._load() if e[0] != entry["key"]]
            except StartupCacheError:
                entries = []  # said by _cached(); a broken file is replaced, not merged
            return [{"key": k, "files": f, "ranks": {str(r): [lv, pk] for r, (lv, pk) in fig.items()}, "measured": m}
                    for k, fig, f, m in entries]

        from filelock import Timeout

        try:
            replace_entry(self.path, schema=SCHEMA, list_key="startups", entry=entry, kept=kept,
                          max_entries=MAX_ENTRIES, lock_timeout_s=LOCK_TIMEOUT_S)
        except Timeout:
            self._say(f"start-up cache {self.path}: its lock was not acquired within {LOCK_TIMEOUT_S:g} s; "
                      "the start-up measured now is used in this session only")
        except OSError as exc:
            self._say(f"start-up cache {self.path}: cannot be written ({exc.strerror or exc}); the start-up "
                      "measured now is used in this session only (set gpumem_floor_cache to a writable file, or off)")

    def _say(self, note: str) -> None:
        if note not in self._said:
            self._said.add(note)
            self.notes.append(note)
