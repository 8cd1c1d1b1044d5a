"""A fake ``pynvml`` (nvidia-ml-py) driven by a scripted timeline, for sampler tests without a GPU.

Only what ``pytest_gpumem.sampling.nvml`` touches is implemented, with the real binding's error
classes and quirks (unversioned calls raise NVMLLibraryMismatchError when the driver lacks the v3
symbol; v1 memory ``used`` includes the driver's reservation). Each GPU walks through a list of
snapshots: memory-info reads the current one and each compute-process-list call moves to the
next, so every snapshot is sampled exactly once whatever the thread timing; the last one stays.
Any call that would change a GPU setting is recorded in ``forbidden_calls`` and raises.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MiB = 1024 * 1024
ULONGLONG_MAX = 2**64 - 1
RAW_NOT_AVAILABLE = "raw ULONGLONG_MAX"  # a usage the binding passes through unconverted
_BY_CODE: dict[int, type] = {}


class NVMLError(Exception):
    value = 999

    def __new__(cls, value: int | None = None):
        if cls is NVMLError and value in _BY_CODE:  # NVMLError(13) -> NVMLError_FunctionNotFound
            cls = _BY_CODE[value]
        return Exception.__new__(cls)

    def __init__(self, value: int | None = None) -> None:
        if value is not None:
            self.value = value
        super().__init__(self.value)

    def __str__(self) -> str:
        return type(self).__name__.replace("NVMLError_", "")


def _error(name: str, code: int) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {"value": code})
    _BY_CODE[code] = cls
    return cls


NVMLError_Uninitialized = _error("Uninitialized", 1)
NVMLError_NotSupported = _error("NotSupported", 3)
NVMLError_NotFound = _error("NotFound", 6)
NVMLError_DriverNotLoaded = _error("DriverNotLoaded", 9)
NVMLError_LibraryNotFound = _error("LibraryNotFound", 12)
NVMLError_FunctionNotFound = _error("FunctionNotFound", 13)
NVMLError_GpuIsLost = _error("GpuIsLost", 15)


class NVMLLibraryMismatchError(Exception):
    """Like the real one: not an NVMLError."""


@dataclass
class Snap:
    """One moment on one GPU: device ``used`` (v2, MiB) and pid -> usedGpuMemory (MiB, None, raw)."""

    used_mib: float
    procs: dict[int, Any] = field(default_factory=dict)


@dataclass
class Acct:
    """An accounting record; ``start_us`` None means "started now" (i.e. during the launch)."""

    max_mib: float | None
    start_us: float | None = None


@dataclass
class FakeGpu:
    uuid: str
    snaps: list[Snap] = field(default_factory=lambda: [Snap(0.0)])
    name: str = "NVIDIA H200"
    total_mib: float = 143771.0
    reserved_mib: float = 615.0
    accounting: bool = False
    acct: dict[int, Acct] = field(default_factory=dict)
    mps: dict[int, float] = field(default_factory=dict)
    fail: dict[str, type[NVMLError]] = field(default_factory=dict)  # "memory"/"processes"/...
    lost_at: int | None = None  # from this snapshot on, every call raises GpuIsLost
    step: int = 0
    done: bool = False  # served its last snapshot, or lost


class FakeNvml:
    """Pass as ``nvml=``: module-like, one instance per scenario."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_SUCCESS = 0
    NVML_ERROR_INSUFFICIENT_SIZE = 7
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[FakeGpu], *, driver: bool = True, missing: tuple[str, ...] = ()):
        self.gpus = gpus  # NVML (PCI bus) order
        self.driver = driver
        self.missing = set(missing)  # C symbols this "driver" lacks, e.g. "..._v3"
        self.calls: list[str] = []
        self.forbidden_calls: list[str] = []
        self.init_count = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("nvmlDeviceSet", "nvmlDeviceClear", "nvmlDeviceReset", "nvmlSet")):
            def forbidden(*args: Any, **kwargs: Any) -> None:
                self.forbidden_calls.append(name)
                raise RuntimeError(f"the plugin must never change a GPU setting: {name}")
            return forbidden
        raise AttributeError(name)

    # -- library ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._log("nvmlInit")
        if not self.driver:
            raise NVMLError_LibraryNotFound()
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.init_count -= 1

    driver_version = "580.159.04"
    cuda_driver_version = 13000

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        if "nvmlSystemGetCudaDriverVersion" in self.missing:
            raise NVMLError_FunctionNotFound()
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        self._check()
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                self._alive(gpu, "handle")
                return gpu
        raise NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return self._alive(gpu, "uuid").uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return self._alive(gpu, "name").name

    def nvmlDeviceGetAccountingMode(self, gpu: FakeGpu) -> int:
        self._alive(gpu, "accounting_mode")
        return self.NVML_FEATURE_ENABLED if gpu.accounting else self.NVML_FEATURE_DISABLED

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu, version: int | None = None) -> SimpleNamespace:
        self._alive(gpu, "memory")
        used = gpu.snaps[gpu.step].used_mib
        if version is not None:
            self._log("nvmlDeviceGetMemoryInfo_v2")
            if "nvmlDeviceGetMemoryInfo_v2" in self.missing:
                raise NVMLError_FunctionNotFound()
            assert version == self.nvmlMemory_v2
            reserved = gpu.reserved_mib
        else:
            self._log("nvmlDeviceGetMemoryInfo")
            used, reserved = used + gpu.reserved_mib, 0.0  # v1 lumps the reservation into used
        total = gpu.total_mib
        return SimpleNamespace(total=int(total * MiB), reserved=int(reserved * MiB),
                               used=int(used * MiB), free=int((total - used - reserved) * MiB))

    # -- process lists: unversioned = v3, wrapped like nvidia-ml-py's throwOnVersionMismatch ----

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        self._log("nvmlDeviceGetComputeRunningProcesses")
        if "nvmlDeviceGetComputeRunningProcesses_v3" in self.missing:
            raise NVMLLibraryMismatchError("Unversioned function called ...")
        return self._processes(gpu)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        self._log("nvmlDeviceGetComputeRunningProcesses_v2")
        if "nvmlDeviceGetComputeRunningProcesses_v2" in self.missing:
            raise NVMLError_FunctionNotFound()
        return self._processes(gpu)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        self._log("nvmlDeviceGetMPSComputeRunningProcesses")
        if "nvmlDeviceGetMPSComputeRunningProcesses_v3" in self.missing:
            raise NVMLLibraryMismatchError("Unversioned function called ...")
        self._alive(gpu, "mps")
        return [SimpleNamespace(pid=pid, usedGpuMemory=int(mib * MiB)) for pid, mib in gpu.mps.items()]

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """The raw v1 C entry point, with C calling conventions (count by reference, 0 = success)."""
        self._check()
        if name in self.missing or name != "nvmlDeviceGetComputeRunningProcesses":
            raise NVMLError_FunctionNotFound()

        def c_function(gpu: FakeGpu, count_ref: Any, buf: Any) -> int:
            self._log("nvmlDeviceGetComputeRunningProcesses(v1 C)")
            procs = self._processes(gpu, advance=False)
            count = count_ref._obj
            if buf is None and procs:
                count.value = len(procs)
                return self.NVML_ERROR_INSUFFICIENT_SIZE
            for slot, proc in zip(buf if buf is not None else [], procs):
                slot.pid = proc.pid
                slot.usedGpuMemory = ULONGLONG_MAX if proc.usedGpuMemory is None else proc.usedGpuMemory
            count.value = len(procs)
            self._advance(gpu)
            return self.NVML_SUCCESS
        return c_function

    def nvmlDeviceGetAccountingStats(self, gpu: FakeGpu, pid: int) -> SimpleNamespace:
        self._alive(gpu, "accounting")
        if not gpu.accounting:
            raise NVMLError_NotSupported()
        if pid not in gpu.acct:
            raise NVMLError_NotFound()
        rec = gpu.acct[pid]
        return SimpleNamespace(
            maxMemoryUsage=None if rec.max_mib is None else int(rec.max_mib * MiB),
            startTime=int(time.time() * 1e6) if rec.start_us is None else int(rec.start_us),
            isRunning=0, time=100, gpuUtilization=0, memoryUtilization=0)

    # -- scripting -------------------------------------------------------------------------------

    def _processes(self, gpu: FakeGpu, advance: bool = True) -> list[SimpleNamespace]:
        self._alive(gpu, None)
        snap = gpu.snaps[gpu.step]
        error = gpu.fail.get("processes")
        if advance:
            self._advance(gpu)
        if error is not None:
            raise error()
        return [SimpleNamespace(pid=pid, usedGpuMemory=_usage(value), gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, value in snap.procs.items()]

    def _advance(self, gpu: FakeGpu) -> None:
        with self._lock:
            if gpu.step == len(gpu.snaps) - 1:
                gpu.done = True
            gpu.step = min(gpu.step + 1, len(gpu.snaps) - 1)
            if gpu.lost_at is not None and gpu.step >= gpu.lost_at:
                gpu.done = True

    def _alive(self, gpu: FakeGpu, what: str | None) -> FakeGpu:
        self._check()
        if gpu.lost_at is not None and gpu.step >= gpu.lost_at:
            gpu.done = True
            raise NVMLError_GpuIsLost()
        if what in gpu.fail:
            raise gpu.fail[what]()
        return gpu

    def _check(self) -> None:
        if self.init_count <= 0:
            raise NVMLError_Uninitialized()

    def _log(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)


def _usage(value: Any) -> int | None:
    if value is None:
        return None  # what nvidia-ml-py returns for NVML_VALUE_NOT_AVAILABLE
    if value == RAW_NOT_AVAILABLE:
        return ULONGLONG_MAX
    return int(value * MiB)


def uuid(n: int) -> str:
    """A realistic GPU UUID whose first hex digits are ``n`` repeated (for prefix tests)."""
    h = f"{n:x}" * 8
    return f"GPU-{h[:8]}-{h[:4]}-{h[:4]}-{h[:4]}-{h[:8]}{h[:4]}"
