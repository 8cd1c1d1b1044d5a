"""Which GPUs a launch gets and who watches them; none at all on a machine without GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config.spec import Spec
from ..rankside.fakegpu import CALIBRATION_ENV, FAKE_GPU_ENV
from ..sampling.identity import fake_gpu_name
from ..sampling.nvml import (
    DEFAULT_INTERVAL_S,
    NvmlSampler,
    driver_versions,
    foreign_processes,
    hold_open,
    visible_gpus,
)
from .leases import GpuLeases, LeaseError


@dataclass
class GpuPlan:
    """What a launch gets on the GPU side: visible devices for the ranks and a sampler."""

    env: dict[str, str] = field(default_factory=dict)
    sampler: NvmlSampler | None = None
    gpu_name: str | None = None
    release: Callable[[], None] = lambda: None
    skip_reason: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)  # driver versions, for the baseline
    fake_gpu: str | None = None  # the GPU model a fake GPU emulates (rankside.fakegpu); None: real


@dataclass(frozen=True)
class FakeGpus:
    """A launch on a fake GPU: no device leased or watched, the ranks told which model to emulate
    (and the calibration file that may describe it)."""

    model: str
    calibration: Path | None = None

    def __call__(self, spec: Spec, nproc: int, owner: str) -> GpuPlan:
        env = {FAKE_GPU_ENV: self.model}
        if self.calibration is not None and self.calibration.exists():
            env[CALIBRATION_ENV] = str(self.calibration)
        return GpuPlan(env=env, gpu_name=fake_gpu_name(self.model), fake_gpu=self.model,
                       provenance={"fake_gpu": self.model})


class GpuPlanner:
    """Leases ``nproc`` whole GPUs per launch and pins the ranks to them by UUID."""

    def __init__(self, leases: GpuLeases | None, interval_s: float | None = None, nvml: Any = None) -> None:
        self.leases = leases
        self.interval_s = interval_s or DEFAULT_INTERVAL_S
        self.nvml = nvml  # None: the real binding; tests pass a fake at this boundary

    @classmethod
    def for_this_machine(cls, lease_dir: Path, wait_s: float, interval_s: float | None,
                         nvml: Any = None) -> "GpuPlanner":
        gpus = visible_gpus(nvml=nvml)
        return cls(GpuLeases(lease_dir, gpus, wait_s) if gpus else None, interval_s, nvml)

    @classmethod
    def lazy(cls, lease_dir: Path, wait_s: float, interval_s: float | None) -> Callable[[Spec, int, str], GpuPlan]:
        """Look for GPUs at the first launch, not when pytest starts: a session that launches
        nothing (no --gpumem) never touches NVML."""
        planner: list[GpuPlanner] = []

        def plan(spec: Spec, nproc: int, owner: str) -> GpuPlan:
            if not planner:
                planner.append(cls.for_this_machine(lease_dir, wait_s, interval_s))
                if planner[0].leases is not None:
                    hold_open()  # this session launches on GPUs: NVML stays up between launches
            return planner[0](spec, nproc, owner)

        return plan

    def __call__(self, spec: Spec, nproc: int, owner: str) -> GpuPlan:
        if spec.device == "cpu":
            return GpuPlan()
        have = len(self.leases.gpus) if self.leases else 0
        if nproc > have:
            if spec.device == "auto" and have == 0:
                return GpuPlan()  # a machine without GPUs: host memory is what counts
            return GpuPlan(skip_reason=f"needs {nproc} GPU(s) for nproc={nproc} but this machine has {have}")
        assert self.leases is not None  # have > 0
        try:
            lease = self.leases.acquire(nproc, owner)
        except LeaseError as exc:
            return GpuPlan(error=str(exc))
        notes = []
        for device in lease.devices:
            pids = foreign_processes(device, nvml=self.nvml)
            if pids:
                notes.append(f"GPU {device.index} ({device.uuid}) already had compute processes "
                             f"{pids} before the launch: device-level numbers include them")
        return GpuPlan(
            env={"CUDA_VISIBLE_DEVICES": visible_devices(lease.devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            sampler=NvmlSampler(lease.devices, self.interval_s, nvml=self.nvml),
            gpu_name=lease.devices[0].name,
            release=lease.release,
            notes=notes,
            provenance=driver_versions(self.nvml),
        )


def visible_devices(devices: Any) -> str:
    """CUDA_VISIBLE_DEVICES for a lease: NVML's indices, in PCI bus order as CUDA_DEVICE_ORDER then
    numbers them, not UUIDs: frameworks parse the variable as integers (DeepSpeed's ZeRO-1/2 fails on
    a UUID). MIG instances are never leased (sampling.nvml.select_visible)."""
    return ",".join(str(d.index) for d in devices)
