"""What one launch measured at one world size: every rank's peak, and how each was taken.

The one measurement type: built by ``launching`` from a rank's files (or fitted, for a size never
launched), judged by ``judging``, held by the record every output renders (``judging.record``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from ..sampling import AllocatedPeak, DeviceEstimate, Peak
from ..sampling.sites import Site
from .predict import Prediction

DEVICE, ALLOCATED, HOST = "device", "allocated", "host"  # the figures a limit can read


@dataclass(frozen=True)
class FloorResult:
    """What an empty job of the same framework costs per rank at this size (``pytest_gpumem.rankside.floor_job``)."""

    framework: str
    ranks: Mapping[int, float]
    cached: str | None = None  # the date it was measured, when it came from the floor cache

    @property
    def label(self) -> str:
        """``; cached, measured 2026-12-01`` for a floor from the cache (every rendering says so); empty
        for one measured in this session."""
        return f"; cached, measured {self.cached}" if self.cached else ""

    def split(self, rank: int | None, mib: float | None) -> tuple[float, float] | None:
        """``mib`` as (this floor, the job's own), where the rank's floor was measured and the figure
        holds it: a job that never made what the floor holds (no CUDA context) reads below it."""
        floor = self.ranks.get(rank) if rank is not None else None
        return None if floor is None or mib is None or mib < floor else (floor, mib - floor)

    def describe(self, device: str, world_size: int) -> str:
        parts = ["CUDA context + " if device == "gpu" else ""] + [f"{self.framework} start-up"]
        if world_size > 1:
            parts.append(" + communicator")
        return "".join(parts)


@dataclass(frozen=True)
class SizeResult:
    """Every rank's peak at one world size, in the memory that is gated (gpu or cpu)."""

    world_size: int
    device: str
    peaks: Mapping[int, Peak]
    platform: str = ""
    host_peaks: Mapping[int, Peak] = field(default_factory=dict)
    rss_peaks: Mapping[int, float] = field(default_factory=dict)  # VmHWM, information only
    floor: FloorResult | None = None
    timeline: tuple[tuple[float, Mapping[int, float]], ...] = ()
    duration_s: float = 0.0
    reused: bool = False
    nodes: Mapping[int, str] = field(default_factory=dict)  # launcher=srun: the node of each rank
    prediction: Prediction | None = None  # set: a size above the launch cap, never launched
    allocated: Mapping[int, AllocatedPeak] = field(default_factory=dict)  # GPU: the framework allocator's
    allocated_prediction: Prediction | None = None  # a predicted size's allocator figure
    sites: Mapping[int, tuple[Site, ...]] = field(default_factory=dict)  # live at each rank's peak
    live_timeline: tuple[tuple[float, Mapping[int, float]], ...] = ()  # the gated live figure over time
    sites_notes: tuple[str, ...] = ()
    start: str = ""  # how the ranks were started: "fork", "exec", or "exec (why a fork was not)"
    # A simulated world (rankside.simulate): the ranks measured, each alone with a stand-in
    # communicator; () for a real launch. The allocator figure is exact; the device figure lacks the
    # communicator's own buffers, so it is a lower bound; a host figure lacks them too.
    simulated: tuple[int, ...] = ()
    # A fake GPU (rankside.fakegpu): the GPU model emulated, "" on a real GPU or on host memory. Its
    # sizes are simulated worlds too; its device figure is the allocator figure (there is no device).
    fake_gpu: str = ""
    # A simulated world: what the job asked for that the stand-in did not run, its memory missing
    # from the figure ("DDP comm hook 'keep_buckets'"); such a size reading below nproc=1 is not gated.
    uncounted: tuple[str, ...] = ()
    # A fake GPU: what it supplied that fake tensors lack (values read, sizes assumed, compiled code run
    # eagerly), each with the job's line (rankside.fakegpu.values): what the figure assumed.
    supplied: tuple[str, ...] = ()
    # A OneFlow job written for CUDA run on the CPU (oneflow.cuda_on_cpu): its label, "host figure of a
    # CUDA job mapped to the CPU"; "" otherwise. Its figure is the host figure, its device "cpu".
    cuda_on_cpu: str = ""

    @property
    def predicted(self) -> bool:
        return self.prediction is not None

    @property
    def validated(self) -> bool:
        """Whether a predicted figure can gate: its model was judged on sizes it did not see (LOO)."""
        return self.prediction is None or self.prediction.validated

    @property
    def basis(self) -> str:
        """What the figure stands on, next to the device: empty for a measurement of a real world."""
        if self.fake_gpu:
            return "fake GPU"
        if self.cuda_on_cpu:
            return self.cuda_on_cpu
        if self.simulated:
            return "simulated world"
        return "" if self.prediction is None else self.prediction.describe()

    @property
    def methods(self) -> str:
        return ", ".join(sorted({p.method for p in self.peaks.values()})) or "not available"


Figure = tuple[str, float | None, str]  # (label of the gated rank, its MiB, the figure read)


@dataclass(frozen=True)
class GatedReading:
    """Which rank of one size is gated, and what it reads: made once per size (:func:`gated_reading`)."""

    every: bool  # rank="all": the largest rank is gated, each rank held to its own stored figure
    rank: int | None  # the gated rank; None under "all" with no rank measured, or for a predicted size
    label: str  # "rank 0", "rank 3 (largest)", "all ranks", a prediction's label
    mib: float | None  # its device (GPU) or host figure; a predicted size's fitted one
    device: Figure  # what a limit on the device figure reads
    allocated: Figure  # what a limit on the allocator figure reads (the device figure where there is none)
    others_mib: float | None  # the largest peak of the ranks not gated
    method: str  # how the gated figure was measured

    def read(self, figure: str) -> Figure:
        """What a limit that reads ``figure`` reads (see :func:`gated_reading`)."""
        return self.allocated if figure == ALLOCATED else self.device


def gated_subject(rank: int | str) -> str:
    """Whose peak each size's figure is, for the marker's ``rank``: ``largest rank`` or ``rank 0``."""
    return "largest rank" if rank == "all" else f"rank {rank}"


def gated_reading(result: SizeResult, rank: int | str) -> GatedReading:
    """The one place that decides which rank of ``result`` is gated for the marker's ``rank`` (``"all"``:
    the largest measured; none for a predicted size), and what each limit reads of it.

    On a GPU, a limit on the allocator figure reads the framework allocator's where the rank reported
    one, else (OneFlow, a rank that never used the allocator) the device figure. A fake GPU's device
    figure is the one it predicts where its GPU model is calibrated, else its allocator figure. On host
    memory every limit reads the one host figure.
    """
    known = [(p.mib, r) for r, p in result.peaks.items() if p.mib is not None]
    top = int(rank) if rank != "all" else max(known)[1] if known and result.prediction is None else None
    peak = result.peaks.get(top) if top is not None else None
    mib: float | None
    if result.prediction is not None:
        label, mib = result.prediction.rank_label, result.prediction.mib
    elif rank == "all":
        label, mib = ("all ranks", None) if peak is None else (f"rank {top} (largest)", peak.mib)
    else:
        label, mib = f"rank {rank}", None if peak is None else peak.mib
    device = (label, mib, DEVICE if result.device == "gpu" else HOST)
    allocated = _allocator_figure(result, rank) or device
    others = [p.mib for r, p in result.peaks.items() if p.mib is not None and r != top]
    if result.fake_gpu:  # its device figure, where predicted, is the gated one, as a real GPU's is
        predicted = _predicted_device(result, rank)
        device = predicted or allocated
        if predicted is not None:
            label, mib = predicted[0], predicted[1]
    return GatedReading(rank == "all", top, label, mib, device, allocated,
                        max(others) if others else None, peak.method if peak is not None else result.methods)


def predicted_device(result: SizeResult, rank: int | str) -> tuple[str, DeviceEstimate] | None:
    """A fake GPU's predicted device figure of the gated rank (``rank="all"``: the largest), with the
    rank's label, where it has one."""
    predicted = {r: a.device for r, a in result.allocated.items() if a.device is not None}
    if not predicted:
        return None
    if rank == "all":
        top = max((d.mib, r) for r, d in predicted.items())[1]
        return f"rank {top} (largest)", predicted[top]
    mine = predicted.get(int(rank))
    return None if mine is None else (f"rank {rank}", mine)


def _predicted_device(result: SizeResult, rank: int | str) -> Figure | None:
    found = predicted_device(result, rank)
    return None if found is None else (found[0], found[1].mib, DEVICE)


def _allocator_figure(result: SizeResult, rank: int | str) -> Figure | None:
    """The gated rank's allocator figure, where the size has one (``rank="all"``: the allocator's largest)."""
    if result.device != "gpu":
        return None
    if result.prediction is not None:
        fitted = result.allocated_prediction
        return None if fitted is None else (fitted.rank_label, fitted.mib, ALLOCATED)
    if rank == "all" and result.allocated:
        top = max((p.mib, r) for r, p in result.allocated.items())[1]
        return f"rank {top} (largest)", result.allocated[top].mib, ALLOCATED
    mine = result.allocated.get(int(rank)) if rank != "all" else None
    return None if mine is None else (f"rank {rank}", mine.mib, ALLOCATED)


# What a per-rank field holds: a map by rank of a Peak, of MiB (written to 0.1), of a text, of an
# allocator figure or of the sites at the peak; a curve (points in time, each a map by rank); lines of
# text, which name no rank (merged as first seen, or sorted).
Kind = Literal["peak", "mib", "text", "allocated", "sites", "curve", "lines", "sorted lines"]
LINES: tuple[Kind, ...] = ("lines", "sorted lines")


@dataclass(frozen=True)
class PerRank:
    """A field of :class:`SizeResult` that each launch fills for the ranks it ran, declared once in
    :data:`PER_RANK`: ``launching`` keys it by the ranks a simulated launch stood for and merges the
    launches of one world, ``judging.record`` writes it under ``json`` and reads it back."""

    name: str
    json: str
    kind: Kind
    after: str = ""  # the key of a record's size it follows (reports keep their layout); "": the field above
    methods: str = ""  # a Peak map: the key of how each figure was taken, beside the figures


PER_RANK = (
    PerRank("peaks", "ranks", "peak", after="gated_mib", methods="methods"),
    PerRank("host_peaks", "host_ranks", "peak", after="others_max_mib", methods="host_methods"),
    PerRank("rss_peaks", "rss_ranks", "mib"),
    PerRank("nodes", "nodes", "text", after="reused"),
    PerRank("timeline", "timeline", "curve"),
    PerRank("uncounted", "uncounted", "sorted lines", after="fake_gpu"),
    PerRank("supplied", "supplied", "lines"),
    PerRank("allocated", "allocated_ranks", "allocated"),  # torch's: the one allocator read
    PerRank("sites", "sites", "sites", after="allocated_baseline_mib"),
    PerRank("sites_notes", "sites_notes", "lines"),
    PerRank("live_timeline", "live_timeline", "curve"),
)
