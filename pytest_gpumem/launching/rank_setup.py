"""How a launch's ranks are set up, decided before it starts: what each rank runs, what it measures
of itself (host allocations, peak sites, the allocator's history, its own GPU), its environment,
and whether it is forked from pytest or exec'd."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from ..config.env_names import (
    GPU_IN_RANK_ENV,
    GPU_INTERVAL_ENV,
    HISTORY_ENV,
    PYTHON_ALLOCATIONS_ENV,
    ROOTDIR_ENV,
    SITES_ENV,
    SNAPSHOT_ENV,
    TRACK_ENV,
)
from ..config.spec import Spec
from ..rankside.received import ASSUME_ENV
from .gpus import GpuPlan
from .launchers import Launcher

EXEC_ASKED = "--gpumem-start=exec"
NOT_GPU = "not a GPU launch (auto forks those only)"
QUIET = (None, EXEC_ASKED, NOT_GPU)  # reasons the record does not repeat under start=auto
# ProcessGroupNCCL keeps each collective's tensors until its watchdog thread sees the collective done,
# on the thread's own period: a tensor the job frees in between stays counted by the allocator for a
# while, so an unchanged DDP job's max_memory_allocated read 1601.28 or 1857.33 MiB between runs
# (benchmarks/gpu/ddp_nccl_spread.py). A blocking wait hands them back at the wait: the figure holds.
# The wait changes the job: it frees earlier than the job as run, so the job as run reads higher, by an
# amount no launch can tell without running it both ways (benchmarks/gpu/blocking_wait.py).
NCCL_DEFAULTS = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
NCCL_DEFAULTS_NOTE = (
    "measured with TORCH_NCCL_BLOCKING_WAIT=1, the plugin's default, so that the allocator figure holds between "
    "runs; the job as run without it holds NCCL's finished work longer and reads higher (a DDP ResNet-50 on one "
    "H100: 3269.84 MiB as run, 3171.84 gated, +3.1%, benchmarks/results/blocking_wait.txt); "
    "env={'TORCH_NCCL_BLOCKING_WAIT': '0'} on the marker gates the job as run")


def nccl_defaults(gpu: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The GPU ranks' NCCL settings that make the allocator figure reproducible, unless the session
    sets them itself (a marker's env wins over both)."""
    return {k: v for k, v in NCCL_DEFAULTS.items() if gpu and k not in environ}


def nccl_defaults_note(provenance: Mapping[str, str], marker_env: Mapping[str, str],
                       environ: Mapping[str, str] = os.environ) -> str | None:
    """What a real GPU size says when the plugin's NCCL defaults reached its ranks (their recorded
    environment has them, and neither the session nor the marker set them)."""
    applied = [k for k, v in NCCL_DEFAULTS.items()
               if provenance.get(f"env.{k}") == v and k not in marker_env and k not in environ]
    return NCCL_DEFAULTS_NOTE if applied else None


@dataclass(frozen=True)
class RankSetup:
    """The session's settings for its ranks (the plugin's options, or gpumem measure's)."""

    rootdir: Path  # sites are named from here; a relative script= is found here
    rank_pytest_args: Callable[[str], list[str]]  # test id -> the rank's pytest arguments
    track_host: str = "auto"  # auto | on | off: memray in each rank (see tracks_host)
    sites: str = "auto"  # auto | on | off: peak sites (auto: GPU ones from a relaunch, TestDriver.relaunch_for_sites)
    gpu_history: bool = False  # record torch's allocator history in every launch (sites="on" does too)
    python_allocations: str = "objects"  # objects | arenas: how the tracker counts Python's
    gpu_sampler: str = "parent"  # "parent": NVML watched from pytest; "rank": each rank's own thread
    rank_env: Mapping[str, str] = field(default_factory=dict)  # the session's rank-side switches; a marker's env wins
    snapshot: bool = False  # each rank dumps torch's allocator snapshot (--gpumem-torch-snapshot)
    start: str = "auto"  # auto | fork | exec: how a direct launch starts its ranks (see fork_refusal)
    start_refusal: str | None = None  # the session's reason never to fork (pytest's settings)

    def argv(self, test_id: str, spec: Spec) -> tuple[str, ...]:
        if spec.script is not None:
            script = Path(spec.script)
            if not script.is_absolute():
                script = self.rootdir / script
            return ("script", str(script), *spec.args)
        if spec.module is not None:
            return ("module", spec.module, *spec.args)
        return ("pytest", *self.rank_pytest_args(test_id))

    def tracks_host(self, spec: Spec, plan: GpuPlan) -> bool:
        """Whether the ranks track their host allocations (memray, the gated host figure).

        Decided before the launch: where GPUs are leased and the spec's device is not "cpu", the
        figure will be GPU memory, and the tracker (1.1-2x a launch's time: it hooks every Python
        call and every allocation) would measure a figure that is not gated. Those ranks keep NVML,
        and their VmHWM as information. ``track_host=on`` tracks everywhere, ``off`` nowhere; a
        marker's env (GPUMEM_TRACK_ALLOCATIONS) wins over both.
        """
        if self.track_host in ("on", "off"):
            return self.track_host == "on"
        return not ((plan.sampler is not None or plan.fake_gpu) and spec.device != "cpu")

    def fork_refusal(self, spec: Spec, chosen: Launcher, plan: GpuPlan, env: Mapping[str, str]) -> str | None:
        """Why this launch's ranks are exec'd rather than forked from pytest (None: forked).

        auto forks GPU launches only: their figure is GPU memory, which a fork leaves as it is. A
        fake GPU's ranks are forked from its warm server (``fork_server``: its shim must be in before
        torch), not from pytest, so pytest's own settings do not forbid it. What the process itself
        may forbid (CUDA or OneFlow in pytest, other threads) is checked by the launch, at the fork
        (``forking.refusal``).
        """
        if self.start == "exec":
            return EXEC_ASKED
        if self.start == "auto" and not plan.fake_gpu and (plan.sampler is None or spec.device == "cpu"):
            return NOT_GPU
        if not chosen.per_rank:
            return f"launcher={chosen.name!r} starts the ranks itself"
        if not spec.body_mode:
            return "script= and module= run in a fresh interpreter"
        if env.get(TRACK_ENV) != "0":
            return "host allocations are tracked (a forked rank's start-up would be pytest's, not its own)"
        if self.in_rank_gpu(chosen, plan):
            return "each rank samples its own GPU (--gpumem-gpu-sampler=rank)"
        return None if plan.fake_gpu else self.start_refusal

    def in_rank_gpu(self, chosen: Launcher, plan: GpuPlan) -> bool:
        return chosen.remote or (plan.sampler is not None and self.gpu_sampler == "rank")

    def env(self, spec: Spec, chosen: Launcher, plan: GpuPlan, history: bool) -> dict[str, str]:
        """The ranks' environment: the session's switches, what they measure, the marker's env, the GPUs."""
        # Rank-side measurements: sites (named from the rootdir), torch's allocator history for GPU sites.
        # A fake GPU keeps its history in every launch: its one figure's curve, and no relaunch for sites.
        fake = bool(plan.fake_gpu) and self.sites != "off"
        keep_history = history or self.gpu_history or self.sites == "on" or fake
        side_env = {ROOTDIR_ENV: str(self.rootdir), SITES_ENV: "0" if self.sites == "off" else "1",
                    HISTORY_ENV: "1" if keep_history else "0",
                    PYTHON_ALLOCATIONS_ENV: self.python_allocations}
        if self.snapshot:
            side_env[SNAPSHOT_ENV] = "1"
        if spec.assume is not None:  # read by a simulated rank only
            side_env[ASSUME_ENV] = spec.assume
        if self.in_rank_gpu(chosen, plan):  # ranks elsewhere (srun) or asked for: each samples its own GPU
            side_env[GPU_IN_RANK_ENV] = "1"
            if plan.sampler is not None:
                side_env[GPU_INTERVAL_ENV] = str(plan.sampler.interval_s)
        track = {TRACK_ENV: "1" if self.tracks_host(spec, plan) else "0"}  # a marker's env wins
        return {**self.rank_env, **track, **nccl_defaults(plan.sampler is not None), **dict(spec.env), **plan.env,
                **side_env}

    def start_note(self, refused: str | None, refused_at_fork: str | None) -> str | None:
        """Why the ranks were exec'd, where the record says it: always when a fork was asked for;
        under auto, unless the reason is the usual one."""
        return refused_at_fork or (refused if refused not in QUIET or self.start == "fork" else None)


def pytest_argv(test_id: str, *, rootdir: Path, inipath: Path | None, xdist: bool, load_plugin: bool,
                tee: bool = False) -> list[str]:
    """The rank's own pytest: same rootdir and ini, just this test, no xfail/randomness games.

    ``xdist``: the ini's addopts may ask for workers, not inside a rank; ``load_plugin``: plugin
    autoload is off (PYTEST_DISABLE_PLUGIN_AUTOLOAD), so the rank names this plugin itself; ``tee``:
    the user's pytest runs with -s, so the body's output also goes to the rank's log as it is written
    (rank 0's is shown live), besides the capture that a failure's text quotes."""
    path, _, rest = test_id.partition("::")
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--runxfail", "--rootdir", str(rootdir)]
    if tee:  # -qq and no warnings summary: the body's own lines, little of the rank's pytest
        args += ["--capture=tee-sys", "-q", "--disable-warnings"]
    if inipath is not None:
        args += ["-c", str(inipath)]
    if xdist:
        args += ["-n", "0"]
    if load_plugin:
        args += ["-p", "pytest_gpumem.plugin"]
    return [*args, str(rootdir / path) + ("::" + rest if rest else "")]
