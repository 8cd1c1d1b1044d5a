"""One test's result, typed: what every output renders, and its JSON.

The table, Markdown, JUnit properties, plots, benchmark JSON and ``gpumem diff`` read a
:class:`TestRecord` and derive nothing themselves: the gated rank is an int, each check is the verdict's
own :class:`~.verdict.Check`, each size says whether it failed. Its JSON is declared once, field by field
(:data:`TEST_FIELDS`, :data:`SIZE_FIELDS`, ...): :func:`write` writes it, versioned by :data:`SCHEMA`,
to the xdist controller and into ``--gpumem-report`` files, and :mod:`.record_reader` reads it back
from the same declaration; :func:`.assemble.build` makes a record from a run and its verdict.

A test's outcome is pytest's own word (:data:`Status`), and a failed (or xfailed) test says what
failed (:data:`Cause`): a limit, a rank, or the baseline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Callable, Iterable, Literal, Mapping, get_args

from ..config.spec import Spec
from ..results.size import PER_RANK, FloorResult, SizeResult
from ..sampling import AllocatedPeak
from .verdict import DIGITS, Check, digits_to_tell

# 3: allocator figures, peak sites, live curves, each check's figure; 4: pytest's words, a failure's cause
SCHEMA = 4
# pytest's words; "measured": `gpumem measure` without limits (launched and measured, nothing judged)
Status = Literal["passed", "failed", "skipped", "xfailed", "xpassed", "measured"]
STATUSES: tuple[Status, ...] = get_args(Status)
# Why a test failed: a memory limit or baseline exceeded (or no figure to judge); a rank failed,
# died or hung (or the launch could not start); no comparable baseline where one is required (CI);
# a baseline file that could not be read or written; a test marked xfail(strict=True) that passed.
Cause = Literal["limit", "crash", "baseline-missing", "baseline-error", "xpass-strict"]
CAUSES: tuple[Cause, ...] = get_args(Cause)
FAILED: tuple[Status, ...] = ("failed", "xfailed")  # the statuses that carry a cause
CHECK_KINDS = ("max_mib", "max_ratio", "baseline", "measured", "uncounted")


class ReportError(ValueError):
    """A record or report that cannot be read; the message names the file, the field and what is accepted."""


@dataclass(frozen=True)
class SiteChange:
    """A peak site that grew (or is new: ``old_mib`` 0) against nproc=1 or the baseline."""

    label: str  # where it was allocated: "examples/test_torch_ddp.py:57 _train (all_gather)"
    old_mib: float
    new_mib: float
    callers: tuple[str, ...] = ()  # the user frames above it, innermost first: "train.py:25 train_step"
    chains: int = 1  # caller chains summed into the site (``callers`` is the largest one's)
    kept_alive_by: str = ""  # what keeps its bytes alive at the peak: "train.py:63 (list 'kept', append; 4 tensors)"

    @property
    def growth(self) -> float:
        return self.new_mib - self.old_mib

    def line(self) -> str:
        """``+256.0 MiB  examples/test_torch_ddp.py:57 _train (all_gather)``: the line that allocated it;
        where the holder is known, it comes first: ``+125.0 MiB  kept alive by train.py:63 (list 'kept',
        append; 4 tensors), allocated at model.py:59 forward``."""
        new = "" if self.old_mib else "  (new)"
        kept = f"kept alive by {self.kept_alive_by}, allocated at " if self.kept_alive_by else ""
        return f"{self.growth:+.1f} MiB  {kept}{self.label}{new}"

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
        """:meth:`lines` on one line, for Markdown: ``+64.0 MiB  model.py:18 forward  (new), called from
        train.py:25 step ← test_train.py:9 test_step``."""
        chain = " ← ".join(line.removeprefix("called from ") for line in self.called_from())
        return self.line() + (f", called from {chain}" if chain else "")


@dataclass(frozen=True)
class SizeRecord:
    """One world size of one test: what was measured there, as the launch read it, and what was
    judged of it (the gated figure, the checks and their limits, the baseline)."""

    measured: SizeResult  # every rank's figures, the floor, the curves, the sites: the one measurement type
    gated_rank: int | None  # None: rank="all" with nothing measured
    gated_label: str  # "rank 0", "rank 3 (largest)"
    gated_mib: float | None
    checks: tuple[Check, ...] = ()
    ratio: float | None = None  # the ratio limit's figure over its value at the reference size
    ratio_figure: str = ""  # which figure the ratio is of: "allocated" on a GPU with torch, else the gated one
    baseline_mib: float | None = None
    others_max_mib: float | None = None
    peak_at_s: Mapping[int, float] = field(default_factory=dict)
    imbalance: float | None = None
    allocated_mib: float | None = None  # the gated rank's allocator figure (what allocated limits read)
    allocated_baseline_mib: float | None = None

    @property
    def nproc(self) -> int:
        return self.measured.world_size

    @property
    def device(self) -> str:  # "gpu" | "cpu"
        return self.measured.device

    @property
    def failed(self) -> bool:
        return any(not check.ok and not check.advisory for check in self.checks)

    @property
    def predicted(self) -> bool:
        return self.measured.predicted

    @property
    def validated(self) -> bool:
        """A measurement, or a prediction whose model was judged on sizes it did not see."""
        return self.measured.validated

    @property
    def gated_method(self) -> str | None:
        """How the gated figure was measured (``per-pid sampled``, ``live allocations (memray)``, ...)."""
        peak = self.measured.peaks.get(self.gated_rank) if self.gated_rank is not None else None
        return peak.method if peak is not None else None

    @property
    def basis(self) -> str:
        """``predicted by a + b*N from nproc 1,2,4; ...`` for a predicted size, else empty."""
        prediction = self.measured.prediction
        return "" if prediction is None else prediction.describe()

    def limits(self) -> list[Check]:
        """The gated rank's checks that carry a limit in MiB (what a plot draws as lines; under
        rank="all" the other ranks' own baselines are not its limits)."""
        return [check for check in self.checks if check.limit_mib is not None and not check.own]


@dataclass(frozen=True)
class BaselineChange:
    nproc: int
    old_mib: float | None  # None: a new entry
    new_mib: float


@dataclass(frozen=True)
class TestRecord:
    """Everything about one gpumem test that outlives the process. ``spec`` is the marker's; one read
    back from JSON holds what a report carries (the limits, nproc, the launcher), the rest at its defaults."""

    __test__ = False  # not a pytest test class, whatever its name

    test: str
    status: Status
    spec: Spec
    sizes: tuple[SizeRecord, ...] = ()
    provenance: Mapping[str, str] = field(default_factory=dict)
    messages: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    baseline_changes: tuple[BaselineChange, ...] = ()
    changed_since_baseline: tuple[str, ...] = ()
    grown_sites: tuple[SiteChange, ...] = ()  # what grew at the failing size, largest first
    grown_against: str = ""  # "nproc=1" or "the baseline"
    sites_summary: str = ""  # what the listed sites leave out (shrunk, the framework's internals)
    # OneFlow's new SBP conversions at the failing size, one line each, largest first:
    # "S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); to_global of ..."
    conversions: tuple[str, ...] = ()
    cause: Cause | None = None  # where status is failed or xfailed

    @property
    def nproc(self) -> tuple[int, ...]:
        return self.spec.nproc

    @property
    def launcher(self) -> str:
        return self.spec.launcher

    def with_status(self, status: Status, cause: Cause | None = None) -> TestRecord:
        """The record under pytest's final word (``xfailed``, ``xpassed``); a failure keeps its cause."""
        return replace(self, status=status, cause=(cause or self.cause) if status in FAILED else None)

    def size(self, nproc: int) -> SizeRecord | None:
        return next((s for s in self.sizes if s.nproc == nproc), None)

    @property
    def digits(self) -> int:
        """Decimals of this test's MiB figures wherever they are shown: enough that each failed
        comparison reads apart (``505.44 > 505.38``), as in its failure text."""
        return max((digits_to_tell(c.measured_mib, c.limit_mib) for size in self.sizes for c in size.checks
                    if not c.ok and c.measured_mib is not None and c.limit_mib is not None), default=DIGITS)

    @property
    def verdict(self) -> str:
        """The status, with the cause of a failure: ``failed (crash)``, ``xfailed (limit)``, ``passed``."""
        return f"{self.status} ({self.cause})" if self.cause and self.status in FAILED else self.status

    def unlisted(self, size: SizeRecord) -> bool:
        """Whether ``size`` is not in the marker's nproc: an nproc=1 launched as the ratio's reference."""
        return size.nproc not in self.nproc

    def size_verdict(self, size: SizeRecord) -> str:
        """The test's verdict, except ``ok`` for a size that passed its limits inside a test that
        failed (or xfailed) on a limit at another size."""
        if self.status in FAILED and self.cause == "limit" and not size.failed:
            return "ok"
        return self.verdict

    def to_json(self) -> dict[str, Any]:
        return write(self, TEST_FIELDS, self.digits)


# ---------------------------------------------------------------------------------------------- JSON


@dataclass(frozen=True)
class Field:
    """One key of a record's JSON, declared once for :func:`write` and :mod:`.record_reader`: the
    attribute it holds (dotted from the object written: ``measured.world_size``) and its kind, which
    says how the value is written and how it is read back and checked."""

    json: str
    attr: str
    kind: str
    methods: str = ""  # a map of Peaks: the key of how each figure was taken, beside the figures


def _per_rank_placed(fields: tuple[Field, ...]) -> tuple[Field, ...]:
    """``fields`` with each per-rank field of a size (``results.size.PER_RANK``) after the key it
    follows: the one it names, else the per-rank field above it."""
    after: defaultdict[str, list[Field]] = defaultdict(list)
    anchor = ""
    for f in PER_RANK:
        anchor = f.after or anchor
        after[anchor].append(Field(f.json, f"measured.{f.name}", f.kind, f.methods))
    return tuple(placed for f in fields for placed in (f, *after[f.json]))


# A kind is a per-rank one (results.size.Kind) or one of these: "string", "number", "flag", ...
LIMIT_FIELDS = tuple(Field(key, key, kind) for key, kind in (
    ("max_mib", "number"), ("max_ratio", "ratio"), ("allow_mib", "number"), ("rank", "rank"),
    ("tolerance", "tolerance"), ("allocated_tolerance", "tolerance"), ("reference", "reference")))
# "text" is the sentence at the test's digits; "making", "reference_mib" and "rank_label" rebuild the Check
CHECK_FIELDS = tuple(Field(key, key, kind) for key, kind in (
    ("kind", "check kind"), ("ok", "flag"), ("measured_mib", "number"), ("limit_mib", "number"),
    ("text", "sentence"), ("figure", "string"), ("advisory", "flag"), ("own", "flag"), ("making", "string"),
    ("reference_mib", "number"), ("rank_label", "string")))
SIZE_FIELDS = _per_rank_placed(tuple(Field(key, attr or key, kind) for key, attr, kind in (
    ("nproc", "measured.world_size", "world size"), ("device", "measured.device", "string"),
    ("platform", "measured.platform", "string"), ("gated_rank", "", "rank or null"), ("gated_label", "", "string"),
    ("gated_mib", "", "number"), ("checks", "", "checks"),
    ("failed", "", "derived"),  # from the checks: one flag for a script reading the report
    ("ratio", "", "number"), ("ratio_figure", "", "string"), ("baseline_mib", "", "number"),
    ("others_max_mib", "", "number"), ("floor", "measured.floor", "floor"), ("peak_at_s", "", "seconds"),
    ("imbalance", "", "number"), ("duration_s", "measured.duration_s", "duration"),
    ("start", "measured.start", "string"), ("reused", "measured.reused", "flag"),
    ("predicted", "measured.prediction", "prediction"),
    ("allocated_predicted", "measured.allocated_prediction", "prediction"),
    ("simulated", "measured.simulated", "ranks"), ("fake_gpu", "measured.fake_gpu", "string"),
    ("cuda_on_cpu", "measured.cuda_on_cpu", "string"),
    ("allocated_mib", "", "number"), ("allocated_baseline_mib", "", "number"))))
TEST_FIELDS = tuple(Field(key, attr or key, kind) for key, attr, kind in (
    ("test", "", "test id"), ("status", "", "status"), ("cause", "", "cause"), ("nproc", "spec.nproc", "nproc"),
    ("launcher", "spec.launcher", "launcher"), ("limits", "spec", "limits"), ("sizes", "", "sizes"),
    ("provenance", "", "provenance"), ("messages", "", "lines"), ("notes", "", "lines"),
    ("baseline_changes", "", "baseline changes"), ("changed_since_baseline", "", "lines"),
    ("grown_sites", "", "grown sites"), ("grown_against", "", "string"), ("sites_summary", "", "string"),
    ("conversions", "", "lines")))


def _keyed(values: Mapping[int, Any], convert: Callable[[Any], Any] = lambda v: v) -> dict[str, Any]:
    return {str(k): convert(v) for k, v in sorted(values.items())}


def _timeline(points: tuple[tuple[float, Mapping[int, float]], ...]) -> list[Any]:
    return [[round(t, 4), _keyed(point, lambda v: round(v, 2))] for t, point in points]


def _site_change(c: SiteChange) -> dict[str, Any]:
    return {"site": c.label, "old_mib": round(c.old_mib, 3), "new_mib": round(c.new_mib, 3),
            **({"called_from": list(c.callers), "chains": c.chains} if c.callers else {}),
            **({"kept_alive_by": c.kept_alive_by} if c.kept_alive_by else {})}


def _allocated(a: AllocatedPeak) -> dict[str, Any]:
    out: dict[str, Any] = {"allocated_mib": round(a.mib, 2),
                           "reserved_mib": None if a.reserved_mib is None else round(a.reserved_mib, 2)}
    if a.device is not None:  # a fake GPU's prediction, with what it adds up and whether it fits
        out.update(predicted_device_mib=round(a.device.mib, 2),
                   predicted_device_parts_mib={part: round(mib, 2) for part, mib in a.device.parts},
                   predicted_for_gpu=a.device.gpu, gpu_capacity_mib=round(a.device.capacity_mib, 2),
                   margin_mib=round(a.device.margin_mib, 2), fits=a.device.margin_mib >= 0)
    return out


def _floor(floor: FloorResult | None, s: SizeRecord) -> dict[str, Any] | None:
    return None if floor is None else {"framework": floor.framework, "what": floor.describe(s.device, s.nproc),
                                       "ranks": _keyed(floor.ranks, lambda v: round(v, 1)), "cached": floor.cached}


# A value's JSON by its kind; a kind named in neither table is written as it is.
_WRITE: dict[str, Callable[[Any], Any]] = {
    "nproc": list, "lines": list, "sorted lines": list, "ranks": list, "provenance": dict, "tolerance": str,
    "ratio": lambda v: None if v is None else v.to_json(), "seconds": _keyed, "duration": lambda v: round(v, 3),
    "baseline changes": lambda v: [[c.nproc, c.old_mib, c.new_mib] for c in v],
    "grown sites": lambda v: [_site_change(c) for c in v],
    "prediction": lambda v: None if v is None else v.as_dict(),
    # the per-rank kinds (results.size.Kind)
    "peak": lambda v: _keyed(v, lambda p: p.mib), "mib": lambda v: _keyed(v, lambda mib: round(mib, 1)),
    "text": _keyed, "sites": lambda v: _keyed(v, lambda sites: [site.as_dict() for site in sites]),
    "allocated": lambda v: _keyed(v, _allocated),
    "curve": _timeline}
# The kinds written from (the value, the object that holds it, the test's digits).
_WRITE_IN_PLACE: dict[str, Callable[[Any, Any, int], Any]] = {
    "limits": lambda spec, _, digits: write(spec, LIMIT_FIELDS, digits),
    "sizes": lambda sizes, _, digits: [write(s, SIZE_FIELDS, digits) for s in sizes],
    "checks": lambda checks, _, digits: [write(c, CHECK_FIELDS, digits) for c in checks],
    "sentence": lambda _, check, digits: check.text(digits), "floor": lambda floor, size, _: _floor(floor, size)}


def write(obj: Any, fields: tuple[Field, ...], digits: int) -> dict[str, Any]:
    """``obj``'s JSON object: each declared field in order, as its kind writes it."""
    out: dict[str, Any] = {}
    for f in fields:
        value = attrgetter(f.attr)(obj)
        out[f.json] = (_WRITE_IN_PLACE[f.kind](value, obj, digits) if f.kind in _WRITE_IN_PLACE
                       else _WRITE.get(f.kind, lambda v: v)(value))
        if f.methods:  # side by side: a rank's figure, and how it was measured
            out[f.methods] = _keyed(value, lambda p: p.method)
    return out


def report_document(records: Iterable[TestRecord]) -> dict[str, Any]:
    """What ``--gpumem-report`` writes: ``{"schema": 4, "tests": [...]}``, sorted by test id."""
    return {"schema": SCHEMA, "tests": [r.to_json() for r in sorted(records, key=lambda r: r.test)]}
