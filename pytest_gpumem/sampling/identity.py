"""Which machine measured a figure: the platform key a baseline is filed under, and the host facts
(Python, OS, the env knobs that move memory) recorded next to it. No hostnames, no home paths:
both end up in committed baseline files.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Mapping

ENV_KNOBS = ("OMP_NUM_THREADS", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "MALLOC_ARENA_MAX",
             # the CPU code paths of torch's math libraries (docs/host.md: MKL's moves the host figure)
             "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
ENV_KNOB_PREFIXES = ("NCCL_", "ONEFLOW_", "TORCH_NCCL_")


SIMULATED_KEY = " (simulated)"  # a simulated world's figures are filed apart from a real world's
FAKE_KEY = " (fake)"  # a fake GPU's likewise: every size of it is a simulated world


def simulated_key(platform: str) -> str:
    """``gpu:NVIDIA H200 (simulated)``: where a simulated size's baseline is filed. Its device and host
    figures lack the communicator's buffers, so they never compare with a real launch's. A fake GPU's
    platform (``gpu:NVIDIA H200 (fake)``) is filed apart already."""
    if platform.endswith(SIMULATED_KEY) or platform.endswith(FAKE_KEY):
        return platform
    return platform + SIMULATED_KEY


def fake_gpu_name(model: str) -> str:
    """The name a fake GPU's figures are filed under: ``NVIDIA H200 (fake)``."""
    return model + FAKE_KEY


def platform_key(device: str, gpu_name: str | None = None) -> str:
    """``gpu:<GPU model>`` or ``cpu:<architecture>``: where a baseline compares.

    A GPU figure holds the CUDA context and the framework's kernels for that GPU: it compares on
    the same GPU model. A host figure (the peak of live allocations) depends on the code, not on
    the CPU model: the examples read within 0.1 MiB on an AMD EPYC and an Intel Xeon, so it
    compares across the CPU models of one architecture, with the CPU recorded in provenance.
    """
    if device == "gpu":
        if not gpu_name or not gpu_name.strip():
            raise ValueError("platform_key('gpu') needs the GPU name, e.g. 'NVIDIA H200'")
        return "gpu:" + " ".join(gpu_name.split())
    if device == "cpu":
        return "cpu:" + architecture()
    raise ValueError(f"device {device!r}: expected 'gpu' or 'cpu'")


def architecture() -> str:
    """The CPU architecture as Python names it (``x86_64``, ``aarch64``)."""
    return platform.machine() or "unknown"


def cpu_model() -> str:
    """The CPU model, for provenance (``/proc/cpuinfo``'s model name)."""
    return _cpu_model()


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return " ".join(value.split())
    return " ".join((platform.processor() or platform.machine() or "unknown").split())


def host_provenance(env: Mapping[str, str]) -> dict[str, str]:
    """Python, OS/arch, date and the set env knobs that move memory; no hostname, no home paths."""
    out = {
        "cpu_model": _cpu_model(),  # host baselines compare across CPU models: a failure names a new one first
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "python": platform.python_version(),
    }
    home = os.path.expanduser("~").rstrip("/")
    for key in sorted(env):
        if key in ENV_KNOBS or key.startswith(ENV_KNOB_PREFIXES):
            value = str(env[key])
            if home:  # keep user names out of committed files
                value = "~" if value == home else value.replace(home + "/", "~/")
            out[f"env.{key}"] = value
    return out


# The ISA ladder MKL and oneDNN dispatch on, best first: (name, the /proc/cpuinfo flag that proves it).
_ISA_LADDER = (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"), ("sse4_2", "sse4_2"))


def cpu_provenance(root: str | Path = "/") -> dict[str, str]:
    """The CPU facts that move torch's host figure, as flat strings (only those found; no hostnames).

    Measured on one Intel Xeon (docs/host.md): torch's CPU matmuls run in MKL, whose packing buffers
    are live allocations sized by the kernel MKL picks: by vendor (``mkl_serv_intel_cpu_true``:
    other vendors get other kernels) and by instruction set (AVX-512 vs AVX2 moved the examples by
    +4.3 and -2.6 MiB), the blocking of those kernels by the cache sizes. ``root`` is where
    ``proc/cpuinfo`` and ``sys/devices/system/cpu`` are read (tests pass a fake tree).
    """
    return dict(_cpu_facts(str(root)))


@lru_cache(maxsize=4)
def _cpu_facts(root: str) -> tuple[tuple[str, str], ...]:
    base = Path(root)
    facts: dict[str, str] = {}
    first: dict[str, str] = {}
    processors = 0
    with contextlib.suppress(OSError):
        for line in (base / "proc/cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            key = key.strip()
            if not sep:
                continue
            if key == "processor":
                processors += 1
            if processors <= 1 and key not in first:
                first[key] = " ".join(value.split())
    if first.get("model name"):
        facts["cpu_model"] = first["model name"]
    if first.get("vendor_id"):
        facts["cpu_vendor"] = first["vendor_id"]
    flags = set(first.get("flags", "").split())
    if flags:
        facts["cpu_isa"] = next((name for name, flag in _ISA_LADDER if flag in flags), "baseline")
    if processors:
        facts["cpu_count"] = str(processors)
    for index in sorted((base / "sys/devices/system/cpu/cpu0/cache").glob("index*")):
        with contextlib.suppress(OSError, ValueError):
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            if level in ("2", "3") and kind in ("Unified", "Data"):
                facts[f"l{level}_cache"] = _kib((index / "size").read_text().strip())
    return tuple(facts.items())


def _kib(size: str) -> str:
    """A sysfs cache size ("2048K", "32M") as "2048 KiB"."""
    scale = {"K": 1, "M": 1024, "G": 1024 * 1024}
    if size[-1:].upper() in scale:
        return f"{int(size[:-1]) * scale[size[-1].upper()]} KiB"
    return f"{int(size) // 1024} KiB"  # plain bytes
