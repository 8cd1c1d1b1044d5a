"""A OneFlow job written for CUDA, run in a rank on the CPU (a ``device="gpu"`` test on a runner
without a GPU; ``launching.scaling`` decides it, the rank arms it before the job imports OneFlow).

OneFlow has no fake tensors, but its global tensors run on the CPU with the same SBP conversions:
what a conversion moves depends on the logical shape, the SBP and the ranks, not on the device. So
every CUDA the job names is read as the CPU, where OneFlow's library is loaded (before its package
binds any name): ``flow.device("cuda:1")``, ``flow.placement("cuda", ranks)`` (also ``type=``,
``placement.all``, ``env.all_device_placement``), the functional calls that take a device
(``tensor.to("cuda")``, ``.cuda()``, ``flow.ones(..., device="cuda")``, ``flow.tensor``), and
``flow.cuda``: available, one device a local rank, the current one ``LOCAL_RANK``, its
synchronize the VM's. A placement the C++ builds is built from these, so ``nn.Graph`` compiles a
CPU plan. The gated figure is the host figure (live allocations), labelled as such; tensors say
``cpu`` when asked (``x.is_cuda`` is False).
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any, Callable

# Set by the parent for a launch of a OneFlow job written for CUDA on a runner without a GPU.
CUDA_ON_CPU_ENV = "GPUMEM_RANK_ONEFLOW_CUDA_ON_CPU"
# The exit report's provenance says the rank ran so (rank_reading labels the figure from it).
PROVENANCE_KEY = "oneflow_cuda_on_cpu"
LABEL = "host figure of a CUDA job mapped to the CPU"

# The functional calls (``oneflow._C``) whose C++ signature takes a Device or a device string:
# functional_api.yaml.h of OneFlow 0.9. Their placement-taking twins get placements built above.
_DEVICE_CALLS = ("to", "copy", "eye", "arange", "constant", "tensor_constant", "empty", "hann_window", "normal",
                 "rand", "randn", "randn_like", "randint", "randint_like", "randperm", "recv", "tensor")
# Tensor methods of the library's own (C++) that take a device.
_TENSOR_CALLS = ("new_empty", "new_ones", "new_zeros", "new_full", "new_tensor")
_MARK = "_gpumem_cuda_on_cpu"

mapped: list[str] = []  # what was armed, once OneFlow's library loaded (the exit report says it)


def cuda_on_cpu_requested(env: Any = os.environ) -> bool:
    return bool(env.get(CUDA_ON_CPU_ENV))


def install_cuda_on_cpu(after_import: Callable[[str, Callable[[ModuleType], None]], None]) -> None:
    """Before the job imports OneFlow: read CUDA as the CPU once its library is loaded (``after_import``:
    the rank's ``rankside.imports.after_import``, a layer above this one)."""
    after_import("oneflow._oneflow_internal", _arm_classes)
    after_import("oneflow", _arm_calls)


def cuda_on_cpu_provenance() -> dict[str, str]:
    """The exit report's entry: present only where the mapping was armed."""
    return {PROVENANCE_KEY: LABEL} if mapped else {}


def as_cpu(value: Any) -> Any:
    """A CUDA device string (``cuda``, ``cuda:1``) as ``cpu``; anything else as it is."""
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return "cpu"
    return value


def _arm_classes(internal: ModuleType) -> None:
    """As the library loads, before the package binds its names: ``device`` and ``placement`` built
    for the CPU, patched in place (``isinstance`` holds, and the C++ takes them as its own)."""
    device, placement = internal.device, internal.placement
    if getattr(device, _MARK, False):
        return
    device_init, placement_init = device.__init__, placement.__init__

    def device_new(self: Any, *args: Any, **kwargs: Any) -> None:
        if args and as_cpu(args[0]) != args[0]:  # device("cuda", 1): the CPU has one device a rank
            args = ("cpu",)
        device_init(self, *args, **kwargs)

    def placement_new(self: Any, *args: Any, **kwargs: Any) -> None:
        placement_init(self, *(as_cpu(a) for a in args), **{k: as_cpu(v) for k, v in kwargs.items()})

    device.__init__ = device_new
    placement.__init__ = placement_new
    setattr(device, _MARK, True)


def _arm_calls(flow: ModuleType) -> None:
    """Once the package is imported (its docstrings set on the library's own functions): the calls
    that take a device, wherever a module bound them (``from oneflow._C import tensor``), and what
    ``oneflow.cuda`` asks the library."""
    internal = flow._oneflow_internal
    placement, functional = internal.placement, internal._C
    placement_all = placement.all
    placement.all = staticmethod(lambda device_type, *a, **k: placement_all(as_cpu(device_type), *a, **k))
    wrapped = {id(call): _on_cpu(call) for name in _DEVICE_CALLS
               if (call := getattr(functional, name, None)) is not None}
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "oneflow"]:
        names = getattr(module, "__dict__", {})
        for name, value in list(names.items()):
            if id(value) in wrapped and not isinstance(value, type):
                setattr(module, name, wrapped[id(value)])
    tensor = flow.Tensor
    tensor.cuda = lambda self, device=None, *args, **kwargs: self.to("cpu")  # the library's own: C++
    for name in _TENSOR_CALLS:
        call = getattr(tensor, name, None)
        if call is not None:
            setattr(tensor, name, _on_cpu(call))
    _cuda_api(internal)
    mapped.append("oneflow")


def _on_cpu(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with a CUDA device string among its arguments read as the CPU's (a ``device`` object
    is the CPU's already: its constructor was patched)."""
    @functools.wraps(call)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        return call(*(as_cpu(a) for a in args), **{k: as_cpu(v) for k, v in kwargs.items()})

    return on_cpu


def _cuda_api(internal: ModuleType) -> None:
    """What ``oneflow.cuda`` asks the library: a device for each local rank, the current one this
    rank's; setting it, seeding its generator and synchronizing it are the CPU's (its VM's)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("ONEFLOW_TEST_DEVICE_NUM") or 1)
    seed = internal.manual_seed
    answers: dict[str, Callable[..., Any]] = {
        "CudaGetDeviceCount": lambda: local_world,
        "GetCudaDeviceIndex": lambda: local_rank,
        "SetCudaDeviceIndex": lambda index: None,
        "CudaSynchronize": lambda index: None,  # oneflow.cuda.synchronize has run eager.Sync() first
        "ManualSeedAllCudaGenerator": lambda value: seed(value, "cpu", 0),
        # manual_seed(seed) seeds every default generator; (seed, "cuda", index) the CUDA one: the CPU's here
        "manual_seed": lambda value, *args: seed(value, *(("cpu", 0) if args and as_cpu(args[0]) != args[0]
                                                          else args)),
    }
    for name, answer in answers.items():
        if hasattr(internal, name):
            setattr(internal, name, answer)
