"""The composition root: the launching machinery built once from the resolved settings.

``pytest --gpumem`` (plugin), ``gpumem measure`` and, through them, ``gpumem refresh`` and ``gpumem
bisect`` all build their driver in :meth:`Session.from_settings`, so an option means the same in
each: a launcher option, the fail-fast grace or the snapshot folder cannot be honoured by one
command and forgotten by another.
What differs is passed in: where the ranks' pytest runs from and what it is given (a program for
``measure``), and pytest's own reasons never to fork.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config.settings import Settings

if TYPE_CHECKING:
    from .config.spec import Spec
    from .judging.gate import Gate, Outcome
    from .launching.driver import TestDriver
    from .launching.scaling import Capacity
    from .launching.watch import Watch

# The machinery (gate, driver, NVML, leases, baselines, psutil, filelock) is imported when a session
# is built, at the first gpumem test that runs: every pytest session where the plugin is installed
# imports this module's caller, and pays nothing until then (benchmarks/startup.py).


_NAMES = {"fake_gpu_model": "gpumem_fake_gpu_model", "plots": "--gpumem-plots"}  # as a session's options


def preflight(settings: Settings, *, fake_gpu: bool | None = None, plots: bool | None = None,
              names: Mapping[str, str] = _NAMES) -> str | None:
    """What makes a run unusable before any launch (a fake GPU model nobody measured, plots without
    matplotlib): the option as ``names`` calls it and what to do, or None (``gpumem measure``: its flags)."""
    if (settings.enabled and settings.fake_gpu != "off") if fake_gpu is None else fake_gpu:
        from .rankside.fakegpu.models import CALIBRATION_FILE, CalibrationError, model
        from .sampling.alloc_conf import AllocConfError, alloc_conf_from_env

        try:
            model(settings.fake_gpu_model, settings.baselines / CALIBRATION_FILE)
        except CalibrationError as exc:
            return f"{names['fake_gpu_model']}: {exc}"
        try:  # the fake GPU's caching allocator runs with the job's settings
            alloc_conf_from_env(os.environ)
        except AllocConfError as exc:
            return str(exc)
    if (settings.plots is not None) if plots is None else plots:
        from .presentation import plots as plotting

        try:
            plotting.check_available()
        except plotting.PlotsUnavailable as exc:
            return f"{names['plots']}: {exc}"
    return None


@dataclass
class Session:
    """One session's machinery: the driver that launches every size, the gate that judges a test,
    and the GPUs counted once for the sizes that may pass them."""

    settings: Settings
    driver: TestDriver
    gate: Gate
    _capacity: Capacity | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, *, rootdir: Path, cwd: Path,
                      rank_pytest_args: Callable[[str], list[str]], start_refusal: str | None = None,
                      watch: Watch | None = None) -> Session:
        """Everything a launch needs, from ``settings`` alone (and what only the caller knows: the
        rank's pytest, where the launches' progress and rank 0's output go)."""
        from .judging.baseline import BaselineStore
        from .judging.gate import Gate

        driver = _driver(settings, rootdir, cwd, rank_pytest_args, start_refusal, watch)
        return cls(settings=settings, driver=driver, gate=Gate(settings, BaselineStore(settings.baselines)))

    @property
    def capacity(self) -> Capacity:
        """How many ranks a launch may have; GPUs are counted at the first test that asks."""
        if self._capacity is None:
            from .launching import scaling
            from .sampling.nvml import visible_gpus

            self._capacity = scaling.Capacity(self.settings.max_nproc, self.settings.predict,
                                              lambda: len(visible_gpus()))
        return self._capacity

    def run(self, test_id: str, spec: Spec) -> Outcome:
        """One test, launched at its sizes and judged: a broken baseline file fails before any launch."""
        from .launching import scaling

        outcome = self.gate.before_launch(test_id, spec)
        if outcome is not None:
            return outcome
        relaunch = self.driver.relaunch_for_sites if self.settings.sites == "auto" else None
        return self.gate.evaluate(scaling.run(self.driver, test_id, spec, self.capacity), relaunch=relaunch)


def _driver(settings: Settings, rootdir: Path, cwd: Path, rank_pytest_args: Callable[[str], list[str]],
            start_refusal: str | None, watch: Watch | None = None) -> TestDriver:
    from .launching.driver import TestDriver
    from .launching.floor_cache import FloorCache
    from .launching.gpus import FakeGpus, GpuPlanner
    from .launching.launchers import LauncherOptions
    from .launching.leases import default_lease_dir
    from .launching.rank_setup import RankSetup
    from .launching.startups import Startups
    from .rankside.fakegpu.models import CALIBRATION_FILE

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
    return TestDriver(
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
        watch=watch,
    )
