"""Records read back from JSON: a ``--gpumem-report`` file, or the record a worker sends the xdist
controller. The reader walks the declaration the writer walks (``record.TEST_FIELDS``, ...), one
converter per kind, and names every bad field (file, field, what is accepted), all of them at once.
Only today's schema is read: no earlier one was released.

A check from a report written before its ``making``, ``reference_mib`` and ``rank_label`` keys is
rebuilt from its ``text``: the rank label before `` at nproc=``, the limit's making after the figure,
so that it reads as the sentence it was stored as.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from ..config.spec import Defaults, Spec, SpecError, Tolerance, parse_marker, parse_tolerance
from ..results.predict import MODELS_BY_NAME, Candidate, Fit, Prediction
from ..results.size import FloorResult, SizeResult
from ..sampling import AllocatedPeak, DeviceEstimate, Peak
from ..sampling.sites import Site, from_dicts
from .record import (
    CAUSES,
    CHECK_FIELDS,
    CHECK_KINDS,
    FAILED,
    LIMIT_FIELDS,
    SCHEMA,
    SIZE_FIELDS,
    STATUSES,
    TEST_FIELDS,
    BaselineChange,
    Field,
    ReportError,
    SiteChange,
    SizeRecord,
    TestRecord,
)
from .verdict import Check

T = TypeVar("T")
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,8}")
# A stored check sentence (verdict.Check.text): "{rank} at nproc=N (device...): [peak X MiB <= ]{making}"
_SENTENCE = re.compile(r"(?P<rank>.*?) at nproc=\d+ \(.*?\): (?:peak \S+ MiB (?:<=|<|>) )?(?P<making>.*)", re.S)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


class _Reader:
    """One converter per kind of field, ``(value, where) -> the typed value``; each bad value is
    collected (``where``: its path) instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.world_size = 1  # the size being read: its predictions' and checks' world size

    def bad(self, where: str, expected: str, got: Any) -> None:
        shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)
        self.problems.append(f"{where}: expected {expected}, got {shown}")

    def valid(self, ok: bool, value: Any, where: str, expected: str, default: T) -> Any:
        if ok:
            return value
        self.bad(where, expected, value)
        return default

    def fields(self, raw: Any, fields: tuple[Field, ...], where: str) -> dict[str, Any]:
        """Every declared field of the JSON object ``raw``, by attribute (a derived one is not read)."""
        raw = self.valid(isinstance(raw, dict), raw, where, "an object", {})
        values = {}
        for f in fields:
            if f.kind != "derived":
                values[f.attr] = value = self.read(f.kind, raw.get(f.json), f"{where}.{f.json}")
            if f.methods:  # a map of Peaks: the figures, and how each was taken
                how = self.by_rank(raw.get(f.methods), f"{where}.{f.methods}", self.string)
                values[f.attr] = {r: Peak(value.get(r), how.get(r, "")) for r in sorted(set(value) | set(how))}
        return values

    def read(self, kind: str, value: Any, where: str) -> Any:
        return _READ[kind](self, value, where)

    def string(self, value: Any, where: str) -> str:
        return self.valid(isinstance(value, str) or value is None, value, where, "a string", "") or ""

    def number(self, value: Any, where: str) -> float | None:
        if value is None or not _is_number(value):
            return self.valid(value is None, value, where, "a finite number or null", None)
        return float(value)

    def mib(self, value: Any, where: str) -> float | None:
        return float(value) if _is_number(value) else self.valid(False, value, where, "a finite number of MiB", None)

    def lines(self, value: Any, where: str) -> tuple[str, ...]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return tuple(self.valid(ok or value is None, value or [], where, "a list of strings", []))

    def by_rank(self, value: Any, where: str, convert: Callable[[Any, str], T | None]) -> dict[int, T]:
        value = self.valid(isinstance(value, dict) or value is None, value, where, "an object keyed by rank", {})
        out: dict[int, T] = {}
        for rank, item in (value or {}).items():
            if not (isinstance(rank, str) and _RANK_KEY.fullmatch(rank)):
                self.bad(where, "rank keys '0', '1', ...", rank)
            elif (converted := convert(item, f"{where}.{rank}")) is not None:
                out[int(rank)] = converted
        return out

    def listed(self, value: Any, where: str, item: Callable[[Any, str], T | None]) -> tuple[T, ...]:
        """A JSON list, each item read by ``item`` (None: left out)."""
        items = self.valid(isinstance(value, list) or value is None, value, where, "a list", []) or []
        return tuple(x for j, raw in enumerate(items) if (x := item(raw, f"{where}[{j}]")) is not None)

    def world(self, value: Any, where: str) -> int:
        self.world_size = self.valid(_is_int(value, 1), value, where, "an integer >= 1", 1)
        return self.world_size

    def timeline(self, raw: Any, where: str) -> tuple[tuple[float, Mapping[int, float]], ...]:
        raw = self.valid(isinstance(raw, list) or raw is None, raw, where, "a list of [seconds, {rank: MiB}] points",
                         [])
        points = []
        for i, point in enumerate(raw or []):
            if isinstance(point, list) and len(point) == 2 and _is_number(point[0]):
                points.append((float(point[0]), self.by_rank(point[1], f"{where}[{i}]", self.mib)))
            else:
                self.bad(f"{where}[{i}]", "[seconds, {rank: MiB}]", point)
        return tuple(points)

    def floor(self, raw: Any, where: str) -> FloorResult | None:
        if raw is None:
            return None
        raw = self.valid(isinstance(raw, dict), raw, where, "an object", {})
        cached = raw.get("cached")
        return FloorResult(self.string(raw.get("framework"), f"{where}.framework"),
                           self.by_rank(raw.get("ranks"), f"{where}.ranks", self.mib),
                           self.valid(cached is None or isinstance(cached, str), cached, f"{where}.cached",
                                      "a string or null", None))

    def prediction(self, raw: Any, where: str) -> Prediction | None:
        """A fitted figure (``Prediction.as_dict``) back as the fit it was; null: a measured size."""
        if raw is None or not isinstance(raw, dict):
            return self.valid(raw is None, raw, where, "an object (the fit) or null", None)
        model = MODELS_BY_NAME.get(str(raw.get("model")))
        if model is None:
            return self.valid(False, raw.get("model"), f"{where}.model", f"one of {', '.join(MODELS_BY_NAME)}", None)
        coefficients = raw.get("coefficients")
        if not (isinstance(coefficients, list) and len(coefficients) == model.params
                and all(_is_number(c) for c in coefficients)):
            return self.valid(False, coefficients, f"{where}.coefficients",
                              f"{model.params} numbers (model {model.name})", None)
        mib = self.mib(raw.get("mib"), f"{where}.mib")
        floor_size = raw.get("floor_size")
        floor_size = self.valid(floor_size is None or _is_int(floor_size, 1), floor_size, f"{where}.floor_size",
                                "an integer >= 1 or null", None)
        points = {key: tuple(sorted(self.by_rank(raw.get(key), f"{where}.{key}", self.mib).items()))
                  for key in ("fitted_on", "left_out")}
        fit = Fit(model, tuple(float(c) for c in coefficients), points["fitted_on"],
                  self.number(raw.get("loo_error"), f"{where}.loo_error"), self.candidates(raw, where),
                  points["left_out"],
                  self.number(raw.get("loo_error_with_left_out"), f"{where}.loo_error_with_left_out"))
        return Prediction(world_size=self.world_size, mib=mib or 0.0, fit=fit,
                          rank_label=self.string(raw.get("rank", "rank 0"), f"{where}.rank"),
                          floor_mib=self.number(raw.get("floor_mib"), f"{where}.floor_mib"), floor_size=floor_size)

    def candidates(self, raw: Mapping[str, Any], where: str) -> tuple[Candidate, ...]:
        """A fit's candidate models (model name -> its LOO error, or null where it was not judged)."""
        value = raw.get("candidates") or {}
        if not isinstance(value, dict):
            return self.valid(False, value, f"{where}.candidates", "an object of model name -> LOO error", ())
        out = []
        for name, loo in value.items():
            if name not in MODELS_BY_NAME or not (loo is None or _is_number(loo)):
                self.bad(f"{where}.candidates.{name}", f"a model ({', '.join(MODELS_BY_NAME)}) -> a number or null",
                         loo)
            else:
                out.append(Candidate(MODELS_BY_NAME[name], None if loo is None else float(loo)))
        return tuple(out)

    def allocated(self, raw: Any, where: str) -> AllocatedPeak | None:
        raw = self.valid(isinstance(raw, dict), raw, where, "an object", {})
        mib = self.mib(raw.get("allocated_mib"), f"{where}.allocated_mib")
        return None if mib is None else AllocatedPeak(mib, self.number(raw.get("reserved_mib"),
                                                                       f"{where}.reserved_mib"), "torch",
                                                      self.device_estimate(raw, where))

    def device_estimate(self, raw: dict[str, Any], where: str) -> DeviceEstimate | None:
        """A fake GPU's predicted device figure (``predicted_device_parts_mib``), or None where there is none."""
        parts = raw.get("predicted_device_parts_mib")
        if parts is None:
            return None
        ok = isinstance(parts, dict) and all(isinstance(k, str) and _is_number(v) for k, v in parts.items())
        if not self.valid(ok, parts, f"{where}.predicted_device_parts_mib", "an object from part to MiB", False):
            return None
        capacity = self.mib(raw.get("gpu_capacity_mib"), f"{where}.gpu_capacity_mib")
        return DeviceEstimate(tuple((k, float(v)) for k, v in parts.items()),
                              self.string(raw.get("predicted_for_gpu"), f"{where}.predicted_for_gpu"), capacity or 0.0)

    def sites(self, raw: Any, where: str) -> tuple[Site, ...] | None:
        ok = isinstance(raw, list) and all(isinstance(s, dict) and isinstance(s.get("where"), str)
                                           and _is_number(s.get("mib")) for s in raw)
        expected = "a list of sites ({where, function, detail, mib, count})"
        return tuple(from_dicts(raw)) if ok else self.valid(False, raw, where, expected, None)

    def size(self, raw: Any, where: str) -> SizeRecord | None:
        if not raw or not isinstance(raw, dict):
            return self.valid(isinstance(raw, dict), raw, where, "an object", None)
        values = self.fields(raw, SIZE_FIELDS, where)
        measured = SizeResult(**{attr[len("measured."):]: values.pop(attr) for attr in list(values)
                                 if attr.startswith("measured.")})
        checks = tuple(self.check(check, measured) for check in values.pop("checks"))
        return SizeRecord(measured=measured, checks=checks, **values)

    def check(self, values: dict[str, Any], size: SizeResult) -> Check:
        """A size's check, the size supplying what it shares with it; an older report's from its ``text``."""
        fields = {key: value for key, value in values.items() if key != "text"}
        if fields["making"] == "" and (sentence := _SENTENCE.fullmatch(values["text"])):
            fields.update(making=sentence["making"], rank_label=sentence["rank"])
        return Check(world_size=size.world_size, device=size.device, basis=size.basis, **fields)

    def changes(self, raw: Any, where: str) -> BaselineChange | None:
        if isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], int) and (
                raw[1] is None or _is_number(raw[1])) and _is_number(raw[2]):
            return BaselineChange(raw[0], None if raw[1] is None else float(raw[1]), float(raw[2]))
        return self.valid(False, raw, where, "[nproc, old MiB or null, new MiB]", None)

    def grown(self, item: Any, where: str) -> SiteChange | None:
        if not (isinstance(item, dict) and isinstance(item.get("site"), str) and _is_number(item.get("old_mib"))
                and _is_number(item.get("new_mib"))):
            return self.valid(False, item, where, "{site, old_mib, new_mib[, called_from, chains, kept_alive_by]}",
                              None)
        chain, chains, kept = item.get("called_from") or [], item.get("chains", 1), item.get("kept_alive_by", "")
        if not (isinstance(chain, list) and all(isinstance(c, str) for c in chain) and _is_int(chains, 1)
                and isinstance(kept, str)):
            return self.valid(False, item, where, "called_from: a list of strings, chains: an integer >= 1, "
                              "kept_alive_by: a string", None)
        return SiteChange(item["site"], float(item["old_mib"]), float(item["new_mib"]), tuple(chain), chains, kept)

    def limits(self, raw: Any, where: str) -> dict[str, Any]:
        """The marker's limits as marker arguments; null where the report names none (its default)."""
        return {key: value for key, value in self.fields(raw or {}, LIMIT_FIELDS, where).items() if value is not None}

    def ratio(self, value: Any, where: str) -> float | dict[int, float] | None:
        """``max_ratio``: a number, or a cap per size (``{"2": 0.8, "8": 0.6}``)."""
        if not isinstance(value, Mapping):
            return self.number(value, where)
        ok = all(isinstance(k, str) and k.isdigit() and _is_number(v) for k, v in value.items())
        return self.valid(ok, value, where, "a number, or an object from nproc to a number", None) and {
            int(k): float(v) for k, v in value.items()}

    def tolerance(self, value: Any, where: str) -> Tolerance | None:
        try:
            return None if not value else parse_tolerance(value)
        except SpecError as exc:
            self.problems.append(f"{where}: {exc}")
            return None

    def record(self, raw: Any, where: str) -> TestRecord | None:
        if not isinstance(raw, dict):
            return self.valid(False, raw, where, "an object", None)
        values = self.fields(raw, TEST_FIELDS, where)
        status, cause = values["status"], values["cause"]
        if status is None:
            values.update(status="failed", cause="crash")
        elif status in FAILED and cause not in CAUSES:
            self.bad(f"{where}.cause", f"one of {', '.join(CAUSES)} (the status is {status})", cause)
        elif status not in FAILED and cause is not None:
            self.bad(f"{where}.cause", f"null (the status is {status})", cause)
        nproc, launcher, limits = values.pop("spec.nproc"), values.pop("spec.launcher"), values.pop("spec")
        return TestRecord(spec=self.spec({"nproc": nproc, "launcher": launcher, **limits}, f"{where}.limits"),
                          **values)

    def spec(self, given: dict[str, Any], where: str) -> Spec:
        """The marker's Spec from what the report holds of it, the rest at its defaults; its
        checks hold the limits to one another (a rank below the smallest size, ...)."""
        if not self.problems:
            try:
                return parse_marker((), given, Defaults(launchers=(given["launcher"],)))
            except SpecError as exc:
                self.problems.append(f"{where}: {exc}")
        return parse_marker((), {}, Defaults())


_READ: dict[str, Callable[[_Reader, Any, str], Any]] = {
    "string": _Reader.string, "number": _Reader.number, "flag": lambda r, v, w: bool(
        r.valid(isinstance(v, bool) or v is None, v, w, "true or false", False)),
    "lines": _Reader.lines, "sorted lines": _Reader.lines, "world size": _Reader.world,
    "test id": lambda r, v, w: r.valid(isinstance(v, str) and bool(v), v, w, "a test id string", ""),
    "status": lambda r, v, w: r.valid(v in STATUSES, v, w, f"one of {', '.join(STATUSES)}", None),
    "cause": lambda r, v, w: v,  # held to the status by _Reader.record
    "nproc": lambda r, v, w: r.valid(isinstance(v, list) and all(type(n) is int for n in v), v, w,
                                     "a list of world sizes", []),
    "launcher": lambda r, v, w: r.string("direct" if v is None else v, w), "limits": _Reader.limits,
    "ratio": _Reader.ratio, "tolerance": _Reader.tolerance,
    "rank": lambda r, v, w: r.valid(v is None or _is_int(v, 0) or v == "all", v, w, "an integer >= 0 or 'all'", None),
    # 1 is the default, which the marker takes only beside max_ratio
    "reference": lambda r, v, w: r.valid(v is None or _is_int(v, 1), v, w, "an integer >= 1", None) if v != 1 else None,
    "sizes": lambda r, v, w: r.listed(v, w, r.size) if v is not None else r.valid(False, v, w, "a list", ()),
    "provenance": lambda r, v, w: {str(k): str(x) for k, x in (
        r.valid(isinstance(v, dict) or v is None, v, w, "an object", None) or {}).items()},
    "baseline changes": lambda r, v, w: r.listed(v, w, r.changes),
    "grown sites": lambda r, v, w: r.listed(v, w, r.grown),
    "rank or null": lambda r, v, w: r.valid(v is None or _is_int(v, 0), v, w, "a rank number or null", None),
    "checks": lambda r, v, w: r.listed(v, w, lambda c, at: r.fields(c, CHECK_FIELDS, at)),
    "check kind": lambda r, v, w: r.valid(v in CHECK_KINDS, v, w, f"one of {', '.join(CHECK_KINDS)}", ""),
    "sentence": _Reader.string, "floor": _Reader.floor, "seconds": lambda r, v, w: r.by_rank(v, w, r.mib),
    "duration": lambda r, v, w: r.number(v, w) or 0.0, "prediction": _Reader.prediction,
    "ranks": lambda r, v, w: tuple(r.valid(v is None or (isinstance(v, list) and all(_is_int(x, 0) for x in v)),
                                           v, w, "a list of rank numbers", None) or ()),
    # the per-rank kinds (results.size.Kind)
    "peak": lambda r, v, w: r.by_rank(v, w, lambda x, at: None if x is None else r.mib(x, at)),
    "mib": lambda r, v, w: r.by_rank(v, w, r.mib), "text": lambda r, v, w: r.by_rank(v, w, r.string),
    "allocated": lambda r, v, w: r.by_rank(v, w, r.allocated), "sites": lambda r, v, w: r.by_rank(v, w, r.sites),
    "curve": _Reader.timeline,
}


def _summary(problems: list[str]) -> str:
    """The first five problems, and how many more: one line a user reads to the end."""
    return "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")


def read_record(raw: Any, where: str = "record") -> TestRecord:
    """The record of :meth:`TestRecord.to_json`; ReportError names every bad field."""
    reader = _Reader()
    record = reader.record(raw, where)
    if reader.problems:
        raise ReportError(_summary(reader.problems))
    assert record is not None
    return record


def parse_report(doc: Any) -> list[TestRecord]:
    """The records of a ``--gpumem-report`` document (today's schema); ReportError lists the problems."""
    if not isinstance(doc, dict):
        raise ReportError(f"expected a JSON object with 'schema' and 'tests', got {type(doc).__name__}")
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema != SCHEMA:
        raise ReportError(f"schema: expected {SCHEMA} (a pytest --gpumem-report file of this pytest-gpumem), "
                          f"got {schema!r}")
    tests = doc.get("tests")
    if not isinstance(tests, list):
        raise ReportError(f"tests: expected a list of test records, got {type(tests).__name__}")
    records, problems = [], []
    for i, raw in enumerate(tests):
        try:
            records.append(read_record(raw, f"tests[{i}]"))
        except ReportError as exc:
            problems.append(str(exc))
    seen: set[str] = set()
    for i, rec in enumerate(records):
        if rec.test in seen:
            problems.append(f"tests[{i}].test: {rec.test!r} appears twice")
        seen.add(rec.test)
    if problems:
        raise ReportError(_summary(problems))
    return records


def load_report(path: Path | str) -> list[TestRecord]:
    """Read and validate a JSON report; every error message starts with the file's path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    try:
        return parse_report(doc)
    except ReportError as exc:
        raise ReportError(f"{path}: {exc}") from None
