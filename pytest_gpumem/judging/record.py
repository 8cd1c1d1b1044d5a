"""One test's result, typed: what every output renders, and its JSON.

The table, Markdown, JUnit properties, plots, benchmark JSON and ``gpumem diff`` read a
:class:`TestRecord` and derive nothing themselves: the gated rank is an int, each check carries its
own limit, each size says whether it failed. :meth:`TestRecord.to_json` is the one writer, versioned
by :data:`SCHEMA`; it travels to the xdist controller and into ``--gpumem-report`` files.
:mod:`.record_reader` reads it back; :func:`.assemble.build` makes a record from a run and its verdict.

A test's outcome is pytest's own word (:data:`Status`), and a failed (or xfailed) test says what
failed (:data:`Cause`): a limit, a rank, or the baseline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Literal, Mapping, get_args

from ..config.spec import DEFAULT_ALLOCATED_TOLERANCE, DEFAULT_TOLERANCE, Ratio
from ..measurement.predict import Prediction
from ..measurement.size import PER_RANK, SizeResult

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
class Limits:
    """What the marker asked for (the marker's own values; ``tolerance`` as written)."""

    max_mib: float | None = None
    max_ratio: Ratio | None = None
    allow_mib: float = 0.0
    rank: int | str = 0  # an int, or "all": the largest rank
    tolerance: str = str(DEFAULT_TOLERANCE)
    allocated_tolerance: str = str(DEFAULT_ALLOCATED_TOLERANCE)
    reference: int = 1  # the world size the ratio is taken against


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
    own: bool = False  # rank="all": another rank than the gated one, held to its own stored figure


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
class SizeRecord:
    """One world size of one test: what was measured there, as the launch read it, and what was
    judged of it (the gated figure, the checks and their limits, the baseline)."""

    measured: SizeResult  # every rank's figures, the floor, the curves, the sites: the one measurement type
    gated_rank: int | None  # None: rank="all" with nothing measured
    gated_label: str  # "rank 0", "rank 3 (largest)"
    gated_mib: float | None
    checks: tuple[CheckRecord, ...] = ()
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

    def limits(self) -> list[CheckRecord]:
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
    """Everything about one gpumem test that outlives the process."""

    __test__ = False  # not a pytest test class, whatever its name

    test: str
    status: Status
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
    # OneFlow's new SBP conversions at the failing size, one line each, largest first:
    # "S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); to_global of ..."
    conversions: tuple[str, ...] = ()
    cause: Cause | None = None  # where status is failed or xfailed

    def with_status(self, status: Status, cause: Cause | None = None) -> TestRecord:
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

    def unlisted(self, size: SizeRecord) -> bool:
        """Whether ``size`` is not in the marker's nproc: an nproc=1 launched as the ratio's reference."""
        return size.nproc not in self.nproc

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
            "limits": {"max_mib": self.limits.max_mib, "max_ratio": (None if self.limits.max_ratio is None
                                                                    else self.limits.max_ratio.to_json()),
                       "allow_mib": self.limits.allow_mib, "rank": self.limits.rank,
                       "tolerance": self.limits.tolerance, "allocated_tolerance": self.limits.allocated_tolerance,
                       "reference": self.limits.reference},
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
            "conversions": list(self.conversions),
        }


def _keyed(values: Mapping[int, Any], convert: Callable[[Any], Any] = lambda v: v) -> dict[str, Any]:
    return {str(k): convert(v) for k, v in sorted(values.items())}


def _timeline(points: tuple[tuple[float, Mapping[int, float]], ...]) -> list[Any]:
    return [[round(t, 4), _keyed(point, lambda v: round(v, 2))] for t, point in points]


def _prediction(prediction: Prediction | None) -> dict[str, Any] | None:
    return None if prediction is None else prediction.as_dict()


def _size_json(s: SizeRecord) -> dict[str, Any]:
    m = s.measured
    floor = m.floor
    placed = _per_rank_json(m)  # the per-rank fields (measurement.size.PER_RANK), by the key each follows
    return {
        "nproc": s.nproc,
        "device": s.device,
        "platform": m.platform,
        "gated_rank": s.gated_rank,
        "gated_label": s.gated_label,
        "gated_mib": s.gated_mib,
        **placed["gated_mib"],
        "checks": [{"kind": c.kind, "ok": c.ok, "measured_mib": c.measured_mib, "limit_mib": c.limit_mib,
                    "text": c.text, "figure": c.figure, "advisory": c.advisory, "own": c.own} for c in s.checks],
        "failed": s.failed,  # derived from the checks: one flag for a script reading the report
        "ratio": s.ratio,
        "ratio_figure": s.ratio_figure,
        "baseline_mib": s.baseline_mib,
        "others_max_mib": s.others_max_mib,
        **placed["others_max_mib"],
        "floor": None if floor is None else {"framework": floor.framework, "what": floor.describe(s.device, s.nproc),
                                             "ranks": _keyed(floor.ranks, lambda v: round(v, 1)),
                                             "cached": floor.cached},
        "peak_at_s": _keyed(s.peak_at_s),
        "imbalance": s.imbalance,
        "duration_s": round(m.duration_s, 3),
        "start": m.start,
        "reused": m.reused,
        **placed["reused"],
        "predicted": _prediction(m.prediction),
        "allocated_predicted": _prediction(m.allocated_prediction),
        "simulated": list(m.simulated),
        "fake_gpu": m.fake_gpu,
        **placed["fake_gpu"],
        "allocated_mib": s.allocated_mib,
        "allocated_baseline_mib": s.allocated_baseline_mib,
        **placed["allocated_baseline_mib"],
    }


_WRITE: dict[str, Callable[[Any], Any]] = {  # a per-rank field's value by its kind (measurement.size.Kind)
    "peak": lambda peaks: _keyed(peaks, lambda p: p.mib), "mib": lambda v: _keyed(v, lambda mib: round(mib, 1)),
    "text": _keyed, "sites": lambda v: _keyed(v, lambda sites: [site.as_dict() for site in sites]),
    "allocated": lambda v: _keyed(v, lambda a: {"allocated_mib": round(a.mib, 2), "reserved_mib": (
        None if a.reserved_mib is None else round(a.reserved_mib, 2))}),
    "curve": _timeline, "lines": list, "sorted lines": list}


def _per_rank_json(m: SizeResult) -> defaultdict[str, dict[str, Any]]:
    """Each per-rank field's keys, grouped by the key they follow (that of the field above, unless named)."""
    placed: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    anchor = ""
    for f in PER_RANK:
        anchor, value = f.after or anchor, getattr(m, f.name)
        placed[anchor][f.json] = _WRITE[f.kind](value)
        if f.methods:  # side by side: a rank's figure, and how it was measured
            placed[anchor][f.methods] = _keyed(value, lambda p: p.method)
    return placed


def report_document(records: Iterable[TestRecord]) -> dict[str, Any]:
    """What ``--gpumem-report`` writes: ``{"schema": 4, "tests": [...]}``, sorted by test id."""
    return {"schema": SCHEMA, "tests": [r.to_json() for r in sorted(records, key=lambda r: r.test)]}
