"""Baseline store: one reviewable JSON file per test module under ``baselines/``.

Why this shape: reviewers read baselines in PR diffs (stable key order, one value per line),
many xdist workers refresh at once (one lock, temp file, atomic replace), and a truncated or
hand-broken file must fail loudly instead of being overwritten. Files are data only: parsed
with :mod:`json`, validated field by field, never pickled or evaluated.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..storage.atomic import write_atomic

# 2: optional allocator figures and peak sites per entry (under rank="all" every rank's); host
# platforms by architecture
SCHEMA_VERSION = 2
READ_SCHEMAS = (2,)
MAX_MIB = 2.0**40
LOCK_NAME = ".gpumem.lock"
LOCK_TIMEOUT_S = 300.0
STALE_TEMP_S = 600.0  # a temp file this old was left by a writer that died mid-write
_ENTRY_KEYS = ("device", "gated_mib", "method", "provenance", "rank", "ranks")
_OPTIONAL_KEYS = ("allocated_mib", "reserved_mib", "sites", "allocated_ranks", "rank_sites")  # schema 2
_SITE_KEYS = ("where", "function", "detail", "mib", "count", "internal")
_INT_KEY = re.compile(r"0|[1-9][0-9]{0,8}")  # used with fullmatch: no "2\n"
_MIB_RULE = "a finite number of MiB, 0 <= value < 2**40"
_JSON_RULE = "JSON as pytest-gpumem writes it"


class BaselineError(ValueError):
    """A baseline that cannot be trusted; the message names the file, the field and what is accepted."""


@dataclass(frozen=True)
class Entry:
    """One world size's stored measurement on one platform."""

    gated_mib: float  # the gated rank's peak
    ranks: dict[int, float]  # every measured rank's peak; unmeasured ranks are absent
    rank: int | str  # which rank gated: an int or "all"
    device: str  # "gpu" | "cpu"
    method: str  # how it was measured, e.g. "high-water mark"
    provenance: dict[str, str]  # flat, so a diff shows exactly what changed
    allocated_mib: float | None = None  # GPU: the gated rank's allocator figure (torch max_memory_allocated)
    reserved_mib: float | None = None  # GPU: what the allocator reserved (information)
    sites: tuple[dict[str, Any], ...] = ()  # the gated rank's top sites live at its peak
    # rank="all": each rank is compared with its own figure (stages are not alike), so every rank's
    # allocator figure and the other ranks' sites are kept too.
    allocated_ranks: Mapping[int, float] = field(default_factory=dict)
    rank_sites: Mapping[int, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    @property
    def gated_rank(self) -> int | None:
        """The rank whose figure is ``gated_mib``: ``rank``, or for "all" the largest (the highest of equals)."""
        if self.rank != "all":
            return int(self.rank)
        return max((mib, r) for r, mib in self.ranks.items())[1] if self.ranks else None

    def sites_of(self, rank: int) -> tuple[dict[str, Any], ...]:
        """The stored sites of one rank: the gated rank's, or under rank="all" another's."""
        return self.sites if rank == self.gated_rank else tuple(self.rank_sites.get(rank, ()))


class _Obj(dict[str, Any]):
    """A JSON object that remembers keys given twice (a badly resolved merge) to report them."""

    duplicates: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore
    return obj


class _Rejected:
    """Stands in for NaN, Infinity or a 100-digit integer so validation rejects it by field path."""

    def __init__(self, text: str) -> None:
        self.text = text if len(text) < 24 else f"{text[:12]}... ({len(text)} digits)"

    def __repr__(self) -> str:
        return self.text


def _parse_int(text: str) -> int | _Rejected:
    return int(text) if len(text) < 24 else _Rejected(text)  # int() of 5000 digits would raise unnamed


def _bad(file: Path, where: str, what: str, expected: str) -> BaselineError:
    return BaselineError(f"{file}: {where or '(top level)'}: {what}; expected {expected}")


def _got(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "got an object" if isinstance(value, dict) else "got an array"
    if value is None or isinstance(value, bool):
        return "got " + json.dumps(value)
    return f"got the string {value!r}" if isinstance(value, str) else f"got {value!r}"


def _check_obj(file: Path, where: str, value: Any, keys: tuple[str, ...] | None, expected: str) -> None:
    """An object, no key twice, and (when ``keys`` is given) exactly those keys."""
    if not isinstance(value, dict):
        raise _bad(file, where, _got(value), expected)
    dups: tuple[str, ...] = getattr(value, "duplicates", ())
    if dups:
        raise _bad(file, f"{where}[{dups[0]!r}]", "given more than once in one object",
                   "each key once (was a merge conflict resolved by keeping both sides?)")
    if keys is None:
        return
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise _bad(file, where, "unknown key(s) " + ", ".join(map(repr, unknown)),
                   "only " + ", ".join(map(repr, keys)))
    for key in keys:
        if key not in value:
            raise _bad(file, f"{where}.{key}" if where else key, "missing", "all of " + ", ".join(keys))


def _check_mib(file: Path, where: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value < MAX_MIB):
        raise _bad(file, where, _got(value), _MIB_RULE)


def _check_entry(file: Path, where: str, e: Any, world_size: int, device: str) -> None:
    required = {k: v for k, v in e.items() if k not in _OPTIONAL_KEYS} if isinstance(e, dict) else e
    if isinstance(e, dict) and bool(getattr(e, "duplicates", ())):
        _check_obj(file, where, e, None, "")
    _check_obj(file, where, required, _ENTRY_KEYS,
               "an object with " + ", ".join(_ENTRY_KEYS) + " (and optionally " + ", ".join(_OPTIONAL_KEYS) + ")")
    for key in ("allocated_mib", "reserved_mib"):
        if key in e and e[key] is not None:
            _check_mib(file, f"{where}.{key}", e[key])
    if "sites" in e:
        _check_sites(file, f"{where}.sites", e["sites"])
    if e["device"] != device:
        raise _bad(file, f"{where}.device", _got(e["device"]), f"{device!r}, as the platform key says")
    _check_mib(file, f"{where}.gated_mib", e["gated_mib"])
    rank = e["rank"]
    if rank != "all" and (type(rank) is not int or not 0 <= rank < world_size):
        raise _bad(file, f"{where}.rank", _got(rank), f"'all' or an integer rank 0..{world_size - 1}")
    for field_name in ("ranks", "allocated_ranks"):
        if field_name not in e:
            continue
        _check_obj(file, f"{where}.{field_name}", e[field_name], None, "an object of rank -> MiB")
        for key, mib in e[field_name].items():
            _check_rank_key(file, f"{where}.{field_name}[{key!r}]", key, world_size)
            _check_mib(file, f"{where}.{field_name}[{key!r}]", mib)
    if "rank_sites" in e:
        _check_obj(file, f"{where}.rank_sites", e["rank_sites"], None, "an object of rank -> list of sites")
        for key, sites in e["rank_sites"].items():
            _check_rank_key(file, f"{where}.rank_sites[{key!r}]", key, world_size)
            _check_sites(file, f"{where}.rank_sites[{key!r}]", sites)
    if not isinstance(e["method"], str) or not e["method"]:
        raise _bad(file, f"{where}.method", _got(e["method"]), "a non-empty string, e.g. 'high-water mark'")
    _check_obj(file, f"{where}.provenance", e["provenance"], None, "an object of string -> string")
    for key, value in e["provenance"].items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise _bad(file, f"{where}.provenance[{key!r}]", _got(value), "string keys and string values")


def _check_rank_key(file: Path, where: str, key: str, world_size: int) -> None:
    if not _INT_KEY.fullmatch(key) or int(key) >= world_size:
        raise _bad(file, where, "not a rank of this world size", f"rank keys '0'..'{world_size - 1}'")


def _check_sites(file: Path, where: str, sites: Any) -> None:
    if not isinstance(sites, list):
        raise _bad(file, where, _got(sites), "a list of sites")
    for i, site in enumerate(sites):
        _check_obj(file, f"{where}[{i}]", site, _SITE_KEYS, "an object with " + ", ".join(_SITE_KEYS))
        for key in ("where", "function", "detail"):
            if not isinstance(site[key], str):
                raise _bad(file, f"{where}[{i}].{key}", _got(site[key]), "a string")
        _check_mib(file, f"{where}[{i}].mib", site["mib"])
        if type(site["count"]) is not int or site["count"] < 0:
            raise _bad(file, f"{where}[{i}].count", _got(site["count"]), "an integer >= 0")
        if not isinstance(site["internal"], bool):
            raise _bad(file, f"{where}[{i}].internal", _got(site["internal"]), "true or false")


_PLATFORM_RULE = "'gpu:<GPU name>' or 'cpu:<architecture>'"


def _platform_device(key: Any) -> str | None:
    device, sep, name = key.partition(":") if isinstance(key, str) else ("", "", "")
    return device if sep and device in ("gpu", "cpu") and name.strip() else None


def _check_doc(file: Path, doc: Any) -> None:
    _check_obj(file, "", doc, None, "an object with 'schema' and 'tests'")
    schema = doc.get("schema")  # checked first: a newer file should say so, not list unknown keys
    if type(schema) is not int or schema not in READ_SCHEMAS:
        what = f"{_got(schema)}, which this pytest-gpumem cannot read" if "schema" in doc else "missing"
        raise _bad(file, "schema", what,
                   f"{' or '.join(map(str, READ_SCHEMAS))} (the baseline schemas this pytest-gpumem reads)")
    _check_obj(file, "", doc, ("schema", "tests"), "'schema' and 'tests'")
    _check_obj(file, "tests", doc["tests"], None, "an object of test name -> platforms")
    for name, plats in doc["tests"].items():
        where = f"tests[{name!r}]"
        _check_obj(file, where, plats, None, f"an object of platform ({_PLATFORM_RULE}) -> sizes")
        for plat, sizes in plats.items():
            device = _platform_device(plat)
            if device is None:
                raise _bad(file, f"{where}[{plat!r}]", "not a platform key", _PLATFORM_RULE)
            _check_obj(file, f"{where}[{plat!r}]", sizes, None, "an object of world size -> entry")
            for ws, entry in sizes.items():
                at = f"{where}[{plat!r}][{ws!r}]"
                if not _INT_KEY.fullmatch(ws) or ws == "0":
                    raise _bad(file, at, "not a world size", "a positive integer key like '2'")
                _check_entry(file, at, entry, int(ws), device)


def _load(file: Path) -> tuple[bytes, dict[str, Any]] | None:
    """The file's bytes and validated document; None if there is no file."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _bad(file, "(file)", f"cannot be read ({exc.strerror})", "a readable baseline file") from exc
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_Rejected,
                         parse_int=_parse_int, object_pairs_hook=_pairs)
    except UnicodeDecodeError as exc:
        raise _bad(file, f"byte {exc.start}", "not UTF-8", "a UTF-8 JSON file") from exc
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated")
        what = exc.msg + (" (the file ends early: truncated?)" if cut else "")
        raise _bad(file, f"line {exc.lineno} column {exc.colno}", what, _JSON_RULE) from exc
    except (ValueError, RecursionError) as exc:
        raise _bad(file, "(file)", f"not readable as JSON ({exc})", _JSON_RULE) from exc
    _check_doc(file, doc)
    return raw, doc


def _ordered(value: Any) -> Any:
    """Keys sorted, numerically where they are numbers ('2' before '10'), so diffs stay stable."""
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (0, int(k), "") if _INT_KEY.fullmatch(k) else (1, 0, k))
        return {k: _ordered(value[k]) for k in keys}
    return value


def _dump(doc: Mapping[str, Any]) -> bytes:
    text = json.dumps(_ordered(doc), indent=2, ensure_ascii=False, allow_nan=False)
    # A lone surrogate (undecodable env bytes) cannot be UTF-8; "\udcff" is its JSON escape.
    return (text + "\n").encode("utf-8", "backslashreplace")


def _round(mib: Any) -> Any:
    """0.1 MiB is far below run-to-run noise; fewer digits, quieter diffs. Non-numbers: left to validation."""
    return mib if isinstance(mib, bool) or not isinstance(mib, (int, float)) else round(float(mib), 1)


def _to_json(e: Entry) -> dict[str, Any]:
    """Entry -> JSON object; anything of the wrong type is passed through for validation to name."""
    ranks = {str(r): _round(v) for r, v in e.ranks.items()} if isinstance(e.ranks, Mapping) else e.ranks
    prov = dict(e.provenance) if isinstance(e.provenance, Mapping) else e.provenance
    out = {"device": e.device, "gated_mib": _round(e.gated_mib), "method": e.method,
           "provenance": prov, "rank": e.rank, "ranks": ranks}
    if e.allocated_mib is not None:
        out["allocated_mib"] = _round(e.allocated_mib)
    if e.reserved_mib is not None:
        out["reserved_mib"] = _round(e.reserved_mib)
    if e.sites:
        out["sites"] = [dict(site) for site in e.sites]
    if e.allocated_ranks:
        out["allocated_ranks"] = ({str(r): _round(v) for r, v in e.allocated_ranks.items()}
                                  if isinstance(e.allocated_ranks, Mapping) else e.allocated_ranks)
    if e.rank_sites:
        out["rank_sites"] = ({str(r): [dict(site) for site in sites] for r, sites in e.rank_sites.items()}
                             if isinstance(e.rank_sites, Mapping) else e.rank_sites)
    return out


def _from_json(raw: Mapping[str, Any]) -> Entry:
    ranks = {int(k): float(v) for k, v in raw["ranks"].items()}
    prov = dict(raw["provenance"])
    allocated, reserved = raw.get("allocated_mib"), raw.get("reserved_mib")
    return Entry(float(raw["gated_mib"]), ranks, raw["rank"], raw["device"], raw["method"], prov,
                 None if allocated is None else float(allocated), None if reserved is None else float(reserved),
                 tuple(dict(site) for site in raw.get("sites") or ()),
                 {int(k): float(v) for k, v in (raw.get("allocated_ranks") or {}).items()},
                 {int(k): tuple(dict(site) for site in v) for k, v in (raw.get("rank_sites") or {}).items()})


class BaselineStore:
    """Baselines under one directory. Reads take no lock (writers replace atomically); writes do."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def file_for(self, test_id: str) -> Path:
        """``a/test_x.py::test_a[2]`` -> ``<dir>/a/test_x.py.json``: one file per module, local diffs."""
        return self._split(test_id)[0]

    def _split(self, test_id: str) -> tuple[Path, str]:
        module, sep, name = test_id.partition("::")
        parts = module.split("/")
        if not sep or not name or module.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise BaselineError(f"{self.directory}: test id {test_id!r}: cannot be stored; "
                                "expected 'path/under/rootdir/test_x.py::name'")
        return self.directory.joinpath(*parts[:-1], parts[-1] + ".json"), name

    def lookup(self, test_id: str, platform: str, world_size: int) -> Entry | None:
        """The stored entry, or None when file, test, platform or size is absent; a bad file raises."""
        file, name = self._split(test_id)
        loaded = _load(file)
        raw = loaded[1]["tests"].get(name, {}).get(platform, {}).get(str(world_size)) if loaded else None
        return None if raw is None else _from_json(raw)

    def platforms(self, test_id: str) -> list[str]:
        """Platforms stored for the test, so a miss can say where a baseline does exist."""
        file, name = self._split(test_id)
        loaded = _load(file)
        return sorted(loaded[1]["tests"].get(name, {})) if loaded else []

    def update(
        self, test_id: str, platform: str, entries: Mapping[int, Entry],
        merge: Callable[[Entry, Entry], Entry] | None = None,
    ) -> dict[int, tuple[Entry | None, Entry]]:
        """Locked read-modify-write of these sizes only; everything else in the file is kept as it was.

        ``merge(old, new)``, where an entry is replaced, gives what is written instead of ``new``
        (the gate keeps stored sites that moved by less than noise).
        """
        file, name = self._split(test_id)
        device = _platform_device(platform)
        if device is None:
            raise _bad(file, f"tests[{name!r}][{platform!r}]", "not a platform key", _PLATFORM_RULE)
        new: dict[str, dict[str, Any]] = {}
        for ws, entry in entries.items():
            where = f"tests[{name!r}][{platform!r}][{str(ws)!r}]"
            if type(ws) is not int or ws < 1:
                raise _bad(file, where, "not a world size", "a positive integer")
            new[str(ws)] = _to_json(entry)
            _check_entry(file, where, new[str(ws)], ws, device)  # never write what we could not read back
        if not new:
            return {}
        from filelock import FileLock, Timeout  # here: ranks import this module for host_provenance

        lock = FileLock(str(self.directory / LOCK_NAME), timeout=LOCK_TIMEOUT_S, mode=0o600)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with lock:
                loaded = _load(file)  # a bad file raises here, before anything is written
                doc: dict[str, Any] = loaded[1] if loaded else {"schema": SCHEMA_VERSION, "tests": {}}
                plats = doc["tests"].setdefault(name, {})
                sizes = plats.setdefault(platform, {})
                changes: dict[int, tuple[Entry | None, Entry]] = {}
                for size, raw in list(new.items()):
                    old = sizes.get(size)
                    if old is not None and merge is not None:
                        raw = new[size] = _to_json(merge(_from_json(old), _from_json(raw)))
                        _check_entry(file, f"tests[{name!r}][{platform!r}][{size!r}]", raw, int(size), device)
                    changes[int(size)] = (None if old is None else _from_json(old), _from_json(raw))
                sizes.update(new)
                doc["schema"] = SCHEMA_VERSION
                data = _dump(doc)
                self._remove_stale_temps(file)
                if loaded is None or loaded[0] != data:
                    write_atomic(file, data)
        except Timeout as exc:
            raise _bad(Path(lock.lock_file), "lock", f"not acquired within {LOCK_TIMEOUT_S:g} s",
                       "no other pytest-gpumem process to hold it that long") from exc
        except OSError as exc:  # a folder that is a file, read-only, full...
            raise _bad(file, "(file)", f"cannot be written ({exc.strerror or exc})",
                       "a writable baseline folder") from exc
        return changes

    @staticmethod
    def _remove_stale_temps(file: Path) -> None:
        """Temp files a killed writer left behind; old ones only, in case a peer bypasses the lock."""
        for tmp in file.parent.glob(f".{glob.escape(file.name)}.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                    tmp.unlink()

    def entries(self, pattern: str | None = None) -> list[tuple[str, str, int, Entry]]:
        """(test id, platform, world size, entry) for each entry whose test id fnmatches ``pattern``."""
        out: list[tuple[str, str, int, Entry]] = []
        for file in sorted(self.directory.rglob("*.json")) if self.directory.is_dir() else []:
            loaded = None if file.name.startswith(".") else _load(file)
            module = file.relative_to(self.directory).as_posix()[: -len(".json")]
            for name, plats in (loaded[1]["tests"] if loaded else {}).items():
                test_id = f"{module}::{name}"
                if pattern is not None and not fnmatch.fnmatchcase(test_id, pattern):
                    continue
                out.extend((test_id, plat, int(ws), _from_json(raw))
                           for plat, sizes in plats.items() for ws, raw in sizes.items())
        return sorted(out, key=lambda t: (t[0], t[1], t[2]))
