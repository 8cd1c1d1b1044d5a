"""Measurements + spec (+ baseline) -> a verdict that renders itself.

Every failed check says the limit, the measured value, the unit, the rank and the world size:
``rank 0 at nproc=8: peak 15190.0 MiB > 1.20 x 5734.0 MiB (nproc=1) + 0 MiB = 6880.8 MiB``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ..config.spec import Spec, Tolerance
from ..results.size import (
    ALLOCATED,
    DEVICE,
    HOST,
    GatedReading,
    SizeResult,
    gated_reading,
    gated_subject,
    predicted_device,
)


@dataclass(frozen=True)
class BaselineRef:
    mib: float  # the stored device (GPU) or host figure of the gated rank
    tolerance: Tolerance
    allocated_mib: float | None = None  # the stored allocator figure (GPU, torch)
    allocated_tolerance: Tolerance | None = None
    # Every rank's stored figures: under rank="all" each rank is held to its own, since stages are not
    # alike and a middle stage can grow while the largest rank does not.
    ranks: Mapping[int, float] = field(default_factory=dict)
    allocated_ranks: Mapping[int, float] = field(default_factory=dict)
    gated_rank: int | None = None  # the rank ``mib`` is the figure of (the largest, under rank="all")


DIGITS = 1  # decimals of a MiB figure, unless a comparison needs more to show why it failed
UNCOUNTED = "uncounted"  # a check that fails a simulated size its skipped comm hook left below nproc=1
MOST_DIGITS = 7  # a MiB to the byte (1 B = 0.00000095 MiB)


def digits_to_tell(measured: float, limit: float, least: int = DIGITS) -> int:
    """The fewest decimals (at least ``least``) at which ``measured`` and ``limit`` read differently:
    ``505.44 MiB > 505.38 MiB``, never ``505.4 MiB > 505.4 MiB``."""
    digits = least
    while digits < MOST_DIGITS and f"{measured:.{digits}f}" == f"{limit:.{digits}f}":
        digits += 1
    return digits


def mib(value: float, digits: int = DIGITS) -> str:
    """A MiB figure at the precision of the output it is part of (no unit)."""
    return f"{value:.{digits}f}"


Drift = Literal["regression", "improved", "unchanged"]  # a figure against its reference (against_reference)


def against_reference(measured_mib: float, reference_mib: float, tolerance: Tolerance) -> tuple[Drift, float]:
    """The one drift rule, for the baseline gate and for ``gpumem diff``: ``(kind, allowance)``.

    ``regression`` when measured > reference + allowance, ``improved`` when measured <
    reference - allowance, ``unchanged`` otherwise (both limits themselves pass);
    the allowance is ``tolerance.allowance(reference)``.
    """
    allowance = tolerance.allowance(reference_mib)
    if measured_mib > reference_mib + allowance:
        return "regression", allowance
    if measured_mib < reference_mib - allowance:
        return "improved", allowance
    return "unchanged", allowance


@dataclass(frozen=True)
class Check:
    """One limit at one world size; ``str()`` is the sentence a user reads."""

    kind: str  # "max_mib" | "max_ratio" | "baseline" | "measured" | "uncounted"
    world_size: int
    rank_label: str
    device: str
    measured_mib: float | None
    limit_mib: float | None
    ok: bool
    making: str  # how the limit is made; "{limit}" and "{reference}" stand for MiB figures (see ``describe``)
    basis: str = ""  # "predicted by a + b*N from nproc 1,2,4; LOO error 1.2%" for a predicted size
    figure: str = ""  # DEVICE, ALLOCATED or HOST: what was compared with the limit
    advisory: bool = False  # a predicted size whose model could not be validated: shown, never failing
    reference_mib: float | None = None  # what the limit is made from: peak(1), the stored baseline
    own: bool = False  # rank="all": a rank held to its own stored figure, not the gated (largest) rank

    @property
    def digits(self) -> int:
        """Decimals that show why a failed check failed (a passed one reads at the default)."""
        if self.ok or self.measured_mib is None or self.limit_mib is None:
            return DIGITS
        return digits_to_tell(self.measured_mib, self.limit_mib)

    @property
    def detail(self) -> str:
        """How the limit is made, its figures at this check's own precision."""
        return self.describe(self.digits)

    def describe(self, digits: int) -> str:
        """The limit's making, its figures at ``digits`` decimals."""
        text = self.making
        if self.limit_mib is not None:
            text = text.replace("{limit}", mib(self.limit_mib, digits))
        if self.reference_mib is not None:
            text = text.replace("{reference}", mib(self.reference_mib, digits))
        return text

    def headline(self, digits: int | None = None) -> str:
        """The check in a few words, numbers first, for pytest's one-line summary (cut at the
        terminal's width, 80 columns in most CI logs): ``597.0 MiB > ratio limit 502.0 MiB (rank 0, nproc=2)``."""
        digits = self.digits if digits is None else digits
        figure = ", allocated" if self.figure == ALLOCATED else ""
        where = f"({self.rank_label}{figure}, nproc={self.world_size})"
        if self.kind == UNCOUNTED and self.measured_mib is not None:
            return f"{mib(self.measured_mib, digits)} MiB < {self.describe(digits).split(';')[0]} {where}"
        if self.measured_mib is None or self.limit_mib is None:
            return f"{self.describe(digits)} {where}"
        what = {"max_mib": "max_mib", "max_ratio": "ratio limit", "baseline": "baseline + tolerance"}.get(
            self.kind, self.kind)
        return f"{mib(self.measured_mib, digits)} MiB > {what} {mib(self.limit_mib, digits)} MiB {where}"

    def text(self, digits: int | None = None) -> str:
        """The whole sentence, its figures at ``digits`` decimals (default: enough to tell them apart)."""
        digits = self.digits if digits is None else digits
        predicted = self.figure == DEVICE and self.basis.startswith("fake GPU")  # its device figure, predicted
        figure = ", allocated" if self.figure == ALLOCATED else ", device figure predicted" if predicted else ""
        basis = f", {self.basis}" if self.basis else ""
        where = f"{self.rank_label} at nproc={self.world_size} ({self.device}{figure}{basis})"
        if self.measured_mib is None:
            return f"{where}: {self.describe(digits)}"
        relation = "<" if self.kind == UNCOUNTED else "<=" if self.ok else ">"
        return f"{where}: peak {mib(self.measured_mib, digits)} MiB {relation} {self.describe(digits)}"

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class Verdict:
    spec: Spec
    results: tuple[SizeResult, ...]
    checks: tuple[Check, ...]
    notes: tuple[str, ...] = ()
    readings: Mapping[int, GatedReading] = field(default_factory=dict)  # by world size

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[Check]:
        """Failed checks that gate (a prediction that could not be validated is only shown)."""
        return [check for check in self.checks if not check.ok and not check.advisory]

    @property
    def advisories(self) -> list[Check]:
        """Limits a not-validated prediction would exceed: shown, labelled, never failing the test."""
        return [check for check in self.checks if not check.ok and check.advisory]

    @property
    def worst(self) -> Check:
        """The failed check furthest over its limit, relative to it: the headline names its size and
        rank (the largest growth, not the first size that broke); the first of equals."""
        return max(self.failures, key=_over)

    @property
    def digits(self) -> int:
        """Decimals of every MiB figure in this verdict's output: enough that each failed comparison
        shows why it failed, and the same for all, so that one figure reads the same in every line."""
        return max((check.digits for check in self.checks if not check.ok), default=DIGITS)

    def ratio(self, world_size: int) -> float | None:
        """peak(N) / peak(reference) in the figure the ratio limit reads (see :func:`ratio_figures`)."""
        ref = self.spec.reference
        if world_size <= ref or ref not in self.readings or world_size not in self.readings:
            return None
        base, value, _ = ratio_figures(self.spec, self.readings[ref], self.readings[world_size])
        if base is None or value is None or base <= 0:
            return None
        return value / base

    def summary_line(self) -> str:
        """Every size on one line: ``nproc 1: 512.0 MiB | 2: 530.1 MiB (1.04x)``."""
        parts = []
        digits = self.digits
        for result in self.results:
            value = self.readings[result.world_size].mib
            text = f"{result.world_size}: " + ("n/a" if value is None else f"{mib(value, digits)} MiB")
            ratio = self.ratio(result.world_size)
            if ratio is not None:
                text += f" ({ratio:.2f}x)"
            if result.predicted:
                text += " predicted"
            if result.fake_gpu:
                text += " fake GPU"
            elif result.simulated:
                text += " simulated"
            if any(c.world_size == result.world_size for c in self.failures):
                text += " FAIL"
            elif any(c.world_size == result.world_size for c in self.advisories):
                text += " (would exceed, not validated)"
            parts.append(text)
        return f"{gated_subject(self.spec.rank)} peak, nproc " + " | ".join(parts)

    def render(self, lead: list[str] | None = None) -> str:
        """Top-down for a reviewer: the headline, then ``lead`` (what changed, the sites that grew),
        then each failed limit with its numbers, then the rest."""
        lines = []
        failures = self.failures
        digits = self.digits
        if failures:
            others = len(failures) - 1
            more = f"; {others} more limit{'s' if others > 1 else ''} exceeded" if others else ""
            lines.append(f"gpumem: {self.worst.headline(digits)}{more}")
        lines.extend(lead or [])
        lines.extend(f"  {check.text(digits)}" for check in failures)
        advisories = self.advisories
        if advisories:
            lines.append("  predicted, not validated (shown, not failing: fit on fewer than 3 launched sizes):")
            lines.extend(f"    would exceed: {check.text(digits)}" for check in advisories)
        lines.append("  " + self.summary_line())
        for result in self.results:
            if result.prediction is not None:
                lines.append(f"  nproc={result.world_size} {result.device} MiB {result.prediction.rank_label} "
                             f"{mib(result.prediction.mib, digits)}, {result.basis} (not launched)")
                continue
            ranks = ", ".join(
                f"{r}: {'n/a' if p.mib is None else mib(p.mib, digits)}"
                + (f" on {result.nodes[r]}" if r in result.nodes else "")
                for r, p in sorted(result.peaks.items())
            )
            reused = " (reference reused)" if result.reused else ""
            if result.fake_gpu:
                reused += f" (fake {result.fake_gpu}: {simulated_ranks(result)} alone, every CUDA tensor fake)"
            elif result.simulated:
                reused += f" (simulated: {simulated_ranks(result)} alone with a stand-in communicator)"
            lines.append(
                f"  nproc={result.world_size} {result.device} MiB per rank {{{ranks}}} "
                f"[{result.methods}]{reused}"
            )
            floor = result.floor
            parts = {r: part for r, p in sorted(result.peaks.items())
                     if floor is not None and (part := floor.split(r, p.mib)) is not None}
            if floor is not None and parts:
                split = ", ".join(f"{r}: {mib(base, digits)} + {mib(own, digits)}" for r, (base, own) in parts.items())
                lines.append(f"    floor + job's own MiB per rank {{{split}}} "
                             f"(floor: an empty job, {floor.describe(result.device, result.world_size)}"
                             f"{floor.label})")
            if result.device == "cpu" and result.rss_peaks:
                rss = ", ".join(f"{r}: {mib(value, digits)}" for r, value in sorted(result.rss_peaks.items()))
                lines.append(f"    resident high-water mark (VmHWM, not gated: follows the page cache) {{{rss}}}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _over(check: Check) -> float:
    """How far a failed check is over its limit, as a share of it (a check without figures: 0)."""
    if check.measured_mib is None or not check.limit_mib:
        return 0.0
    return check.measured_mib / check.limit_mib


def simulated_ranks(result: SizeResult) -> str:
    """``rank 0`` or ``ranks 0-7`` of a simulated size."""
    ranks = sorted(result.simulated)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def ratio_figures(spec: Spec, one: GatedReading, reading: GatedReading) -> tuple[float | None, float | None, str]:
    """(peak at the reference size, peak at N, the figure) for the ratio: both sides read the same figure, so
    when one side has no allocator figure both read the device figure."""
    _, base, base_figure = one.read(spec.figure("max_ratio"))
    _, value, figure = reading.read(spec.figure("max_ratio"))
    if base_figure != figure:
        _, base, figure = one.device
        _, value, figure = reading.device
    return base, value, figure


def _fake_gpu_notes(spec: Spec, fake: list[SizeResult]) -> list[str]:
    """What a fake GPU's figures are, and each size's fit on the emulated GPU (its predicted device figure)."""
    sizes = ", ".join(str(r.world_size) for r in fake)
    fits = [(r.world_size, found) for r in fake if (found := predicted_device(r, spec.rank)) is not None]
    if not fits:
        return [f"nproc={sizes} ran on a fake GPU ({fake[0].fake_gpu}): every limit reads the allocator figure, what "
                "torch's caching allocator would count on that model; a real GPU holds more (the CUDA context, the "
                "communicator's buffers, the allocator's cache), not predicted: its model has no calibration of "
                "them (gpumem calibrate)"]
    device = [limit for limit, figure in spec.figures if figure == DEVICE]
    notes = [f"nproc={sizes} ran on a fake GPU ({fake[0].fake_gpu}): its device figure is predicted, the caching "
             "allocator's reserved peak plus what the model's calibration puts outside it (the context, the "
             "libraries' kernels, an NCCL communicator of one rank; at larger worlds NCCL holds more, not modelled "
             "yet); " + (f"{', '.join(device)} read{'s' if len(device) == 1 else ''} it, " if device else "")
             + "other limits the allocator figure"]
    notes += [f"nproc={n} {label}: {estimate.fit()} (predicted: {estimate.sum_text()})"
              for n, (label, estimate) in fits]
    return notes


def judge(
    spec: Spec,
    results: list[SizeResult],
    baselines: Mapping[int, BaselineRef] | None = None,
    notes: tuple[str, ...] = (),
    readings: Mapping[int, GatedReading] | None = None,
) -> Verdict:
    """Apply every limit of ``spec`` (and the stored baselines) to every size's gated reading (made here
    unless handed), each on the figure it reads; a predicted size whose model was not validated only advises."""
    checks: list[Check] = []
    extra_notes = list(notes)
    if readings is None:
        readings = {r.world_size: gated_reading(r, spec.rank) for r in results}
    ref = spec.reference
    one = next((r for r in results if r.world_size == ref), None)  # nproc=1 unless the marker names a reference
    for result in sorted(results, key=lambda r: r.world_size):
        n = result.world_size
        reading = readings[n]
        label, mib = reading.label, reading.mib
        advisory = not result.validated

        def check(kind: str, limit: float | None, ok: bool, detail: str, value: float | None,
                  who: str, figure: str, reference: float | None = None, own: bool = False) -> None:
            checks.append(Check(kind, n, who, result.device, value, limit, ok, detail, result.basis, figure,
                                advisory, reference, own))

        if mib is None:
            check("measured", None, False, f"no peak could be measured ({result.methods})", None, label, "")
            continue

        if spec.max_mib is not None:
            who, value, figure = reading.read(spec.figure("max_mib"))
            if value is not None:
                check("max_mib", spec.max_mib, value <= spec.max_mib, "max_mib {limit} MiB", value,
                      who, figure)
        cap = spec.max_ratio.at(n) if spec.max_ratio is not None else None
        if cap is not None and n > ref and one is not None:
            reference, value, figure = ratio_figures(spec, readings[ref], reading)
            who = reading.read(figure)[0]
            if reference is not None and value is not None:
                limit = cap * reference + spec.allow_mib
                ratio = (f"ratio {value / reference:.2f}x" if reference > 0
                         else f"no ratio: the nproc={ref} peak is 0 MiB")
                check(
                    "max_ratio",
                    limit,
                    value <= limit,
                    f"{cap:.2f} x {{reference}} MiB (nproc={ref}) + {spec.allow_mib:.0f} MiB"
                    f" = {{limit}} MiB ({ratio})",
                    value, who, figure, reference,
                )
        if result.uncounted and n > ref and one is not None and not one.simulated:
            reference, value, figure = ratio_figures(spec, readings[ref], reading)
            if reference is not None and value is not None and value < reference:
                skipped = ", ".join(result.uncounted)
                check(UNCOUNTED, None, False,
                      f"nproc={ref}'s {{reference}} MiB: without its {skipped} (not run in the simulated world, its "
                      "buffers not counted) no limit can gate this size; run it for real (simulate='off' on "
                      "enough GPUs) or leave it out of nproc",
                      value, reading.read(figure)[0], figure, reference)
        base = None if result.predicted else (baselines or {}).get(n)  # a baseline holds measurements
        if base is not None and n in spec.nproc:
            extra_notes += _baseline_checks(spec, result, reading, base, check)
    fake = [r for r in results if r.fake_gpu]
    if fake:
        extra_notes += _fake_gpu_notes(spec, fake)
        supplied = tuple(dict.fromkeys(line for r in fake for line in r.supplied))
        if supplied:
            extra_notes.append("the fake GPU supplied what fake tensors do not have (docs/fake-gpu.md, \"Values\"); "
                               "the figure holds under these assumptions: " + "; ".join(supplied))
    simulated = [r for r in results if r.simulated and not r.fake_gpu]
    if simulated:
        sizes = ", ".join(str(r.world_size) for r in simulated)
        exact = "its allocator figure is exact; " if any(r.allocated for r in simulated) else ""
        what = "device figure" if simulated[0].device == "gpu" else "host figure"
        extra_notes.append(f"nproc={sizes} ran as a simulated world: {exact}its {what} has no communicator "
                           "buffers, so real ranks hold more (a limit on it fails only where even that figure "
                           "exceeds it)")
    return Verdict(spec=spec, results=tuple(results), checks=tuple(checks), notes=tuple(extra_notes),
                   readings=readings)


def _baseline_checks(spec: Spec, result: SizeResult, reading: GatedReading, base: BaselineRef,
                     check: Any) -> list[str]:
    """The stored figure(s): the device (or host) figure at ``tolerance``, and on a GPU, where both
    the baseline and this run have it, the allocator figure at its own, tighter tolerance; under
    rank="all" each rank's against its own as well."""
    pairs: list[tuple[str, float | None, str, float, Tolerance, bool]] = []
    if result.fake_gpu:  # one figure, the allocator's: judged once, at its own tolerance
        stored = base.allocated_mib if base.allocated_mib is not None else base.mib
        pairs.append((*reading.allocated, stored, base.allocated_tolerance or spec.allocated_tolerance, False))
        if reading.every:
            pairs += [pair for pair in _rank_pairs(spec, result, reading, base) if pair[2] == ALLOCATED]
        return _baseline_pairs(pairs, result, check)
    pairs.append((*reading.device, base.mib, base.tolerance, False))
    if spec.figure("baseline") == ALLOCATED and base.allocated_mib is not None:
        label, value, figure = reading.allocated
        if figure == ALLOCATED:
            tolerance = base.allocated_tolerance or spec.allocated_tolerance
            pairs.append((label, value, figure, base.allocated_mib, tolerance, False))
    if reading.every:
        pairs += _rank_pairs(spec, result, reading, base)
    return _baseline_pairs(pairs, result, check)


def _baseline_pairs(pairs: list[tuple[str, float | None, str, float, Tolerance, bool]], result: SizeResult,
                    check: Any) -> list[str]:
    """A check per (label, measured, figure, stored, tolerance, own); notes for clear improvements."""
    notes = []
    for label, value, figure, stored, tolerance, own in pairs:
        if value is None:
            continue
        kind, allowance = against_reference(value, stored, tolerance)
        limit = stored + allowance
        check("baseline", limit, kind != "regression",
              f"baseline {{reference}} MiB + {tolerance.explain(stored)} = {{limit}} MiB", value, label, figure,
              stored, own)
        if kind == "improved":
            what = "allocator figure" if figure == ALLOCATED else "peak"
            notes.append(
                f"{label} at nproc={result.world_size}: {what} {value:.1f} MiB is below the baseline "
                f"{stored:.1f} MiB by more than {tolerance.explain(stored)}; refresh the baseline to tighten it"
            )
    return notes


def _rank_pairs(spec: Spec, result: SizeResult, reading: GatedReading,
                base: BaselineRef) -> list[tuple[str, float | None, str, float, Tolerance, bool]]:
    """Under rank="all", each rank against its own stored figure: the largest rank's check does not
    see a middle pipeline stage that grew below it. The rank that is the largest now and was then
    is checked already, as the largest."""
    gated, was = reading.rank, base.gated_rank
    figure = DEVICE if result.device == "gpu" else HOST
    pairs: list[tuple[str, float | None, str, float, Tolerance, bool]] = []
    for rank, peak in sorted(result.peaks.items()):
        if rank == gated == was:
            continue
        if peak.mib is not None and rank in base.ranks:
            pairs.append((f"rank {rank}", peak.mib, figure, base.ranks[rank], base.tolerance, True))
        mine = result.allocated.get(rank)
        if spec.figure("baseline") == ALLOCATED and mine is not None and rank in base.allocated_ranks:
            tolerance = base.allocated_tolerance or spec.allocated_tolerance
            pairs.append((f"rank {rank}", mine.mib, ALLOCATED, base.allocated_ranks[rank], tolerance, True))
    return pairs
