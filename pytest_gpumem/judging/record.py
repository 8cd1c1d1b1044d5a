"""One test's result, typed: built once from the run and its verdict, rendered by every output.

The table, Markdown, JUnit properties, plots, benchmark JSON and ``gpumem diff`` read a
:class:`TestRecord` and derive nothing themselves: the gated rank is an int, each check carries its
own limit, each size says whether it failed. :meth:`TestRecord.to_json` / :meth:`TestRecord.from_json`
are the one (de)serializer, versioned by :data:`SCHEMA`; it travels to the xdist controller and into
``--gpumem-report`` files. Reports of schemas 1 (pytest-gpumem 0.2) to 3 are read too, so ``gpumem diff``
can compare against a report recorded before an upgrade.

A test's outcome is pytest's own word (:data:`STATUSES`), and a failed (or xfailed) test says what
failed in :data:`CAUSES`: a limit, a rank, or the baseline. Schemas 1 to 3 spelled outcomes
``pass``, ``FAIL``, ``ERROR``, ``skip``, ``XFAIL``, ``XPASS``; they are read into the new words.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

from ..config.spec import DEFAULT_ALLOCATED_TOLERANCE, DEFAULT_TOLERANCE, SpecError, parse_tolerance
from ..sampling.allocations import is_allocation_method

if TYPE_CHECKING:  # the builder's inputs; reading and rendering records needs neither
    from ..config.spec import Spec
    from .growth import Growth
    from .verdict import SizeResult, Verdict

# 3: allocator figures, peak sites, live curves, each check's figure; 4: pytest's words, a failure's cause
SCHEMA = 4
# pytest's words; "measured": `gpumem measure` without limits (launched and measured, nothing judged)
STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "measured")
# Why a test failed: a memory limit or baseline exceeded (or no figure to judge); a rank failed,
# died or hung (or the launch could not start); no comparable baseline where one is required (CI);
# a baseline file that could not be read or written; a test marked xfail(strict=True) that passed.
CAUSES = ("limit", "crash", "baseline-missing", "baseline-error", "xpass-strict")
FAILED = ("failed", "xfailed")  # the statuses that carry a cause
_OLD_STATUSES = {"pass": "passed", "FAIL": "failed", "ERROR": "failed", "skip": "skipped", "XFAIL": "xfailed",
                 "XPASS": "xpassed"}  # schemas 1 to 3
CHECK_KINDS = ("max_mib", "max_ratio", "baseline", "measured", "schema1")


class ReportError(ValueError):
    """A record or report that cannot be read; the message names the file, the field and what is accepted."""


@dataclass(frozen=True)
class Limits:
    """What the marker asked for (the marker's own values; ``tolerance`` as written)."""

    max_mib: float | None = None
    max_ratio: float | None = None
    allow_mib: float = 0.0
    rank: int | str = 0  # an int, or "all": the largest rank
    tolerance: str = str(DEFAULT_TOLERANCE)
    allocated_tolerance: str = str(DEFAULT_ALLOCATED_TOLERANCE)


@dataclass(frozen=True)
class RankPeak:
    mib: float | None
    method: str


@dataclass(frozen=True)
class CheckRecord:
    """One limit judged at one size: ``text`` is the sentence the user reads."""

    kind: str  # one of CHECK_KINDS
    ok: bool
    measured_mib: float | None
    limit_mib: float | None
    text: str
    figure: str = ""  # "device" (NVML), "allocated" (the GPU allocator's), "host"; "" in older reports
    advisory: bool = False  # a not-validated prediction: shown, never failing


@dataclass(frozen=True)
class AllocatedRecord:
    """A rank's GPU allocator figure: the peak of live tensors, and what the allocator reserved."""

    mib: float
    reserved_mib: float | None = None


@dataclass(frozen=True)
class SiteChange:
    """A peak site that grew (or is new: ``old_mib`` 0) against nproc=1 or the baseline."""

    label: str  # where it was allocated: "examples/test_torch_ddp.py:57 _train (all_gather)"
    old_mib: float
    new_mib: float
    callers: tuple[str, ...] = ()  # the user frames above it, innermost first: "train.py:25 train_step"
    chains: int = 1  # caller chains summed into the site (``callers`` is the largest one's)

    @property
    def growth(self) -> float:
        return self.new_mib - self.old_mib

    def line(self) -> str:
        """``+256.0 MiB  examples/test_torch_ddp.py:57 _train (all_gather)``: the line that allocated it."""
        new = "" if self.old_mib else "  (new)"
        return f"{self.growth:+.1f} MiB  {self.label}{new}"

    def called_from(self) -> list[str]:
        """``called from train.py:25 train_step`` per user frame above the allocating line: the
        caller is often the line that keeps the memory alive (a list that collects each step's output)."""
        lines = [f"called from {caller}" for caller in self.callers]
        if lines and self.chains > 1:
            others = self.chains - 1
            lines[-1] += f" (and {others} other call chain{'s' if others > 1 else ''})"
        return lines

    def lines(self) -> list[str]:
        """:meth:`line`, then its callers indented under the allocating line."""
        pad = " " * (len(f"{self.growth:+.1f} MiB  ") + 2)
        return [self.line()] + [pad + text for text in self.called_from()]

    def brief(self) -> str:
        """One line with the first caller: ``+64.0 MiB  model.py:18 forward  (new), called from train.py:25 step``."""
        return self.line() + (f", called from {self.callers[0]}" if self.callers else "")


@dataclass(frozen=True)
class FloorRecord:
    framework: str
    what: str  # "CUDA context + torch start-up + communicator"
    ranks: Mapping[int, float]
    cached: str | None = None  # the date it was measured, when it came from the floor cache


@dataclass(frozen=True)
class SizeRecord:
    """One world size of one test: the gated figure, every rank, the checks and their limits."""

    nproc: int
    device: str  # "gpu" | "cpu"
    gated_rank: int | None  # None: rank="all" with nothing measured
    gated_label: str  # "rank 0", "rank 3 (largest)"
    gated_mib: float | None
    ranks: Mapping[int, RankPeak] = field(default_factory=dict)
    checks: tuple[CheckRecord, ...] = ()
    ratio: float | None = None  # the ratio limit's figure over its nproc=1 value
    ratio_figure: str = ""  # which figure the ratio is of: "allocated" on a GPU with torch, else the gated one
    baseline_mib: float | None = None
    others_max_mib: float | None = None
    host_ranks: Mapping[int, float] = field(default_factory=dict)  # live allocations, where they were tracked
    rss_ranks: Mapping[int, float] = field(default_factory=dict)  # VmHWM, information only
    floor: FloorRecord | None = None
    peak_at_s: Mapping[int, float] = field(default_factory=dict)
    imbalance: float | None = None
    duration_s: float = 0.0
    reused: bool = False
    nodes: Mapping[int, str] = field(default_factory=dict)
    timeline: tuple[tuple[float, Mapping[int, float]], ...] = ()
    prediction: Mapping[str, Any] | None = None  # set: not launched (predict.Prediction.as_dict())
    allocated_ranks: Mapping[int, AllocatedRecord] = field(default_factory=dict)  # GPU allocator figures
    allocated_mib: float | None = None  # the gated rank's allocator figure (what allocated limits read)
    allocated_baseline_mib: float | None = None
    sites: Mapping[int, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)  # live at the peak
    live_timeline: tuple[tuple[float, Mapping[int, float]], ...] = ()  # the live figure over time
    start: str = ""  # how the ranks were started: fork, exec, or "exec (why not fork)"
    simulated: tuple[int, ...] = ()  # a simulated world: the ranks measured (verdict.SizeResult.simulated)

    @property
    def failed(self) -> bool:
        return any(not check.ok and not check.advisory for check in self.checks)

    @property
    def predicted(self) -> bool:
        return self.prediction is not None

    @property
    def validated(self) -> bool:
        """A measurement, or a prediction whose model was judged on sizes it did not see."""
        return self.prediction is None or self.prediction.get("loo_error") is not None

    @property
    def gated_method(self) -> str | None:
        """How the gated figure was measured (``per-pid sampled``, ``live allocations (memray)``, ...)."""
        peak = self.ranks.get(self.gated_rank) if self.gated_rank is not None else None
        return peak.method if peak is not None else None

    @property
    def basis(self) -> str:
        """``predicted by a + b*N from nproc 1,2,4; ...`` for a predicted size, else empty."""
        return "" if self.prediction is None else str(self.prediction.get("basis", "predicted"))

    def limits(self) -> list[CheckRecord]:
        """The checks that carry a limit in MiB (what a plot draws as lines)."""
        return [check for check in self.checks if check.limit_mib is not None]


@dataclass(frozen=True)
class BaselineChange:
    nproc: int
    old_mib: float | None  # None: a new entry
    new_mib: float


@dataclass(frozen=True)
class TestRecord:
    """Everything about one gpumem test that outlives the process."""

    __test__ = False  # not a pytest test class, whatever its name

    test: str
    status: str  # one of STATUSES
    nproc: tuple[int, ...]
    launcher: str = "direct"
    limits: Limits = Limits()
    sizes: tuple[SizeRecord, ...] = ()
    provenance: Mapping[str, str] = field(default_factory=dict)
    messages: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    baseline_changes: tuple[BaselineChange, ...] = ()
    changed_since_baseline: tuple[str, ...] = ()
    grown_sites: tuple[SiteChange, ...] = ()  # what grew at the failing size, largest first
    grown_against: str = ""  # "nproc=1" or "the baseline"
    sites_summary: str = ""  # what the listed sites leave out (shrunk, the framework's internals)
    cause: str | None = None  # one of CAUSES where status is failed or xfailed

    def with_status(self, status: str, cause: str | None = None) -> TestRecord:
        """The record under pytest's final word (``xfailed``, ``xpassed``); a failure keeps its cause."""
        return replace(self, status=status, cause=(cause or self.cause) if status in FAILED else None)

    def size(self, nproc: int) -> SizeRecord | None:
        return next((s for s in self.sizes if s.nproc == nproc), None)

    @property
    def digits(self) -> int:
        """Decimals of this test's MiB figures wherever they are shown: enough that each failed
        comparison reads apart (``505.44 > 505.38``), as in its failure text."""
        from .verdict import DIGITS, digits_to_tell

        return max((digits_to_tell(c.measured_mib, c.limit_mib) for size in self.sizes for c in size.checks
                    if not c.ok and c.measured_mib is not None and c.limit_mib is not None), default=DIGITS)

    @property
    def verdict(self) -> str:
        """The status, with the cause of a failure: ``failed (crash)``, ``xfailed (limit)``, ``passed``."""
        return f"{self.status} ({self.cause})" if self.cause and self.status in FAILED else self.status

    def size_verdict(self, size: SizeRecord) -> str:
        """The test's verdict, except ``ok`` for a size that passed its limits inside a test that
        failed (or xfailed) on a limit at another size."""
        if self.status in FAILED and self.cause == "limit" and not size.failed:
            return "ok"
        return self.verdict

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "status": self.status,
            "cause": self.cause,
            "nproc": list(self.nproc),
            "launcher": self.launcher,
            "limits": {"max_mib": self.limits.max_mib, "max_ratio": self.limits.max_ratio,
                       "allow_mib": self.limits.allow_mib, "rank": self.limits.rank,
                       "tolerance": self.limits.tolerance, "allocated_tolerance": self.limits.allocated_tolerance},
            "sizes": [_size_json(s) for s in self.sizes],
            "provenance": dict(self.provenance),
            "messages": list(self.messages),
            "notes": list(self.notes),
            "baseline_changes": [[c.nproc, c.old_mib, c.new_mib] for c in self.baseline_changes],
            "changed_since_baseline": list(self.changed_since_baseline),
            "grown_sites": [{"site": c.label, "old_mib": round(c.old_mib, 3), "new_mib": round(c.new_mib, 3),
                             **({"called_from": list(c.callers), "chains": c.chains} if c.callers else {})}
                            for c in self.grown_sites],
            "grown_against": self.grown_against,
            "sites_summary": self.sites_summary,
        }

    @classmethod
    def from_json(cls, raw: Any, where: str = "record", schema: int = SCHEMA) -> TestRecord:
        """The record of :meth:`to_json` (or of an older schema's report); ReportError names every bad field."""
        reader = _Reader()
        record = reader.record(raw, where, schema)
        if reader.problems:
            problems = reader.problems
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ReportError("; ".join(problems[:5]) + more)
        assert record is not None
        return record


def _keyed(values: Mapping[int, Any], convert: Callable[[Any], Any] = lambda v: v) -> dict[str, Any]:
    return {str(k): convert(v) for k, v in sorted(values.items())}


def _size_json(s: SizeRecord) -> dict[str, Any]:
    return {
        "nproc": s.nproc,
        "device": s.device,
        "gated_rank": s.gated_rank,
        "gated_label": s.gated_label,
        "gated_mib": s.gated_mib,
        # Side by side as in schema 1, so readers of either schema find a rank's figure the same way.
        "ranks": _keyed(s.ranks, lambda p: p.mib),
        "methods": _keyed(s.ranks, lambda p: p.method),
        "checks": [{"kind": c.kind, "ok": c.ok, "measured_mib": c.measured_mib, "limit_mib": c.limit_mib,
                    "text": c.text, "figure": c.figure, "advisory": c.advisory} for c in s.checks],
        "failed": s.failed,  # derived from the checks; kept for readers of schema 1
        "ratio": s.ratio,
        "ratio_figure": s.ratio_figure,
        "baseline_mib": s.baseline_mib,
        "others_max_mib": s.others_max_mib,
        "host_ranks": _keyed(s.host_ranks),
        "rss_ranks": _keyed(s.rss_ranks),
        "floor": None if s.floor is None else {"framework": s.floor.framework, "what": s.floor.what,
                                               "ranks": _keyed(s.floor.ranks), "cached": s.floor.cached},
        "peak_at_s": _keyed(s.peak_at_s),
        "imbalance": s.imbalance,
        "duration_s": s.duration_s,
        "start": s.start,
        "reused": s.reused,
        "nodes": _keyed(s.nodes),
        "timeline": [[t, _keyed(point)] for t, point in s.timeline],
        "predicted": None if s.prediction is None else dict(s.prediction),
        "simulated": list(s.simulated),
        "allocated_ranks": _keyed(s.allocated_ranks,
                                  lambda a: {"allocated_mib": a.mib, "reserved_mib": a.reserved_mib}),
        "allocated_mib": s.allocated_mib,
        "allocated_baseline_mib": s.allocated_baseline_mib,
        "sites": _keyed(s.sites, lambda sites: [dict(site) for site in sites]),
        "live_timeline": [[t, _keyed(point)] for t, point in s.live_timeline],
    }


# ---------------------------------------------------------------------------------------------- reading

T = TypeVar("T")
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,8}")
_LEGACY_LABEL = re.compile(r"rank (\d+)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Reader:
    """Collects every problem of a record instead of stopping at the first."""

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

    # -------------------------------------------------------------- the parts

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
        return Limits(max_mib=self.number(raw, "max_mib", where), max_ratio=self.number(raw, "max_ratio", where),
                      allow_mib=self.number(raw, "allow_mib", where) or 0.0, rank=rank, tolerance=str(tolerance),
                      allocated_tolerance=str(allocated))

    def check(self, raw: Any, where: str) -> CheckRecord:
        raw = self.obj(raw, where)
        kind = self.text(raw, "kind", where)
        if kind and kind not in CHECK_KINDS:
            self.bad(f"{where}.kind", f"one of {', '.join(CHECK_KINDS)}", kind)
        return CheckRecord(kind=kind, ok=self.flag(raw, "ok", where),
                           measured_mib=self.number(raw, "measured_mib", where),
                           limit_mib=self.number(raw, "limit_mib", where), text=self.text(raw, "text", where, ""),
                           figure=self.text(raw, "figure", where, ""), advisory=self.flag(raw, "advisory", where))

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

    def size(self, raw: Any, where: str, schema: int) -> SizeRecord | None:
        raw = self.obj(raw, where)
        if not raw:
            return None
        nproc = raw.get("nproc")
        if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
            self.bad(f"{where}.nproc", "an integer >= 1", nproc)
            nproc = 1
        gated_mib = self.number(raw, "gated_mib", where)
        floor_raw = raw.get("floor")
        floor = None
        if floor_raw is not None:
            f = self.obj(floor_raw, f"{where}.floor")
            floor = FloorRecord(self.text(f, "framework", f"{where}.floor", ""),
                                self.text(f, "what", f"{where}.floor", ""),
                                self.per_rank(f, "ranks", f"{where}.floor", self.mib),
                                self.optional_text(f, "cached", f"{where}.floor"))
        prediction = raw.get("predicted")
        if prediction is not None and not isinstance(prediction, dict):
            self.bad(f"{where}.predicted", "an object (the fit) or null", prediction)
            prediction = None
        mibs = self.per_rank(raw, "ranks", where, lambda v, w: None if v is None else self.mib(v, w))
        methods = self.per_rank(raw, "methods", where, self.string)
        ranks = {r: RankPeak(mibs.get(r), methods.get(r, "")) for r in sorted(set(mibs) | set(methods))}
        if schema == 1:
            gated_rank, checks = self._legacy(raw, where, gated_mib)
            label = str(raw.get("gated_rank") or "")
        else:
            gated_rank = raw.get("gated_rank")
            if gated_rank is not None and not (isinstance(gated_rank, int) and not isinstance(gated_rank, bool)
                                               and gated_rank >= 0):
                self.bad(f"{where}.gated_rank", "a rank number or null", gated_rank)
                gated_rank = None
            label = self.text(raw, "gated_label", where, "")
            checks_raw = raw.get("checks") or []
            if not isinstance(checks_raw, list):
                self.bad(f"{where}.checks", "a list", checks_raw)
                checks_raw = []
            checks = tuple(self.check(c, f"{where}.checks[{j}]") for j, c in enumerate(checks_raw))
        imbalance = self.number(raw, "imbalance", where)
        return SizeRecord(
            nproc=nproc, device=self.text(raw, "device", where, ""), gated_rank=gated_rank, gated_label=label,
            gated_mib=gated_mib, ranks=ranks, checks=checks, ratio=self.number(raw, "ratio", where),
            ratio_figure=self.text(raw, "ratio_figure", where, ""),
            baseline_mib=self.number(raw, "baseline_mib", where),
            others_max_mib=self.number(raw, "others_max_mib", where),
            host_ranks=self.per_rank(raw, "host_ranks", where, self._optional_mib),
            rss_ranks=self.per_rank(raw, "rss_ranks", where, self.mib), floor=floor,
            peak_at_s=self.per_rank(raw, "peak_at_s", where, self.mib), imbalance=imbalance,
            duration_s=self.number(raw, "duration_s", where) or 0.0, reused=self.flag(raw, "reused", where),
            start=self.text(raw, "start", where, ""),
            nodes=self.per_rank(raw, "nodes", where, self.string),
            timeline=self.timeline(raw.get("timeline") or [], f"{where}.timeline"), prediction=prediction,
            allocated_ranks=self.per_rank(raw, "allocated_ranks", where, self._allocated),
            allocated_mib=self.number(raw, "allocated_mib", where),
            allocated_baseline_mib=self.number(raw, "allocated_baseline_mib", where),
            sites=self.per_rank(raw, "sites", where, self._sites),
            live_timeline=self.timeline(raw.get("live_timeline") or [], f"{where}.live_timeline"),
            simulated=self._ranks(raw.get("simulated") or [], f"{where}.simulated"))

    def _ranks(self, raw: Any, where: str) -> tuple[int, ...]:
        if not isinstance(raw, list) or not all(type(r) is int and r >= 0 for r in raw):
            self.bad(where, "a list of rank numbers", raw)
            return ()
        return tuple(raw)

    def _allocated(self, raw: Any, where: str) -> AllocatedRecord | None:
        raw = self.obj(raw, where)
        mib = self.number(raw, "allocated_mib", where, optional=False)
        return None if mib is None else AllocatedRecord(mib, self.number(raw, "reserved_mib", where))

    def _sites(self, raw: Any, where: str) -> tuple[Mapping[str, Any], ...] | None:
        if not (isinstance(raw, list) and all(isinstance(s, dict) and isinstance(s.get("where"), str)
                                              and _is_number(s.get("mib")) for s in raw)):
            self.bad(where, "a list of sites ({where, function, detail, mib, count})", raw)
            return None
        return tuple(raw)

    def _optional_mib(self, raw: Any, where: str) -> float | None:
        return None if raw is None else self.mib(raw, where)

    def _legacy(self, raw: Mapping[str, Any], where: str,
                gated_mib: float | None) -> tuple[int | None, tuple[CheckRecord, ...]]:
        """Schema 1 named the gated rank by its label and kept only a ``failed`` flag per size."""
        match = _LEGACY_LABEL.match(str(raw.get("gated_rank") or ""))
        failed = self.flag(raw, "failed", where)
        check = CheckRecord("schema1", not failed, gated_mib, None,
                            "failed (schema 1 record: the limit was not recorded)" if failed else "passed")
        return (int(match.group(1)) if match else None), (check,)

    def record(self, raw: Any, where: str, schema: int) -> TestRecord | None:
        if not isinstance(raw, dict):
            self.bad(where, "an object", raw)
            return None
        test = raw.get("test")
        if not isinstance(test, str) or not test:
            self.bad(f"{where}.test", "a test id string", test)
            test = ""
        status = raw.get("status")
        accepted = STATUSES if schema >= 4 else tuple(_OLD_STATUSES)
        valid = status in accepted
        if not valid:
            self.bad(f"{where}.status", f"one of {', '.join(accepted)}", status)
            status = "failed" if schema >= 4 else "ERROR"
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
                      if (s := self.size(item, f"{where}.sizes[{j}]", schema)) is not None)
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
        if schema >= 4:
            cause = raw.get("cause")
            if not valid:
                cause = "crash"
            elif status in FAILED and cause not in CAUSES:
                self.bad(f"{where}.cause", f"one of {', '.join(CAUSES)} (the status is {status})", cause)
                cause = "crash"
            elif status not in FAILED and cause is not None:
                self.bad(f"{where}.cause", f"null (the status is {status})", cause)
                cause = None
        else:
            status, cause = _old_status(str(status), messages, sizes)
        return TestRecord(
            test=test, status=str(status), nproc=tuple(nproc), launcher=self.text(raw, "launcher", where, "direct"),
            limits=limits, sizes=sizes, provenance={str(k): str(v) for k, v in provenance.items()},
            messages=messages, notes=self.texts(raw, "notes", where),
            baseline_changes=tuple(changes), changed_since_baseline=self.texts(raw, "changed_since_baseline", where),
            grown_sites=tuple(grown), grown_against=self.text(raw, "grown_against", where, ""),
            sites_summary=self.text(raw, "sites_summary", where, ""), cause=cause)


def _old_status(status: str, messages: tuple[str, ...], sizes: tuple[SizeRecord, ...]) -> tuple[str, str | None]:
    """A schema-1/2/3 status in today's words, and the cause its record shows: ``FAIL`` was a limit;
    ``ERROR`` a failed launch or a baseline problem (told apart by its message); an ``XFAIL`` failed
    either way."""
    new = _OLD_STATUSES[status]
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


# ---------------------------------------------------------------------------------------------- reports


def report_document(records: Iterable[TestRecord]) -> dict[str, Any]:
    """What ``--gpumem-report`` writes: ``{"schema": 4, "tests": [...]}``, sorted by test id."""
    return {"schema": SCHEMA, "tests": [r.to_json() for r in sorted(records, key=lambda r: r.test)]}


def parse_report(doc: Any) -> list[TestRecord]:
    """The records of a ``--gpumem-report`` document (schema 1 to 4); ReportError lists the problems."""
    if not isinstance(doc, dict):
        raise ReportError(f"expected a JSON object with 'schema' and 'tests', got {type(doc).__name__}")
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or not 1 <= schema <= SCHEMA:
        raise ReportError(f"schema: expected 1 to {SCHEMA} (a pytest --gpumem-report file), got {schema!r}")
    tests = doc.get("tests")
    if not isinstance(tests, list):
        raise ReportError(f"tests: expected a list of test records, got {type(tests).__name__}")
    records, problems = [], []
    for i, raw in enumerate(tests):
        try:
            records.append(TestRecord.from_json(raw, f"tests[{i}]", schema))
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


# ---------------------------------------------------------------------------------------------- building


class Run(Protocol):
    """What the builder reads of a run (``launching.runner.TestRun``, which sits a layer above)."""

    @property
    def test_id(self) -> str: ...
    @property
    def spec(self) -> Spec: ...
    @property
    def results(self) -> list[SizeResult]: ...
    @property
    def provenance(self) -> dict[str, str]: ...


def build(test: Run, verdict: Verdict | None, status: str, *, cause: str | None = None,
          baselines: Mapping[int, float] | None = None, allocated_baselines: Mapping[int, float] | None = None,
          changes: Sequence[BaselineChange] = (), changed: Sequence[str] = (),
          messages: Sequence[str] | None = None, growth: Growth | None = None) -> TestRecord:
    """The record of one test, from its run and its verdict: the one place that derives these facts."""
    from .explain import imbalance, peak_times

    spec = test.spec
    checks: dict[int, list[CheckRecord]] = {}
    digits = verdict.digits if verdict is not None else 1  # the failure text's precision, in every sentence
    for check in verdict.checks if verdict is not None else ():
        checks.setdefault(check.world_size, []).append(
            CheckRecord(check.kind, check.ok, check.measured_mib, check.limit_mib, check.text(digits),
                        check.figure, check.advisory))
    sizes = []
    for result in test.results:
        n = result.world_size
        label, gated = result.gated(spec.rank)
        floor = result.floor
        sizes.append(SizeRecord(
            nproc=n,
            device=result.device,
            gated_rank=result.gated_rank(spec.rank),
            gated_label=label,
            gated_mib=gated,
            ranks={r: RankPeak(p.mib, p.method) for r, p in sorted(result.peaks.items())},
            checks=tuple(checks.get(n, ())),
            ratio=verdict.ratio(n) if verdict is not None else None,
            ratio_figure=_ratio_figure(test.results, result, spec) if verdict is not None else "",
            baseline_mib=(baselines or {}).get(n),
            others_max_mib=result.others_max(spec.rank),
            # Live allocations only: where the ranks were not tracked (GPU figures) VmHWM is in rss_ranks.
            host_ranks={r: p.mib for r, p in sorted(result.host_peaks.items())
                        if p.mib is not None and is_allocation_method(p.method)},
            rss_ranks={r: round(mib, 1) for r, mib in sorted(result.rss_peaks.items())},
            floor=None if floor is None else FloorRecord(floor.framework, floor.describe(result.device, n),
                                                         {r: round(m, 1) for r, m in sorted(floor.ranks.items())},
                                                         floor.cached),
            peak_at_s={r: round(t, 3) for r, t in sorted(peak_times(result).items())},
            imbalance=imbalance(result),
            duration_s=round(result.duration_s, 3),
            start=result.start,
            reused=result.reused,
            nodes=dict(sorted(result.nodes.items())),
            timeline=tuple((round(t, 4), {r: round(v, 2) for r, v in point.items()}) for t, point in result.timeline),
            # Not launched: fitted from the launched sizes (model, its LOO error, the points).
            prediction=result.prediction.as_dict() if result.prediction is not None else None,
            allocated_ranks={r: AllocatedRecord(round(a.mib, 2), None if a.reserved_mib is None
                                                else round(a.reserved_mib, 2))
                             for r, a in sorted(result.allocated.items())},
            allocated_mib=_allocated_reading(result, spec),
            allocated_baseline_mib=(allocated_baselines or {}).get(n),
            sites={r: tuple(site.as_dict() for site in sites) for r, sites in sorted(result.sites.items())},
            live_timeline=tuple((round(t, 4), {r: round(v, 2) for r, v in point.items()})
                                for t, point in result.live_timeline),
            simulated=result.simulated,
        ))
    if messages is None:
        messages = [c.text(verdict.digits) for c in verdict.failures] if verdict is not None else []
    return TestRecord(
        test=test.test_id,
        status=status,
        nproc=tuple(spec.nproc),
        launcher=spec.launcher,
        limits=Limits(spec.max_mib, spec.max_ratio, spec.allow_mib, spec.rank, str(spec.tolerance),
                      str(spec.allocated_tolerance)),
        sizes=tuple(sizes),
        provenance=dict(test.provenance),
        messages=tuple(messages),
        notes=tuple(verdict.notes) if verdict is not None else (),
        baseline_changes=tuple(changes),
        changed_since_baseline=tuple(changed),
        grown_sites=tuple(growth.grown) if growth is not None else (),
        grown_against=growth.against if growth is not None else "",
        sites_summary=growth.summary() if growth is not None else "",
        cause=cause,
    )


def _ratio_figure(results: Sequence[SizeResult], result: SizeResult, spec: Spec) -> str:
    from .verdict import ratio_figures

    one = next((r for r in results if r.world_size == 1), None)
    if one is None or result.world_size == 1:
        return ""
    return ratio_figures(spec, one, result)[2]


def _allocated_reading(result: SizeResult, spec: Spec) -> float | None:
    """The gated rank's allocator figure, as an allocated limit reads it (None: there is none)."""
    _, mib, figure = result.read(spec.rank, "allocated")
    return round(mib, 2) if figure == "allocated" and mib is not None else None
