"""Samplers: each watches the processes of one launch and reports every rank's peak.

A sampler owns its own thread on a monotonic, drift-free schedule. ``None`` means "not
available" and is never confused with 0 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MiB = 1024 * 1024


@dataclass(frozen=True)
class Peak:
    """One rank's peak and how it was obtained (the report names the method)."""

    mib: float | None
    method: str


GiB = 1024.0  # in MiB


@dataclass(frozen=True)
class DeviceEstimate:
    """A fake GPU's prediction of a rank's device figure (what nvidia-smi would show for it) on the
    GPU model it emulates: the allocator's reserved peak plus, part by part, what lives outside the
    allocator as calibrated on that model (``rankside.fakegpu.models.OUTSIDE``)."""

    parts: tuple[tuple[str, float], ...]  # (part, MiB), "reserved" first
    gpu: str
    capacity_mib: float  # what the GPU gives a process: torch's total_memory

    @property
    def mib(self) -> float:
        return sum(mib for _, mib in self.parts)

    @property
    def margin_mib(self) -> float:
        return self.capacity_mib - self.mib

    def fit(self) -> str:
        """``fits NVIDIA H100 80GB HBM3: 61.2 of 79.2 GiB, margin 18.0 GiB`` (or how far over it is)."""
        figures = f"{self.mib / GiB:.1f} of {self.capacity_mib / GiB:.1f} GiB"
        if self.margin_mib >= 0:
            return f"fits {self.gpu}: {figures}, margin {self.margin_mib / GiB:.1f} GiB"
        return f"does not fit {self.gpu}: {figures}, {-self.margin_mib / GiB:.1f} GiB over"

    def sum_text(self) -> str:
        """``reserved 58112.0 + context 530.0 + cublas 104.0 MiB``: what the figure adds up."""
        return " + ".join(f"{part} {mib:.1f}" for part, mib in self.parts) + " MiB"


@dataclass(frozen=True)
class AllocatedPeak:
    """A rank's GPU figure as its framework's allocator counts it: the peak of live tensors
    (``allocated``, gated where a limit reads it) and of what the allocator held (``reserved``,
    information: the cache moves between identical runs); on a fake GPU, the device figure predicted."""

    mib: float
    reserved_mib: float | None
    framework: str  # "torch"
    device: DeviceEstimate | None = None


class Sampler(Protocol):
    def start(self) -> None: ...

    def add_process(self, rank: int, pid: int) -> None: ...

    def stop(self) -> None: ...

    def peaks(self) -> dict[int, Peak]: ...

    def timeline(self) -> list[tuple[float, dict[int, float]]]: ...
