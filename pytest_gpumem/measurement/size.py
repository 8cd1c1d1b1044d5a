"""What one launch measured at one world size: every rank's peak, and how each was taken.

The one measurement type: built by ``launching`` from a rank's files (or fitted, for a size never
launched), judged by ``judging``, held by the record every output renders (``judging.record``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from ..sampling import AllocatedPeak, Peak
from ..sampling.sites import Site
from .predict import Prediction

DEVICE, ALLOCATED, HOST = "device", "allocated", "host"  # the figures a limit can read


@dataclass(frozen=True)
class FloorResult:
    """What an empty job of the same framework costs per rank at this size (``pytest_gpumem.launching.floor``)."""

    framework: str
    ranks: Mapping[int, float]
    cached: str | None = None  # the date it was measured, when it came from the floor cache

    @property
    def label(self) -> str:
        """``; cached, measured 2026-12-01`` for a floor from the cache (every rendering says so); empty
        for one measured in this session."""
        return f"; cached, measured {self.cached}" if self.cached else ""

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

    @property
    def predicted(self) -> bool:
        return self.prediction is not None

    @property
    def validated(self) -> bool:
        """Whether a predicted figure can gate: its model was judged on sizes it did not see (LOO)."""
        return self.prediction is None or self.prediction.validated

    def read(self, rank: int | str, figure: str) -> tuple[str, float | None, str]:
        """(label of the gated rank, its MiB, the figure read) for a limit that reads ``figure``.

        On a GPU, "allocated" is the framework allocator's figure where the rank reported one;
        otherwise (OneFlow, a rank that never used the allocator) the device figure is read. A fake
        GPU has no device: every limit reads its allocator figure. On host memory every limit reads
        the one host figure.
        """
        if self.device == "gpu" and (figure == ALLOCATED or self.fake_gpu):
            if self.prediction is not None and self.allocated_prediction is not None:
                return self.allocated_prediction.rank_label, self.allocated_prediction.mib, ALLOCATED
            if self.prediction is None and self.allocated:
                if rank == "all":
                    top = max((p.mib, r) for r, p in self.allocated.items())[1]
                    return f"rank {top} (largest)", self.allocated[top].mib, ALLOCATED
                if int(rank) in self.allocated:
                    return f"rank {rank}", self.allocated[int(rank)].mib, ALLOCATED
        label, mib = self.gated(rank)
        return label, mib, DEVICE if self.device == "gpu" else HOST

    @property
    def basis(self) -> str:
        """What the figure stands on, next to the device: empty for a measurement of a real world."""
        if self.fake_gpu:
            return "fake GPU"
        if self.simulated:
            return "simulated world"
        return "" if self.prediction is None else self.prediction.describe()

    def gated_rank(self, rank: int | str) -> int | None:
        """Which rank is gated: ``rank`` itself, or for ``rank="all"`` the largest one (None when no
        rank was measured, or for a predicted size)."""
        if rank != "all":
            return int(rank)
        if self.prediction is not None:
            return None
        known = [(p.mib, r) for r, p in self.peaks.items() if p.mib is not None]
        return max(known)[1] if known else None

    def gated(self, rank: int | str) -> tuple[str, float | None]:
        """(label of the gated rank, its peak MiB); ``rank="all"`` takes the largest rank."""
        if self.prediction is not None:
            return self.prediction.rank_label, self.prediction.mib
        top = self.gated_rank(rank)
        peak = self.peaks.get(top) if top is not None else None
        if rank == "all":
            return ("all ranks", None) if peak is None else (f"rank {top} (largest)", peak.mib)
        return f"rank {rank}", None if peak is None else peak.mib

    def others_max(self, rank: int | str) -> float | None:
        """The largest peak of the ranks not gated (under ``rank="all"``, all but the largest one)."""
        gated = self.gated_rank(rank) if rank == "all" else rank
        values = [p.mib for r, p in self.peaks.items() if p.mib is not None and r != gated]
        return max(values) if values else None

    @property
    def methods(self) -> str:
        return ", ".join(sorted({p.method for p in self.peaks.values()})) or "not available"


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
