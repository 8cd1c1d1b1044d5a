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


@dataclass(frozen=True)
class AllocatedPeak:
    """A rank's GPU figure as its framework's allocator counts it: the peak of live tensors
    (``allocated``, gated where a limit reads it) and of what the allocator held (``reserved``,
    information: the cache moves between identical runs)."""

    mib: float
    reserved_mib: float | None
    framework: str  # "torch"


class Sampler(Protocol):
    def start(self) -> None: ...

    def add_process(self, rank: int, pid: int) -> None: ...

    def stop(self) -> None: ...

    def peaks(self) -> dict[int, Peak]: ...

    def timeline(self) -> list[tuple[float, dict[int, float]]]: ...
