"""What runs inside a rank: ``python -m pytest_gpumem.rankside.rank pytest|script|module TARGET [ARGS...]``.

(``... rank exec PROGRAM [ARGS...]`` starts a launcher the same way: bound to die with pytest.)

Whatever launcher started it, the rank announces its pid (so the parent can sample it), sends
its output to a per-rank log, arms a stack dump on SIGUSR1 (used before a hung launch is
killed), tracks its own allocations (the gated host figure: the peak of live allocations), runs
the target, and at exit writes that peak, its resident high-water mark (information) and the
versions of the frameworks it imported.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config.env_names import (
    BOXING_ENV,
    FAST_EXIT_ENV,
    GPU_IN_RANK_ENV,
    GPU_INTERVAL_ENV,
    HISTORY_ENV,
    PYTHON_ALLOCATIONS_ENV,
    ROOTDIR_ENV,
    SITES_ENV,
    SLOT_ENV,
    SNAPSHOT_ENV,
    STARTUP_ENV,
    TRACK_ENV,
    WORKDIR_ENV,
)

if TYPE_CHECKING:
    from ..sampling.allocations import AllocationTracker
    from ..sampling.nvml import NvmlSampler
    from .gpu_allocator import TorchAllocator

# Light on purpose: plugin.py imports this module in every pytest session (for declare_config),
# so what only a rank needs (baseline, boxing, rendezvous, runpy, ctypes, resource) is imported where used.


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the folder was removed under us
        return None


# The folder this interpreter started in, which it resolved relative PYTHONPATH entries against
# (plugin.py imports this module as pytest starts, before pytester or a test changes folder):
# the launch hands the ranks those entries made absolute (launching.supervise.absolute_pythonpath).
STARTUP_CWD = _cwd()

@dataclass
class ThisRank:
    """This process's measuring machinery, set once by :func:`main` and read by the plugin's in-rank
    side (``allocator``, ``startup_ended``): one object, not a module global each."""

    allocator: "TorchAllocator | None" = None  # the torch CUDA allocator watch
    tracker: "AllocationTracker | None" = None  # the host tracker, while its test's setup is to end or begin a capture
    startup: tuple[float, float] | None = None  # the start-up's (live, peak) MiB handed in by the parent
    report: "Callable[[], None] | None" = None  # writes the exit report (registered with atexit too)


this_rank = ThisRank()


def startup_ended() -> None:
    """Called as the rank's test starts its setup: the job's capture begins here, the start-up's
    figures handed in by the parent; in a start-up probe, the capture ends and the rank with it.

    The collector runs first, so that the start-up's garbage is not in its live figure (the probe)
    and the job starts from the same collector state in every launch.
    """
    tracker, this_rank.tracker = this_rank.tracker, None
    if tracker is None:
        return
    import gc

    gc.collect()
    if this_rank.startup is not None:
        tracker.startup = this_rank.startup
        tracker.start()
        return
    # A probe: its figures (or its problem) go into the exit report, written now. The rank ends at
    # once: the frameworks' shutdown could wait for peers that have already ended theirs.
    tracker.end_startup()
    if this_rank.report is not None:
        this_rank.report()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _startup_given(value: str, rank: int) -> tuple[float, float] | None:
    """This rank's ``LIVE/PEAK`` MiB out of ``0=LIVE/PEAK;1=...`` as the parent writes it; None otherwise."""
    for part in value.split(";"):
        name, _, figures = part.partition("=")
        live, _, peak = figures.partition("/")
        if name.strip() == str(rank):
            try:
                return float(live), float(peak)
            except ValueError:
                return None
    return None


def allocator() -> "TorchAllocator | None":
    """The rank's torch allocator watch, for the test body's start and end (rank_plugin.RankSide)."""
    return this_rank.allocator


def file_rank() -> int:
    """The rank under which this process's files are written and read (``rank-<r>.*``)."""
    return int(os.environ.get(SLOT_ENV) or os.environ.get("RANK", "0"))


def switched_off(name: str) -> bool:
    """A rank-side switch set to 0/false/no/off (a marker's ``env`` may spell it any of these ways)."""
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no", "off")


def declare_config(settings: dict[str, object]) -> None:
    """Inside a rank: record settings that move memory (the ``gpumem_config`` fixture); elsewhere a no-op."""
    workdir = os.environ.get(WORKDIR_ENV)
    if workdir:
        from . import protocol

        protocol.update_config(Path(workdir), file_rank(), settings)


def framework_versions() -> dict[str, str]:
    """Versions of the frameworks this rank actually imported (they move memory the most)."""
    found: dict[str, str] = {}
    flow = sys.modules.get("oneflow")
    if flow is not None:
        found["oneflow"] = str(getattr(flow, "__version__", "?"))
        commit = getattr(flow, "__git_commit__", None)
        if commit:
            found["oneflow_commit"] = str(commit)
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = str(getattr(torch, "__version__", "?"))
        version = getattr(torch, "version", None)
        for attr, key in (("cuda", "torch_cuda"), ("git_version", "torch_commit")):
            value = getattr(version, attr, None)
            if value:
                found[key] = str(value)
        nccl = getattr(getattr(torch, "cuda", None), "nccl", None)
        try:
            found["nccl"] = ".".join(map(str, nccl.version())) if nccl is not None else ""
        except Exception:  # no CUDA build: there is no NCCL to report
            pass
        found = {k: v for k, v in found.items() if v}
    return found


def peak_rss_kib() -> float:
    """This process's high-water mark of resident memory, in KiB.

    On Linux ``VmHWM`` of /proc/self/status, not ``ru_maxrss``: the kernel carries the
    parent's peak into ``ru_maxrss`` across fork/vfork + exec, so a rank started from a pytest
    that had imported torch would report pytest's memory.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    except OSError:
        pass
    import resource  # POSIX only; not reached on Linux

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 1024 if sys.platform == "darwin" else float(maxrss)  # bytes on macOS


def _start_gpu_sampler() -> "NvmlSampler | None":
    """This rank's own GPU figure, sampled by a thread in the rank (for launches whose ranks the
    parent cannot see, e.g. on other nodes): NVML's per-process figure for our PID, same methods."""
    from ..sampling.nvml import DEFAULT_INTERVAL_S, NvmlSampler, visible_gpus

    gpus = visible_gpus()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not gpus:
        return None
    sampler = NvmlSampler([gpus[local % len(gpus)]],
                          float(os.environ.get(GPU_INTERVAL_ENV, "0") or 0) or DEFAULT_INTERVAL_S)
    sampler.add_process(0, os.getpid())
    sampler.start()
    return sampler


def _gpu_report(sampler: "NvmlSampler | None") -> dict[str, Any]:
    if sampler is None:
        return {}
    sampler.stop()
    peak = sampler.peaks()[0]
    return {"gpu_peak_mib": peak.mib, "gpu_method": f"{peak.method}, in the rank",
            "gpu_name": sampler.devices[0].name, "gpu_problems": list(sampler.problems)}


def _report_exit(workdir: Path, rank: int, tracker: "AllocationTracker", gpu_sampler: "NvmlSampler | None",
                 torch_allocator: "TorchAllocator") -> None:
    from ..oneflow.boxing import rank_provenance
    from ..oneflow.conversions import eager_provenance
    from ..oneflow.cuda_on_cpu import cuda_on_cpu_provenance
    from ..oneflow.eager import write_records
    from ..sampling.allocations import METHOD as ALLOC_METHOD
    from ..sampling.identity import cpu_provenance, host_provenance
    from . import fakegpu, protocol, simulate

    write_records()  # first: it stops the line tracer
    alloc_mib = tracker.stop()
    gpu_allocator = torch_allocator.report()  # after the tracker: reading the history allocates
    if gpu_allocator and fakegpu.active:
        gpu_allocator["fake_gpu"] = fakegpu.describe(gpu_allocator.get("reserved_mib"))
    provenance = {**host_provenance(os.environ), **cpu_provenance(), **framework_versions(),
                  **rank_provenance(protocol.rank_file(workdir, rank, "boxing")),
                  **eager_provenance(protocol.rank_file(workdir, rank, "eager")), **cuda_on_cpu_provenance()}
    measured = tracker.startup if this_rank.startup is None else None  # a probe's
    protocol.write_exit(workdir, rank, protocol.ExitReport(
        pid=os.getpid(), maxrss_kib=peak_rss_kib(), alloc_peak_mib=alloc_mib, alloc_method=ALLOC_METHOD,
        alloc_problem=tracker.problem, provenance=provenance, alloc_sites=tracker.sites,
        alloc_timeline=[[t, mib] for t, mib in tracker.timeline], sites_problem=tracker.sites_problem,
        gpu_allocator=gpu_allocator, simulation=list(simulate.notes), uncounted=list(simulate.uncounted),
        alloc_startup=None if measured is None else list(measured),
        startup_files=_local_files() if measured is not None else {}, **_gpu_report(gpu_sampler)))


def _local_files() -> dict[str, str]:
    """The Python files this rank imported from outside its interpreter's installation (the
    rootdir's, by path relative to it; others, by absolute path) -> SHA-256: what a cached start-up
    depends on besides the installed versions (launching.startups checks them)."""
    import hashlib

    root = os.environ.get(ROOTDIR_ENV)
    top = Path(root).resolve() if root else None
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name:
            continue
        path = Path(name).resolve()
        if any(path.is_relative_to(prefix) for prefix in installed):  # versioned: in the key
            continue
        inside = top is not None and path.is_relative_to(top)
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
        found[path.relative_to(top).as_posix() if top is not None and inside else str(path)] = digest
    return dict(sorted(found.items()))


def _die_with_parent() -> None:
    """SIGKILL this rank when its parent (pytest, or the launcher) dies, even by SIGKILL.

    The ranks run in sessions of their own, so nothing else would reach them; a rank whose parent
    is already gone ends at once.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _exit_fast(code: object) -> None:
    """End a rank the way the interpreter would, minus its module teardown.

    Python threads are joined and every atexit handler runs (the frameworks' own shutdown, then
    our exit report), but the interpreter's finalisation and C++ static destructors are skipped:
    measured here 150-500 ms per rank, which the kernel does anyway. ``GPUMEM_FAST_EXIT=0`` keeps
    the normal exit, and so does a rank that imported OneFlow: its teardown waits for its peers'.
    Ended without it, a rank is gone while a slower peer still runs its exit handlers, whose OneFlow
    control client then aborts it ("Machine 1 lost", SIGABRT) before its exit report: under load,
    a healthy job's rank 0 was gated on its VmHWM (issue 64).
    """
    if switched_off(FAST_EXIT_ENV) or "oneflow" in sys.modules:
        raise SystemExit(code)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001 - what Py_Finalize does first
    atexit._run_exitfuncs()  # noqa: SLF001 - then this
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status))


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> None:
    if argv[:1] == ["exec"]:  # a launcher (torchrun, OneFlow's) that must die with pytest
        _die_with_parent()
        os.execv(argv[1], argv[1:])
    if len(argv) < 2 or argv[0] not in ("pytest", "script", "module"):
        raise SystemExit("usage: python -m pytest_gpumem.rankside.rank pytest|script|module|exec TARGET [ARGS...]")
    mode, target, args = argv[0], argv[1], argv[2:]
    import runpy

    from ..oneflow.boxing import install_graph_hook
    from ..oneflow.cuda_on_cpu import cuda_on_cpu_requested, install_cuda_on_cpu
    from ..oneflow.eager import install_eager_hook
    from ..oneflow.rendezvous import install_oneflow_gate
    from ..sampling import identity  # noqa: F401  (loaded now rather than in the exit path: _report_exit)
    from ..sampling.allocations import AllocationTracker
    from . import fakegpu, protocol, simulate
    from .gpu_allocator import TorchAllocator
    from .imports import after_import

    _die_with_parent()
    workdir = Path(os.environ[WORKDIR_ENV])
    rank = file_rank()
    simulated = simulate.world()
    if simulated is not None:  # before the target imports torch: its process groups are the stand-in
        simulate.install_world(simulated)

    _redirect_output(protocol.rank_file(workdir, rank, "log"))
    fake_gpu = fakegpu.requested()
    if fake_gpu is not None:  # before the target imports torch: the CUDA shim must be in first
        fakegpu.install(fake_gpu, os.environ.get(fakegpu.CALIBRATION_ENV))
    if cuda_on_cpu_requested():  # a OneFlow job written for CUDA, no GPU: before the job imports OneFlow
        install_cuda_on_cpu(after_import)
    stack_file = open(protocol.rank_file(workdir, rank, "stack"), "w")  # kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    install_oneflow_gate()  # costs nothing until oneflow is imported
    sites = not switched_off(SITES_ENV)
    root = Path(os.environ[ROOTDIR_ENV]) if os.environ.get(ROOTDIR_ENV) else None
    if not switched_off(BOXING_ENV):  # costs nothing until oneflow is imported
        install_graph_hook(protocol.rank_file(workdir, rank, "boxing"), root)
        install_eager_hook(protocol.rank_file(workdir, rank, "eager"), root, protocol.rank_file(workdir, rank, "glog"))
    objects = os.environ.get(PYTHON_ALLOCATIONS_ENV, "objects").strip().lower() != "arenas"
    tracker = AllocationTracker(protocol.rank_file(workdir, rank, "memray"), sites=sites, root=root, objects=objects)
    startup = os.environ.get(STARTUP_ENV, "") if mode == "pytest" else ""
    this_rank.startup = _startup_given(startup, rank)
    if not switched_off(TRACK_ENV):
        if startup == "probe" or this_rank.startup is not None:
            this_rank.tracker = tracker  # ended, or started, where the test's setup begins (startup_ended)
        if this_rank.startup is None:
            tracker.start()  # before the target imports anything: the frameworks' own allocations count
    history = sites and os.environ.get(HISTORY_ENV) == "1"
    watch = this_rank.allocator = TorchAllocator(history=history or bool(os.environ.get(SNAPSHOT_ENV)), root=root)
    watch.install()  # costs nothing until torch is imported, starts no CUDA
    gpu_sampler = _start_gpu_sampler() if os.environ.get(GPU_IN_RANK_ENV) == "1" else None
    protocol.write_hello(workdir, rank)
    # Runs last: after the frameworks' own shutdown.
    this_rank.report = functools.partial(_report_exit, workdir, rank, tracker, gpu_sampler, watch)
    atexit.register(this_rank.report)

    if mode == "pytest":
        sys.argv = ["pytest", target, *args]
        try:
            runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            _exit_fast(exc.code)
        _exit_fast(0)
    elif mode == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the plugin, which the rank's pytest loads,
    # reads this rank's state (the allocator watch, the host tracker) from pytest_gpumem.rankside.rank.
    from . import rank as _rank  # run with -m: this package is __package__

    _rank.main(sys.argv[1:])
