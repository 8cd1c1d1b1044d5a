"""The composition root: the launching machinery built once from the resolved settings.

``pytest --gpumem`` (plugin), ``gpumem measure`` and, through them, ``gpumem refresh`` and ``gpumem
bisect`` all build their runner in :meth:`Session.from_settings`, so an option means the same in
each: a launcher option, the fail-fast grace or the snapshot folder cannot be honoured by one
command and forgotten by another.
What differs is passed in: where the ranks' pytest runs from and what it is given (a program for
``measure``), and pytest's own reasons never to fork.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config.settings import Settings
from .gate import Gate
from .judging.baseline import BaselineStore
from .launching.floor_cache import FloorCache
from .launching.gpus import FakeGpus, GpuPlanner
from .launching.launcher import LauncherOptions
from .launching.leases import default_lease_dir
from .launching.rank_setup import RankSetup
from .launching.runner import Runner
from .launching.startups import Startups
from .rankside.fakegpu.models import CALIBRATION_FILE


@dataclass(frozen=True)
class Session:
    """One session's machinery: the runner that launches every size, the gate that judges a test."""

    settings: Settings
    runner: Runner
    gate: Gate

    @classmethod
    def from_settings(cls, settings: Settings, *, rootdir: Path, cwd: Path,
                      rank_pytest_args: Callable[[str], list[str]], start_refusal: str | None = None) -> Session:
        """Everything a launch needs, from ``settings`` alone (and what only the caller knows)."""
        return cls(settings=settings, runner=_runner(settings, rootdir, cwd, rank_pytest_args, start_refusal),
                   gate=Gate(settings, BaselineStore(settings.baselines)))


def _runner(settings: Settings, rootdir: Path, cwd: Path, rank_pytest_args: Callable[[str], list[str]],
            start_refusal: str | None) -> Runner:
    interval = settings.interval_ms / 1000.0 if settings.interval_ms else None
    setup = RankSetup(
        rootdir=rootdir,
        rank_pytest_args=rank_pytest_args,
        track_host=settings.track_host,
        sites=settings.sites,
        gpu_history=settings.refresh,  # a refresh stores the sites of GPU sizes too
        python_allocations=settings.python_allocations,
        gpu_sampler=settings.gpu_sampler,
        rank_env=settings.rank_env(),
        snapshot=settings.torch_snapshot is not None,
        start=settings.start,
        start_refusal=start_refusal,
    )
    return Runner(
        cwd=cwd,
        setup=setup,
        gpu_setup=GpuPlanner.lazy(settings.lease_dir or default_lease_dir(), settings.lease_wait, interval),
        host_interval_s=interval,
        snapshot_dir=settings.torch_snapshot,
        floor=settings.floor,
        floor_cache=FloorCache(settings.floor_cache) if settings.floor_cache is not None else None,
        launcher_options=LauncherOptions(settings.slurm_dir, settings.srun_args, settings.nnodes or None),
        fail_fast_grace=settings.fail_fast_grace,
        startups=Startups(settings.host_startup, settings.startup_cache, rootdir),
        fake_gpus=FakeGpus(settings.fake_gpu_model, settings.baselines / CALIBRATION_FILE),
    )
