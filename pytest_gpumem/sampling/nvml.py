"""GPU memory of each rank, read through NVML from the pytest process (never inside the ranks).

Per-process ``usedGpuMemory`` is what nvidia-smi shows (CUDA context, NCCL buffers, allocator cache
included); accounting mode, where the GPU's owner switched it on, gives the exact ``maxMemoryUsage``
after exit; in containers without the host PID namespace no pid matches, so a GPU held by one rank
falls back to device ``used`` minus idle. Without a driver everything degrades to "no GPUs" or
"not available", never an exception. GPU settings are only read here, never set.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from . import MiB, Peak

try:  # nvidia-ml-py installs `pynvml`; the plugin must import on machines without it
    import pynvml as _pynvml
except Exception:  # noqa: BLE001 - ImportError, or a binding that breaks while loading
    _pynvml = None

# A tick reads each GPU's ``used`` (memory-info v2, ~8 us on H200); the process list (~62 us,
# and it holds the driver's lock) is read only when ``used`` moved or LIST_REFRESH_S passed. So a
# 2 ms period catches millisecond spikes per process (H200: every spike of 1-50 ms, 256 MiB-2 GiB;
# at 5 ms, 1-2 ms spikes are missed) for ~2.3% of a core per GPU. See docs/gpu.md.
DEFAULT_INTERVAL_S = 0.002
LIST_REFRESH_S = 0.1
_MOVED_MIB = 1.0

_ULONGLONG_MAX = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE in 64-bit fields
_ACCOUNTING_SLACK_US = 2e6  # clock skew allowed when telling this launch's records from older ones
NOT_AVAILABLE = Peak(None, "not available")


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as NVML names it; ``accounting`` is the mode as found (read only, never set)."""

    index: int  # NVML index (PCI bus order), not necessarily the CUDA ordinal
    uuid: str
    name: str
    total_mib: float  # NaN where memory info is refused (MIG containers)
    accounting: bool


class _Absent(Exception):
    """Stands in for an error class the binding lacks, so `except` clauses stay valid."""


def _err(nvml: Any, *names: str) -> tuple[type[BaseException], ...]:
    return tuple(getattr(nvml, name, _Absent) for name in names)


def _nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """What a driverless machine or a binding/driver mismatch raises (the latter is no NVMLError)."""
    return (*_err(nvml, "NVMLError", "NVMLLibraryMismatchError"), OSError)


def _symbol_missing(nvml: Any) -> tuple[type[BaseException], ...]:
    # nvidia-ml-py's unversioned wrappers turn a missing driver symbol into NVMLLibraryMismatchError;
    # AttributeError: a binding too old to have the function at all.
    return (*_err(nvml, "NVMLError_FunctionNotFound", "NVMLLibraryMismatchError"), AttributeError)


def _bytes_or_none(value: Any) -> int | None:
    """None for NVML's "not available": None from the binding, or ULONGLONG_MAX passed through."""
    return None if value is None or not 0 <= value < _ULONGLONG_MAX else int(value)


def _accounting_enabled(nvml: Any, handle: Any) -> bool:
    try:
        return nvml.nvmlDeviceGetAccountingMode(handle) == nvml.NVML_FEATURE_ENABLED
    except _nvml_errors(nvml):
        return False  # unsupported (MIG, consumer parts) reads as "off"


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _compute_processes_v1(nvml: Any, handle: Any) -> list[Any]:
    """The v1 struct, for drivers without ``_v2`` (< R450); nvidia-ml-py >= 11.510 lacks a wrapper."""
    fn = nvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == nvml.NVML_SUCCESS:
        return []
    if ret == nvml.NVML_ERROR_INSUFFICIENT_SIZE:
        count.value = count.value * 2 + 5  # processes may start between the two calls
        buf = (_ProcessInfoV1 * count.value)()
        ret = fn(handle, ctypes.byref(count), buf)
        if ret == nvml.NVML_SUCCESS:
            return list(buf[: count.value])
    raise nvml.NVMLError(ret)


class _ProcessLister:
    """Compute + MPS process lists; the first version that works is kept, so probing costs once."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        # Unversioned = v3 in current nvidia-ml-py (v1 in very old ones); v3 needs driver >= 510.39.
        self._candidates: dict[str, list[Any]] = {
            "compute": ["nvmlDeviceGetComputeRunningProcesses",
                        "nvmlDeviceGetComputeRunningProcesses_v2", _compute_processes_v1],
            "mps": ["nvmlDeviceGetMPSComputeRunningProcesses",  # MPS clients: only here
                    "nvmlDeviceGetMPSComputeRunningProcesses_v2"],
        }

    def __call__(self, handle: Any) -> list[Any] | None:
        """Processes on the GPU, or None when this driver/binding has no process list at all."""
        procs = self._first_working("compute", handle)
        if procs is not None:
            try:
                procs += self._first_working("mps", handle) or []
            except _nvml_errors(self._nvml):
                pass  # MPS clients are a bonus: keep this tick's compute list
        return procs

    def _first_working(self, kind: str, handle: Any) -> list[Any] | None:
        """The processes from the first of ``kind``'s calls this binding has; those it lacks are dropped."""
        candidates = self._candidates[kind]
        while candidates:
            fn = candidates[0]
            try:
                if isinstance(fn, str):
                    return list(getattr(self._nvml, fn)(handle))
                return list(fn(self._nvml, handle))
            except _symbol_missing(self._nvml):
                candidates.pop(0)
        return None


def _total_mib(nvml: Any, handle: Any) -> float:
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle).total / MiB
    except _err(nvml, "NVMLError_GpuIsLost"):
        raise
    except _nvml_errors(nvml):
        return math.nan  # refused (MIG containers): the GPU is still usable


def _all_gpus(nvml: Any) -> list[GpuDevice]:
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(GpuDevice(index, str(nvml.nvmlDeviceGetUUID(handle)),
                                  str(nvml.nvmlDeviceGetName(handle)), _total_mib(nvml, handle),
                                  _accounting_enabled(nvml, handle)))
        except _nvml_errors(nvml):
            continue  # an unreadable GPU is one a launch cannot use
    return gpus


def select_visible(gpus: Sequence[GpuDevice], cuda_visible_devices: str | None) -> list[GpuDevice]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES over NVML's GPUs (the rules of torch's parser).

    Integers are taken as NVML indices (right with CUDA_DEVICE_ORDER=PCI_BUS_ID, and on machines of
    identical GPUs); UUIDs and unambiguous ``GPU-`` prefixes are exact. The first invalid entry
    ends the list, a repeated one empties it; MIG instances are not supported and end it.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    entries = [e.strip() for e in cuda_visible_devices.split(",")]
    by_uuid = entries[0].startswith("GPU-")
    chosen: list[GpuDevice] = []
    for entry in entries:
        if by_uuid:
            matches = [g for g in gpus if entry.startswith("GPU-") and g.uuid.startswith(entry)]
        else:
            number = re.match(r"\d+", entry)  # like strtoul: "1gpu" is 1; "-1", "", "x" stop
            matches = [g for g in gpus if number and g.index == int(number.group())]
        if len(matches) != 1:
            break
        if matches[0] in chosen:
            return []
        chosen.append(matches[0])
    return chosen


def _init(nvml: Any) -> bool:
    try:
        nvml.nvmlInit()
        return True
    except Exception:  # noqa: BLE001 - a broken binding (version mismatch, a stray pynvml) = no GPUs
        return False


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except _nvml_errors(nvml):
        pass


_held: list[Any] = []


def hold_open(nvml: Any = None) -> bool:
    """Keep NVML initialised until the process exits: every later nvmlInit/nvmlShutdown pair (each
    launch's GPU check, driver versions and sampler) is then a reference count, not the library's
    start and stop. For the pytest session that launches on GPUs."""
    nvml = _pynvml if nvml is None else nvml
    if nvml is None or any(held is nvml for held in _held) or not _init(nvml):
        return False
    import atexit

    _held.append(nvml)
    atexit.register(_shutdown, nvml)
    return True


def visible_gpus(env: Mapping[str, str] | None = None, nvml: Any = None) -> list[GpuDevice]:
    """The GPUs a child process would see, in CUDA order; [] when NVML cannot start (no driver)."""
    nvml = _pynvml if nvml is None else nvml
    if nvml is None or not _init(nvml):
        return []
    try:
        gpus = _all_gpus(nvml)
    except Exception:  # noqa: BLE001 - as in _init: a binding that half works gives no GPUs
        return []
    finally:
        _shutdown(nvml)
    return select_visible(gpus, (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))


def process_bytes(pid: int, index: int = 0, nvml: Any = None) -> int | None:
    """NVML's figure for one process on GPU ``index`` (NVML's order), or None where NVML cannot say
    (no driver, no process list, the pid not seen: a container without the host's pid namespace)."""
    nvml = _pynvml if nvml is None else nvml
    if nvml is None or not _init(nvml):
        return None
    try:
        procs = _ProcessLister(nvml)(nvml.nvmlDeviceGetHandleByIndex(index)) or []
        return max((_bytes_or_none(p.usedGpuMemory) or 0 for p in procs if int(p.pid) == pid), default=None)
    except _nvml_errors(nvml):
        return None
    finally:
        _shutdown(nvml)


def driver_versions(nvml: Any = None) -> dict[str, str]:
    """The NVIDIA driver and the CUDA version it supports: the CUDA context's size moves with them."""
    nvml = _pynvml if nvml is None else nvml
    if nvml is None or not _init(nvml):
        return {}
    found: dict[str, str] = {}
    try:
        with contextlib.suppress(*_nvml_errors(nvml), *_symbol_missing(nvml)):
            version = nvml.nvmlSystemGetDriverVersion()
            found["nvidia_driver"] = version.decode() if isinstance(version, bytes) else str(version)
        with contextlib.suppress(*_nvml_errors(nvml), *_symbol_missing(nvml)):
            cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
            found["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    finally:
        _shutdown(nvml)
    return found


def foreign_processes(device: GpuDevice, nvml: Any = None) -> list[int]:
    """PIDs of compute processes already on ``device``: they would share its memory; warn first."""
    nvml = _pynvml if nvml is None else nvml
    if nvml is None or not _init(nvml):
        return []
    try:
        procs = _ProcessLister(nvml)(nvml.nvmlDeviceGetHandleByUUID(device.uuid)) or []
        return sorted({int(p.pid) for p in procs})
    except _nvml_errors(nvml):
        return []
    finally:
        _shutdown(nvml)


@dataclass
class _Gpu:
    """Sampling state of one distinct GPU of the launch (two ranks on one GPU share it)."""

    device: GpuDevice
    handle: Any = None
    accounting: bool = False
    idle: float | None = None
    max_used: float | None = None
    lost: bool = False
    ranks_seen: set[int] = field(default_factory=set)
    procs: list[tuple[int, int | None]] = field(default_factory=list)  # last process list read
    listed_used: float | None = None  # device ``used`` when it was read
    listed_at: float = -math.inf

    def lose(self, exc: BaseException) -> str:
        """Stop sampling this GPU (it fell off the bus); what the report says about it."""
        self.lost = True
        return (f"GPU {self.device.index} ({self.device.uuid}) was lost mid-run ({exc}); "
                "its ranks keep only what was recorded before")


class NvmlSampler:
    """Every rank's GPU peak for one launch; ``devices[i]`` is the GPU of local rank i.

    ``problems`` lists what went wrong (lost GPU, unsupported metric) for the report.
    """

    def __init__(self, devices: Sequence[GpuDevice], interval_s: float = DEFAULT_INTERVAL_S,
                 nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.devices = tuple(devices)
        self.interval_s = interval_s
        self.problems: list[str] = []
        self._nvml = _pynvml if nvml is None else nvml
        self._clock = clock
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._wait: Callable[[float], bool] = self._stop_event.wait  # seam: tests drive the schedule
        self._thread: threading.Thread | None = None
        self._ready = self._stopped = False
        self._lister = _ProcessLister(self._nvml)
        self._mem_v2 = True
        self._gpus = {d.uuid: _Gpu(d) for d in self.devices}  # each GPU listed once per tick
        self._rank_of: dict[int, int] = {}  # pid -> rank
        self._mapped = 0  # how many pids the last recorded sample knew
        self._sampled: dict[int, float] = {}  # rank -> MiB, largest per-tick sum over its pids
        self._accounted: dict[int, float] = {}
        self._samples: list[tuple[float, dict[int, float], tuple[float | None, ...]]] = []
        self._t0 = self._wall_start_us = 0.0

    def start(self) -> None:
        """Read each GPU's idle ``used`` before the ranks exist, then sample on a daemon thread."""
        nvml = self._nvml
        if nvml is None:
            return self._note("NVML is not available: nvidia-ml-py (pynvml) cannot be imported")
        if not _init(nvml):
            return self._note("NVML cannot start (no NVIDIA driver?)")
        self._ready = True
        for gpu in self._gpus.values():
            try:
                gpu.handle = nvml.nvmlDeviceGetHandleByUUID(gpu.device.uuid)
            except _nvml_errors(nvml) as exc:
                gpu.lost = True
                self._note(f"GPU {gpu.device.index} ({gpu.device.uuid}) cannot be opened: {exc}")
                continue
            gpu.accounting = _accounting_enabled(nvml, gpu.handle)  # as it is now, not as listed
            gpu.idle = self._device_used(gpu)
        self._wall_start_us = time.time() * 1e6
        self._t0 = self._clock()
        self._thread = threading.Thread(target=self._run, name="gpumem-nvml-sampler", daemon=True)
        self._thread.start()

    def add_process(self, rank: int, pid: int) -> None:
        with self._lock:
            self._rank_of[pid] = rank

    def stop(self) -> None:
        """Stop the thread, take a last sample, read accounting records (exact after exit)."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                self._note("the NVML sampler thread did not stop within 10 s")
        if self._ready:
            self._tick()
            self._read_accounting()
            _shutdown(self._nvml)

    def peaks(self) -> dict[int, Peak]:
        with self._lock:
            ranks = set(range(len(self.devices))) | set(self._rank_of.values())
            return {rank: self._peak(rank) for rank in sorted(ranks)}

    def timeline(self) -> list[tuple[float, dict[int, float]]]:
        with self._lock:
            gpus = list(self._gpus.values())
            by_device = {rank: gpus.index(self._gpus[self.devices[rank].uuid])
                         for rank in range(len(self.devices))
                         if self._peak(rank).method == "device sampled"}
            rows = []
            for t, per_rank, used in self._samples:
                row = dict(per_rank)
                for rank, i in by_device.items():
                    now, idle = used[i], gpus[i].idle
                    if now is not None and idle is not None:
                        row[rank] = max(0.0, now - idle)
                if row:
                    rows.append((t, row))
            return rows

    # -- sampling thread -------------------------------------------------------------------------

    def _run(self) -> None:
        """Tick at t0 + k*interval: no drift; a late tick skips the missed slots, never bursts."""
        k = 0
        while True:
            self._tick()
            now = self._clock()
            k = max(k + 1, math.floor((now - self._t0) / self.interval_s) + 1)
            if self._wait(self._t0 + k * self.interval_s - now):
                return

    def _tick(self) -> None:
        try:
            self._sample()
        except Exception as exc:  # noqa: BLE001 - a sampler bug must not end sampling mid-launch
            self._note(f"NVML sampler error: {exc!r}")

    def _sample(self) -> None:
        t = self._clock() - self._t0
        with self._lock:
            rank_of = dict(self._rank_of)
        per_rank: dict[int, float] = {}
        seen: list[tuple[_Gpu, int]] = []
        used = tuple(self._device_used(gpu) for gpu in self._gpus.values())
        relisted = False
        for gpu, u in zip(self._gpus.values(), used):
            moved = u is None or gpu.listed_used is None or abs(u - gpu.listed_used) >= _MOVED_MIB
            if moved or t - gpu.listed_at >= LIST_REFRESH_S:
                gpu.procs = self._device_processes(gpu)
                gpu.listed_used, gpu.listed_at = u, t
                relisted = True
        if not relisted and len(rank_of) == self._mapped:
            return  # the hot path of a steady job: nothing moved, no new rank, nothing to record
        self._mapped = len(rank_of)
        for gpu in self._gpus.values():
            for pid, nbytes in gpu.procs:
                if pid in rank_of:
                    seen.append((gpu, rank_of[pid]))
                    if nbytes is not None:  # a rank on several GPUs: its nvidia-smi rows added up
                        per_rank[rank_of[pid]] = per_rank.get(rank_of[pid], 0.0) + nbytes / MiB
        with self._lock:
            for gpu, rank in seen:
                gpu.ranks_seen.add(rank)
            for rank, mib in per_rank.items():
                self._sampled[rank] = max(mib, self._sampled.get(rank, mib))
            for gpu, u in zip(self._gpus.values(), used):
                if u is not None:
                    gpu.max_used = u if gpu.max_used is None else max(u, gpu.max_used)
            s, row = self._samples, (t, per_rank, used)
            if len(s) >= 2 and s[-1][1:] == row[1:] == s[-2][1:]:
                s[-1] = row  # a plateau keeps its first and last point: bounded memory, same shape
            else:
                s.append(row)

    def _device_used(self, gpu: _Gpu) -> float | None:
        """Device ``used`` in MiB, from memory-info v2 (v1 also counts the driver's reservation)."""
        if gpu.lost:
            return None
        nvml = self._nvml
        try:
            if self._mem_v2:
                try:
                    info = nvml.nvmlDeviceGetMemoryInfo(gpu.handle, version=nvml.nvmlMemory_v2)
                    return info.used / MiB
                except _symbol_missing(nvml) + (TypeError,):
                    self._mem_v2 = False
                    self._note("NVML memory-info v2 is missing: device 'used' read with v1, "
                               "which includes the driver's reservation")
            return nvml.nvmlDeviceGetMemoryInfo(gpu.handle).used / MiB
        except _err(nvml, "NVMLError_GpuIsLost") as exc:
            self._note(gpu.lose(exc))
        except _nvml_errors(nvml) as exc:
            self._note(f"GPU {gpu.device.index}: device memory not available: {exc}")
        return None

    def _device_processes(self, gpu: _Gpu) -> list[tuple[int, int | None]]:
        if gpu.lost:
            return []
        try:
            procs = self._lister(gpu.handle)
        except _err(self._nvml, "NVMLError_GpuIsLost") as exc:
            self._note(gpu.lose(exc))
            return []
        except _nvml_errors(self._nvml) as exc:
            self._note(f"GPU {gpu.device.index}: process list not available: {exc}")
            return []
        if procs is None:
            self._note("this NVIDIA driver/binding offers no compute process list")
            return []
        found: dict[int, int | None] = {}  # a pid in both the compute and the MPS list counts once
        for p in procs:
            nbytes, before = _bytes_or_none(p.usedGpuMemory), found.get(int(p.pid))
            found[int(p.pid)] = nbytes if before is None else max(before, nbytes or 0)
        return list(found.items())

    def _read_accounting(self) -> None:
        """Per-pid ``maxMemoryUsage`` where accounting is on: exact, even for spikes between ticks."""
        nvml = self._nvml
        with self._lock:
            rank_of = dict(self._rank_of)
        for gpu in self._gpus.values():
            for pid, rank in rank_of.items():
                if gpu.lost or not gpu.accounting:
                    break
                try:
                    stats = nvml.nvmlDeviceGetAccountingStats(gpu.handle, pid)
                except _err(nvml, "NVMLError_NotFound"):
                    continue  # this pid never ran on this GPU
                except _err(nvml, "NVMLError_GpuIsLost") as exc:
                    self._note(gpu.lose(exc))
                    continue
                except _nvml_errors(nvml) as exc:
                    self._note(f"GPU {gpu.device.index}: accounting stats not available: {exc}")
                    continue
                nbytes = _bytes_or_none(stats.maxMemoryUsage)
                started = getattr(stats, "startTime", 0) or 0
                if nbytes is None or 0 < started < self._wall_start_us - _ACCOUNTING_SLACK_US:
                    continue  # the record of an older process that had the same pid
                with self._lock:
                    self._accounted[rank] = self._accounted.get(rank, 0.0) + nbytes / MiB

    # -- results -----------------------------------------------------------------------------------

    def _peak(self, rank: int) -> Peak:
        sampled, accounted = self._sampled.get(rank), self._accounted.get(rank)
        if accounted is not None:
            return Peak(max(accounted, sampled or 0.0), "accounting")
        if sampled is not None:
            return Peak(sampled, "per-pid sampled")
        by_device = self._device_fallback(rank)
        return NOT_AVAILABLE if by_device is None else Peak(by_device, "device sampled")

    def _device_fallback(self, rank: int) -> float | None:
        """Device used minus idle, only on a GPU this rank holds alone and no rank's pid showed on."""
        if rank >= len(self.devices) or any(rank in g.ranks_seen for g in self._gpus.values()):
            return None  # its pid showed up: per-pid numbers (or their absence) are the truth
        gpu = self._gpus[self.devices[rank].uuid]
        if sum(d.uuid == gpu.device.uuid for d in self.devices) != 1 or gpu.ranks_seen:
            return None  # shared with another rank, or another rank's pid is on it
        if gpu.idle is None or gpu.max_used is None or gpu.max_used <= gpu.idle:
            return None
        return gpu.max_used - gpu.idle

    def _note(self, message: str) -> None:
        with self._lock:
            if message not in self.problems:
                self.problems.append(message)
