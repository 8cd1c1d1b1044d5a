"""Records read back from JSON: a ``--gpumem-report`` file, or the record a worker sends the xdist
controller. Every bad field is named (file, field, what is accepted), all of them at once. Only
today's schema is read: no earlier one was released.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar, cast

from ..config.spec import DEFAULT_ALLOCATED_TOLERANCE, DEFAULT_TOLERANCE, Ratio, SpecError, parse_tolerance
from ..measurement.predict import MODELS_BY_NAME, Candidate, Fit, Prediction
from ..measurement.size import LINES, PER_RANK, FloorResult, PerRank, SizeResult
from ..sampling import AllocatedPeak, Peak
from ..sampling.sites import Site, from_dicts
from .record import (
    CAUSES,
    CHECK_KINDS,
    FAILED,
    SCHEMA,
    STATUSES,
    BaselineChange,
    Cause,
    CheckRecord,
    Limits,
    ReportError,
    SiteChange,
    SizeRecord,
    Status,
    TestRecord,
)

T = TypeVar("T")
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,8}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Fields:
    """Reads one field at a time, collecting every problem of a record instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, where: str, expected: str, got: Any) -> None:
        shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)
        self.problems.append(f"{where}: expected {expected}, got {shown}")

    def obj(self, raw: Any, where: str) -> Mapping[str, Any]:
        if isinstance(raw, dict):
            return raw
        self.bad(where, "an object", raw)
        return {}

    def text(self, raw: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
        value = raw.get(key, default)
        if isinstance(value, str):
            return value
        self.bad(f"{where}.{key}", "a string", value)
        return ""

    def optional_text(self, raw: Mapping[str, Any], key: str, where: str) -> str | None:
        value = raw.get(key)
        if value is None or isinstance(value, str):
            return value
        self.bad(f"{where}.{key}", "a string or null", value)
        return None

    def number(self, raw: Mapping[str, Any], key: str, where: str, optional: bool = True) -> float | None:
        value = raw.get(key)
        if value is None and optional:
            return None
        if isinstance(value, (int, float)) and _is_number(value):
            return float(value)
        self.bad(f"{where}.{key}", "a finite number" + (" or null" if optional else ""), value)
        return None

    def flag(self, raw: Mapping[str, Any], key: str, where: str) -> bool:
        value = raw.get(key, False)
        if isinstance(value, bool):
            return value
        self.bad(f"{where}.{key}", "true or false", value)
        return False

    def texts(self, raw: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
        value = raw.get(key) or []
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        self.bad(f"{where}.{key}", "a list of strings", value)
        return ()

    def per_rank(self, raw: Mapping[str, Any], key: str, where: str,
                 convert: Callable[[Any, str], T | None]) -> dict[int, T]:
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            self.bad(f"{where}.{key}", "an object keyed by rank", value)
            return {}
        out: dict[int, T] = {}
        for rank, item in value.items():
            if not (isinstance(rank, str) and _RANK_KEY.fullmatch(rank)):
                self.bad(f"{where}.{key}", "rank keys '0', '1', ...", rank)
                continue
            converted = convert(item, f"{where}.{key}.{rank}")
            if converted is not None:
                out[int(rank)] = converted
        return out

    def mib(self, value: Any, where: str) -> float | None:
        if _is_number(value):
            return float(value)
        self.bad(where, "a finite number of MiB", value)
        return None

    def string(self, value: Any, where: str) -> str | None:
        if isinstance(value, str):
            return value
        self.bad(where, "a string", value)
        return None



class _Reader(_Fields):
    """A record's parts: its limits, its checks, its sizes, the record itself."""

    def limits(self, raw: Any, where: str) -> Limits:
        raw = self.obj(raw if raw is not None else {}, where)
        rank = raw.get("rank", 0)
        if not ((isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0) or rank == "all"):
            self.bad(f"{where}.rank", "an integer >= 0 or 'all'", rank)
            rank = 0
        tolerance = raw.get("tolerance") or str(DEFAULT_TOLERANCE)
        allocated = raw.get("allocated_tolerance") or str(DEFAULT_ALLOCATED_TOLERANCE)
        for key, value in (("tolerance", tolerance), ("allocated_tolerance", allocated)):
            try:
                parse_tolerance(value)
            except SpecError as exc:
                self.problems.append(f"{where}.{key}: {exc}")
        reference = raw.get("reference", 1)
        if isinstance(reference, bool) or not isinstance(reference, int) or reference < 1:
            self.bad(f"{where}.reference", "an integer >= 1", reference)
            reference = 1
        return Limits(max_mib=self.number(raw, "max_mib", where), max_ratio=_ratio(self, raw, where),
                      allow_mib=self.number(raw, "allow_mib", where) or 0.0, rank=rank, tolerance=str(tolerance),
                      allocated_tolerance=str(allocated), reference=reference)

    def check(self, raw: Any, where: str) -> CheckRecord:
        raw = self.obj(raw, where)
        kind = self.text(raw, "kind", where)
        if kind and kind not in CHECK_KINDS:
            self.bad(f"{where}.kind", f"one of {', '.join(CHECK_KINDS)}", kind)
        return CheckRecord(kind=kind, ok=self.flag(raw, "ok", where),
                           measured_mib=self.number(raw, "measured_mib", where),
                           limit_mib=self.number(raw, "limit_mib", where), text=self.text(raw, "text", where, ""),
                           figure=self.text(raw, "figure", where, ""), advisory=self.flag(raw, "advisory", where),
                           own=self.flag(raw, "own", where))

    def timeline(self, raw: Any, where: str) -> tuple[tuple[float, Mapping[int, float]], ...]:
        if not isinstance(raw, list):
            self.bad(where, "a list of [seconds, {rank: MiB}] points", raw)
            return ()
        points = []
        for i, point in enumerate(raw):
            if not (isinstance(point, list) and len(point) == 2 and _is_number(point[0])):
                self.bad(f"{where}[{i}]", "[seconds, {rank: MiB}]", point)
                continue
            values = self.per_rank({"v": point[1]}, "v", f"{where}[{i}]", self.mib)
            points.append((float(point[0]), values))
        return tuple(points)

    def size(self, raw: Any, where: str) -> SizeRecord | None:
        raw = self.obj(raw, where)
        if not raw:
            return None
        gated_rank = raw.get("gated_rank")
        if gated_rank is not None and not (isinstance(gated_rank, int) and not isinstance(gated_rank, bool)
                                           and gated_rank >= 0):
            self.bad(f"{where}.gated_rank", "a rank number or null", gated_rank)
            gated_rank = None
        checks_raw = raw.get("checks") or []
        if not isinstance(checks_raw, list):
            self.bad(f"{where}.checks", "a list", checks_raw)
            checks_raw = []
        return SizeRecord(
            measured=self.measured(raw, where), gated_rank=gated_rank,
            gated_label=self.text(raw, "gated_label", where, ""), gated_mib=self.number(raw, "gated_mib", where),
            checks=tuple(self.check(c, f"{where}.checks[{j}]") for j, c in enumerate(checks_raw)),
            ratio=self.number(raw, "ratio", where), ratio_figure=self.text(raw, "ratio_figure", where, ""),
            baseline_mib=self.number(raw, "baseline_mib", where),
            others_max_mib=self.number(raw, "others_max_mib", where),
            peak_at_s=self.per_rank(raw, "peak_at_s", where, self.mib), imbalance=self.number(raw, "imbalance", where),
            allocated_mib=self.number(raw, "allocated_mib", where),
            allocated_baseline_mib=self.number(raw, "allocated_baseline_mib", where))

    def measured(self, raw: Mapping[str, Any], where: str) -> SizeResult:
        """The measurement a size record holds, back in its own type (``measurement.size.SizeResult``)."""
        nproc = raw.get("nproc")
        if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
            self.bad(f"{where}.nproc", "an integer >= 1", nproc)
            nproc = 1
        floor_raw = raw.get("floor")
        floor = None
        if floor_raw is not None:
            f = self.obj(floor_raw, f"{where}.floor")
            floor = FloorResult(self.text(f, "framework", f"{where}.floor", ""),
                                self.per_rank(f, "ranks", f"{where}.floor", self.mib),
                                self.optional_text(f, "cached", f"{where}.floor"))
        return SizeResult(
            world_size=nproc, device=self.text(raw, "device", where, ""),
            platform=self.text(raw, "platform", where, ""), floor=floor,
            duration_s=self.number(raw, "duration_s", where) or 0.0, reused=self.flag(raw, "reused", where),
            prediction=self.prediction(raw.get("predicted"), nproc, f"{where}.predicted"),
            allocated_prediction=self.prediction(raw.get("allocated_predicted"), nproc,
                                                 f"{where}.allocated_predicted"),
            start=self.text(raw, "start", where, ""),
            simulated=self._ranks(raw.get("simulated") or [], f"{where}.simulated"),
            fake_gpu=self.text(raw, "fake_gpu", where, ""),
            **{field.name: self._per_rank_field(field, raw, where) for field in PER_RANK})

    def _per_rank_field(self, f: PerRank, raw: Mapping[str, Any], where: str) -> Any:
        """A per-rank field of :class:`SizeResult`, from the key(s) ``record._size_json`` wrote it under."""
        if f.kind in LINES:
            return self.texts(raw, f.json, where)
        if f.kind == "curve":
            return self.timeline(raw.get(f.json) or [], f"{where}.{f.json}")
        read = {"peak": lambda v, w: None if v is None else self.mib(v, w), "mib": self.mib, "text": self.string,
                "allocated": self._allocated, "sites": self._sites}[f.kind]
        values: dict[int, Any] = self.per_rank(raw, f.json, where, read)
        if not f.methods:
            return values
        how = self.per_rank(raw, f.methods, where, self.string)  # a peak's: how each figure was taken
        return {r: Peak(values.get(r), how.get(r, "")) for r in sorted(set(values) | set(how))}

    def prediction(self, raw: Any, world_size: int, where: str) -> Prediction | None:
        """A fitted figure (``Prediction.as_dict``) back as the fit it was; null: a measured size."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.bad(where, "an object (the fit) or null", raw)
            return None
        model = MODELS_BY_NAME.get(str(raw.get("model")))
        if model is None:
            self.bad(f"{where}.model", f"one of {', '.join(MODELS_BY_NAME)}", raw.get("model"))
            return None
        coefficients = raw.get("coefficients")
        if not (isinstance(coefficients, list) and len(coefficients) == model.params
                and all(_is_number(c) for c in coefficients)):
            self.bad(f"{where}.coefficients", f"{model.params} numbers (model {model.name})", coefficients)
            return None
        mib = self.number(raw, "mib", where, optional=False)
        floor_size = raw.get("floor_size")
        if floor_size is not None and not (type(floor_size) is int and floor_size >= 1):
            self.bad(f"{where}.floor_size", "an integer >= 1 or null", floor_size)
            floor_size = None
        fit = Fit(model, tuple(float(c) for c in coefficients), self._points(raw, "fitted_on", where),
                  self.number(raw, "loo_error", where),
                  self._candidates(raw, "candidates", where),
                  self._points(raw, "left_out", where), self.number(raw, "loo_error_with_left_out", where))
        return Prediction(world_size=world_size, mib=mib or 0.0, fit=fit,
                          rank_label=self.text(raw, "rank", where, "rank 0"),
                          floor_mib=self.number(raw, "floor_mib", where), floor_size=floor_size)

    def _candidates(self, raw: Mapping[str, Any], key: str, where: str) -> tuple[Candidate, ...]:
        """A fit's candidate models (model name -> its LOO error, or null where it was not judged)."""
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            self.bad(f"{where}.{key}", "an object of model name -> LOO error", value)
            return ()
        out = []
        for name, loo in value.items():
            if name not in MODELS_BY_NAME or not (loo is None or _is_number(loo)):
                self.bad(f"{where}.{key}.{name}", f"a model ({', '.join(MODELS_BY_NAME)}) -> a number or null", loo)
                continue
            out.append(Candidate(MODELS_BY_NAME[name], None if loo is None else float(loo)))
        return tuple(out)

    def _points(self, raw: Mapping[str, Any], key: str, where: str) -> tuple[tuple[int, float], ...]:
        return tuple(sorted(self.per_rank(raw, key, where, self.mib).items()))

    def _ranks(self, raw: Any, where: str) -> tuple[int, ...]:
        if not isinstance(raw, list) or not all(type(r) is int and r >= 0 for r in raw):
            self.bad(where, "a list of rank numbers", raw)
            return ()
        return tuple(raw)

    def _allocated(self, raw: Any, where: str) -> AllocatedPeak | None:
        raw = self.obj(raw, where)
        mib = self.number(raw, "allocated_mib", where, optional=False)
        return None if mib is None else AllocatedPeak(mib, self.number(raw, "reserved_mib", where), "torch")

    def _sites(self, raw: Any, where: str) -> tuple[Site, ...] | None:
        if not (isinstance(raw, list) and all(isinstance(s, dict) and isinstance(s.get("where"), str)
                                              and _is_number(s.get("mib")) for s in raw)):
            self.bad(where, "a list of sites ({where, function, detail, mib, count})", raw)
            return None
        return tuple(from_dicts(raw))

    def record(self, raw: Any, where: str) -> TestRecord | None:
        if not isinstance(raw, dict):
            self.bad(where, "an object", raw)
            return None
        test = raw.get("test")
        if not isinstance(test, str) or not test:
            self.bad(f"{where}.test", "a test id string", test)
            test = ""
        word = raw.get("status")
        valid = word in STATUSES
        if not valid:
            self.bad(f"{where}.status", f"one of {', '.join(STATUSES)}", word)
            word = "failed"
        messages = tuple(str(m) for m in raw.get("messages") or [])
        nproc = raw.get("nproc") or []
        if not (isinstance(nproc, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in nproc)):
            self.bad(f"{where}.nproc", "a list of world sizes", nproc)
            nproc = []
        limits = self.limits(raw.get("limits"), f"{where}.limits")
        sizes_raw = raw.get("sizes")
        if not isinstance(sizes_raw, list):
            self.bad(f"{where}.sizes", "a list", sizes_raw)
            sizes_raw = []
        sizes = tuple(s for j, item in enumerate(sizes_raw)
                      if (s := self.size(item, f"{where}.sizes[{j}]")) is not None)
        provenance = raw.get("provenance") or {}
        if not isinstance(provenance, dict):
            self.bad(f"{where}.provenance", "an object", provenance)
            provenance = {}
        changes = []
        for j, change in enumerate(raw.get("baseline_changes") or []):
            if (isinstance(change, list) and len(change) == 3 and isinstance(change[0], int)
                    and (change[1] is None or _is_number(change[1])) and _is_number(change[2])):
                changes.append(BaselineChange(change[0], None if change[1] is None else float(change[1]),
                                              float(change[2])))
            else:
                self.bad(f"{where}.baseline_changes[{j}]", "[nproc, old MiB or null, new MiB]", change)
        grown = []
        for j, item in enumerate(raw.get("grown_sites") or []):
            if (isinstance(item, dict) and isinstance(item.get("site"), str) and _is_number(item.get("old_mib"))
                    and _is_number(item.get("new_mib"))):
                chain = item.get("called_from") or []
                chains = item.get("chains", 1)
                if (isinstance(chain, list) and all(isinstance(c, str) for c in chain)
                        and type(chains) is int and chains >= 1):
                    grown.append(SiteChange(item["site"], float(item["old_mib"]), float(item["new_mib"]),
                                            tuple(chain), chains))
                else:
                    self.bad(f"{where}.grown_sites[{j}]", "called_from: a list of strings, chains: an integer >= 1",
                             item)
            else:
                self.bad(f"{where}.grown_sites[{j}]", "{site, old_mib, new_mib[, called_from, chains]}", item)
        status: Status
        cause: Cause | None
        status, cause = cast(Status, word), raw.get("cause")  # one of STATUSES, checked above
        if not valid:
            cause = "crash"
        elif status in FAILED and cause not in CAUSES:
            self.bad(f"{where}.cause", f"one of {', '.join(CAUSES)} (the status is {status})", cause)
            cause = "crash"
        elif status not in FAILED and cause is not None:
            self.bad(f"{where}.cause", f"null (the status is {status})", cause)
            cause = None
        return TestRecord(
            test=test, status=status, nproc=tuple(nproc), launcher=self.text(raw, "launcher", where, "direct"),
            limits=limits, sizes=sizes, provenance={str(k): str(v) for k, v in provenance.items()},
            messages=messages, notes=self.texts(raw, "notes", where),
            baseline_changes=tuple(changes), changed_since_baseline=self.texts(raw, "changed_since_baseline", where),
            grown_sites=tuple(grown), grown_against=self.text(raw, "grown_against", where, ""),
            sites_summary=self.text(raw, "sites_summary", where, ""),
            conversions=self.texts(raw, "conversions", where), cause=cause)


def read_record(raw: Any, where: str = "record") -> TestRecord:
    """The record of :meth:`TestRecord.to_json`; ReportError names every bad field."""
    reader = _Reader()
    record = reader.record(raw, where)
    if reader.problems:
        problems = reader.problems
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ReportError("; ".join(problems[:5]) + more)
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
        raise ReportError("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
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


def _ratio(reader: _Reader, raw: Mapping[str, Any], where: str) -> Ratio | None:
    """``max_ratio``: a number, or a cap per size (``{"2": 0.8, "8": 0.6}``)."""
    value = raw.get("max_ratio")
    if not isinstance(value, Mapping):
        flat = reader.number(raw, "max_ratio", where)
        return None if flat is None else Ratio(flat=flat)
    if not all(isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool)
               and _is_number(v) for k, v in value.items()):
        reader.bad(f"{where}.max_ratio", "a number, or an object from nproc to a number", value)
        return None
    return Ratio(sizes=tuple(sorted((int(k), float(v)) for k, v in value.items())))
