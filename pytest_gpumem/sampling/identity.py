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

ENV_KNOBS = ("OMP_NUM_THREADS", "CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "MALLOC_ARENA_MAX")
ENV_KNOB_PREFIXES = ("NCCL_", "ONEFLOW_", "TORCH_NCCL_")


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
