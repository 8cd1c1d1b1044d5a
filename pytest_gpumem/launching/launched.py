"""What one test's launches produced: a :class:`SizeRun` per world size, a :class:`TestRun` per test."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..config.spec import Spec
from ..oneflow.conversions import Conversion
from ..rankside import protocol
from ..results.size import GatedReading, SizeResult, gated_reading
from .supervise import LaunchResult


@dataclass
class SizeRun:
    """One launch at one world size and everything learnt from it."""

    result: SizeResult
    launch: LaunchResult
    outcomes: dict[int, protocol.RankResult]
    problems: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    gpu_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    snapshots: dict[int, Path] = field(default_factory=dict)  # rank -> torch allocator snapshot
    boxings: list[dict] = field(default_factory=list)  # rank 0's nn.Graph SBP conversions
    graph_inputs: list[dict] = field(default_factory=list)  # rank 0's nn.Graph inputs (their SBP and size)
    eager: list[Conversion] = field(default_factory=list)  # rank 0's eager global SBP conversions
    eager_problem: str = ""  # what the eager audit could not see, when it ran
    startups: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> its start-up (live, peak) MiB
    startup_files: dict[str, str] = field(default_factory=dict)  # rootdir files the ranks imported -> SHA-256

    @property
    def all_skipped(self) -> str | None:
        texts = {o.text for o in self.outcomes.values() if o.outcome == "skipped"}
        if self.outcomes and all(o.outcome == "skipped" for o in self.outcomes.values()):
            return "; ".join(sorted(texts))
        return None


@dataclass
class TestRun:
    test_id: str
    spec: Spec
    runs: list[SizeRun] = field(default_factory=list)
    skip_reason: str | None = None
    provenance: dict[str, str] = field(default_factory=dict)  # rank 0's view, newest launch
    predicted: list[SizeResult] = field(default_factory=list)  # sizes above the launch cap (scaling.py)
    unlaunched: dict[int, str] = field(default_factory=dict)  # sizes neither run nor predicted -> why

    @property
    def problems(self) -> list[str]:
        return [p for run in self.runs for p in run.problems]

    @property
    def results(self) -> list[SizeResult]:
        """Launched sizes, then the predicted ones (``result.predicted``)."""
        return [run.result for run in self.runs] + self.predicted

    @cached_property
    def readings(self) -> dict[int, GatedReading]:
        """Each size's gated reading, by world size: made once judging starts (the gate judges a copy)."""
        return {result.world_size: gated_reading(result, self.spec.rank) for result in self.results}
