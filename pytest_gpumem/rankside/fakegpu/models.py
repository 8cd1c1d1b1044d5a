"""The GPU models a fake GPU emulates, and their calibration.

A fake GPU stands for one model: its device properties (the name, compute capability, memory and
multiprocessor count a job or torch reads to choose kernels), and what that model's libraries hold
through the caching allocator beyond the job's tensors: cuBLAS's workspace (one per thread and
stream that runs a matrix product; the forward and the autograd thread make two) and cuBLASLt's.
Those were measured on the real GPU (``gpumem calibrate`` records them on a team's own GPU, into
``gpumem-calibration.json`` beside the baselines, which then wins over the built-in figures), and so
was what lives outside the allocator (``OUTSIDE``), from which a fake GPU predicts the device figure.

To add a model: run ``gpumem calibrate`` on it and commit the file, or add it to ``BUILT_IN``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

MiB = 1024 * 1024
CALIBRATION_FILE = "gpumem-calibration.json"
SCHEMA = 1


# What a process holds on the GPU beyond the caching allocator's segments, by part, as NVML's figure for
# the process less torch's memory_reserved() grew (gpumem calibrate measures each on the real GPU):
OUTSIDE = {
    "context": "the CUDA context, once torch has initialised CUDA and run its first kernels",
    "cublas": "cuBLAS's and cuBLASLt's kernels, loaded at the first matrix product (forward and backward)",
    "cudnn": "cuDNN's handle and kernels, loaded at the first convolution or batch norm",
    "attention": "the fused attention kernels, loaded at the first scaled_dot_product_attention",
    "nccl": "an NCCL communicator of one rank and its buffers, made at the first collective",
}


class CalibrationError(ValueError):
    """A calibration file or model that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class GpuModel:
    """One GPU model as a fake GPU emulates it."""

    name: str  # as torch.cuda.get_device_name and NVML give it: the baselines' platform key
    major: int
    minor: int
    total_memory: int  # bytes
    multi_processor_count: int
    cublas_workspace: int  # bytes the caching allocator holds for cuBLAS, per thread that runs a GEMM
    cublaslt_workspace: int  # bytes for cuBLASLt (a GEMM with bias or epilogue), per thread
    outside: Mapping[str, int] = field(default_factory=dict)  # bytes by part of OUTSIDE; empty: not calibrated
    source: str = "built in"  # where the figures come from: "built in", or the calibration file
    measured_with: Mapping[str, str] = field(default_factory=dict)  # torch, CUDA, driver of the measurement

    def properties(self) -> dict[str, Any]:
        """What ``torch.cuda.get_device_properties`` reports for it."""
        return {"name": self.name, "major": self.major, "minor": self.minor, "total_memory": self.total_memory,
                "multi_processor_count": self.multi_processor_count, "is_integrated": 0,
                "is_multi_gpu_board": 0, "warp_size": 32, "L2_cache_size": 50 * MiB,
                "gcnArchName": "", "uuid": "GPU-00000000-0000-0000-0000-000000000000"}


# Measured on the lent H200 with torch 2.11.0+cu130 (benchmarks/results/fake_gpu_calibration.txt,
# `gpumem calibrate`): device properties as torch reports them, the workspaces as the allocator grew.
# The H100's, with what lives outside the allocator, on the lent H100 with torch 2.11.0+cu130, driver
# 580.159.04 (benchmarks/results/device_figure/: `gpumem calibrate`, and the jobs it predicts).
BUILT_IN: dict[str, GpuModel] = {
    "NVIDIA H200": GpuModel(
        name="NVIDIA H200", major=9, minor=0, total_memory=150_754_820_096, multi_processor_count=132,
        cublas_workspace=32 * MiB, cublaslt_workspace=1 * MiB,
        measured_with={"torch": "2.11.0+cu130"}),
    "NVIDIA H100 80GB HBM3": GpuModel(
        name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_017_493_504, multi_processor_count=132,
        cublas_workspace=32 * MiB, cublaslt_workspace=1 * MiB,
        outside={"context": 610 * MiB, "cublas": 132 * MiB, "cudnn": 16 * MiB, "attention": 0, "nccl": 562 * MiB},
        measured_with={"torch": "2.11.0+cu130", "cuda": "13.0", "driver": "580.159.04"}),
}
DEFAULT_MODEL = "NVIDIA H200"


def model(name: str, calibration: Path | None = None) -> GpuModel:
    """The model called ``name``: from the calibration file when it has it, else built in."""
    found = read_calibration(calibration) if calibration is not None and calibration.exists() else {}
    if name in found:
        return found[name]
    if name in BUILT_IN:
        return BUILT_IN[name]
    known = sorted(set(BUILT_IN) | set(found))
    where = f" or in {calibration}" if calibration is not None else ""
    raise CalibrationError(f"fake GPU model {name!r} is not built in{where}: known models are "
                           f"{', '.join(repr(k) for k in known)}; run `gpumem calibrate` on that GPU to add it")


def read_calibration(path: Path) -> dict[str, GpuModel]:
    """Every model in a calibration file, each field checked; a bad file is named with its field."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: not a readable JSON calibration file ({exc}); "
                               "run `gpumem calibrate` on the GPU again, or delete it") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("models"), dict):
        raise CalibrationError(f"{path}: expected {{\"schema\": {SCHEMA}, \"models\": {{...}}}} "
                               "as `gpumem calibrate` writes it")
    out = {}
    names = {f.name: f.type for f in fields(GpuModel)}
    for name, entry in doc["models"].items():
        if not isinstance(entry, dict):
            raise CalibrationError(f"{path}: models[{name!r}] is not an object")
        values: dict[str, Any] = {}
        for key in ("major", "minor", "total_memory", "multi_processor_count", "cublas_workspace",
                    "cublaslt_workspace"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CalibrationError(f"{path}: models[{name!r}].{key} = {value!r}: expected an integer >= 0")
            values[key] = value
        outside = entry.get("outside", {})
        if not isinstance(outside, dict) or not all(
                k in OUTSIDE and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in outside.items()):
            raise CalibrationError(f"{path}: models[{name!r}].outside = {outside!r}: expected an object from "
                                   f"{', '.join(OUTSIDE)} to integers >= 0 (bytes)")
        values["outside"] = dict(outside)
        measured = entry.get("measured_with", {})
        if not isinstance(measured, dict) or not all(isinstance(v, str) for v in measured.values()):
            raise CalibrationError(f"{path}: models[{name!r}].measured_with: expected an object of strings")
        assert set(values) <= set(names)
        out[name] = GpuModel(name=name, source=str(path.name), measured_with=dict(measured), **values)
    return out


def write_calibration(path: Path, found: GpuModel) -> None:
    """Add or replace one model in a calibration file, keeping the others (atomically)."""
    models = {}
    if path.exists():
        models = {name: _entry(m) for name, m in read_calibration(path).items()}
    models[found.name] = _entry(found)
    text = json.dumps({"schema": SCHEMA, "models": dict(sorted(models.items()))}, indent=2, sort_keys=True) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _entry(found: GpuModel) -> dict[str, Any]:
    entry = asdict(found)
    entry.pop("name")
    entry.pop("source")
    entry["measured_with"] = dict(found.measured_with)
    entry["outside"] = dict(found.outside)
    return entry
