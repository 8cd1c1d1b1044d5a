"""``torch.cuda`` on a fake GPU: the device, streams, events, random state and memory figures a job
and the frameworks call, answered for the emulated model without a driver.

The memory figures (``memory_stats``, ``max_memory_allocated``, the allocator history) are the fake
allocator's (``accounting``): what the plugin's own reader of the allocator (``gpu_allocator``)
takes from a real GPU, it takes from here unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import types
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator

from .accounting import FakeAllocator
from .models import GpuModel

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

DEVICES = 8  # c10's FakeGuardImpl: an 8-GPU node of the model


class FakeStream:
    """A CUDA stream that orders nothing: ops on a fake GPU run when they are called."""

    _ids = iter(range(1, 1 << 30))

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = _device(device)
        self.device_index = self.device.index
        self.device_type = 1  # CUDA
        self.priority = priority
        self.stream_id = next(self._ids)
        self.cuda_stream = self.stream_id

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...

    def record_event(self, event: Any = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:  # no CUDA graph is ever captured (the optimizers ask)
        return False

    def __enter__(self) -> "FakeStream":
        _state.streams.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.streams.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("fake-stream", self.stream_id))

    def __repr__(self) -> str:
        return f"<fake GPU stream {self.stream_id} on {self.device}>"


class FakeEvent:
    """A CUDA event that is always complete; elapsed times are 0."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **_: Any) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _State(threading.local):
    """The streams entered on this thread (``with stream:``), innermost last."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []


_state = _State()


# CUDA "initialised" by set_device, init or a first CUDA op (``initialise``, set by ``install``)
_current: dict[str, Any] = {"device": 0, "initialized": False, "initialise": lambda: None}


def initialise() -> None:
    """Called by the dispatch before the first op on a fake CUDA tensor."""
    _current["initialise"]()


_default: dict[int, FakeStream] = {}


def _device(device: Any = None) -> Any:
    import torch

    if device is None:
        return torch.device("cuda", _current["device"])
    if isinstance(device, int):
        return torch.device("cuda", device)
    found = torch.device(device)
    return torch.device("cuda", _current["device"] if found.index is None else found.index)


def _index(device: Any = None) -> int:
    return int(_device(device).index)


def noop(*args: Any, **kwargs: Any) -> None:
    return None


def _own(name: str, value: Any) -> Any:
    """A function object of its own for ``name``, named so (classes and objects as they are)."""
    if not isinstance(value, type) and callable(value) and getattr(value, "__code__", None) is not None:
        copy = types.FunctionType(value.__code__, value.__globals__, name, value.__defaults__, value.__closure__)
        copy.__kwdefaults__ = value.__kwdefaults__
        copy.__qualname__ = f"fake_gpu.{name}"
        return copy
    return value


def install_cuda_api(torch: ModuleType, allocator: FakeAllocator, model: GpuModel, guarded: bool) -> None:
    """Replace what a CPU build of ``torch.cuda`` cannot answer; nothing of the real GPU is touched.
    ``guarded``: the shim's device guard and hooks are loaded (not a CUDA build's own, with a driver)."""
    cuda = torch.cuda
    properties = SimpleNamespace(**model.properties())
    queued = getattr(cuda, "_queued_calls", [])
    ours = len(queued)  # those queued before (torch's capability checks) are for a real device

    def initialise() -> None:
        """torch's lazy init, as far as a fake GPU has one: what waited for it runs now (the plugin's
        allocator history among it), once."""
        if _current["initialized"]:
            return
        _current["initialized"] = True
        calls = queued[ours:]
        del queued[ours:]
        for call, _ in calls:
            call()

    _current["initialise"] = initialise

    def pool_stream() -> int:
        """The stream whose pool a block made now comes from: the current one (the default's is 0)."""
        if not _state.streams:
            return 0
        found = _state.streams[-1]
        return 0 if _default.get(found.device_index) is found else found.stream_id

    allocator.stream_of = pool_stream

    def current_stream(device: Any = None) -> FakeStream:
        if _state.streams:
            return _state.streams[-1]
        return default_stream(device)

    def default_stream(device: Any = None) -> FakeStream:
        index = _index(device)
        if index not in _default:
            _default[index] = FakeStream(index)
        return _default[index]

    @contextlib.contextmanager
    def stream(value: Any) -> Iterator[None]:
        if value is None:
            yield
            return
        with value:
            yield

    def set_device(device: Any) -> None:
        index = _index(device)
        if not 0 <= index < DEVICES:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (a fake GPU node has {DEVICES} GPUs)")
        current(index)
        initialise()

    def current(index: int) -> None:
        """The current device, here and in c10's device guard: a tensor moved with ``.cuda()`` (no index)
        goes where the guard says, and went to cuda:0 on rank 1 (DDP's bucket and its grad then differed)."""
        _current["device"] = index
        setter = getattr(torch._C, "_accelerator_setDeviceIndex", None)  # noqa: SLF001 - c10's guard
        if setter is not None and guarded:  # a CUDA build's own guard, where it is, is the real device's
            setter(index)

    def exchange(device: int) -> int:
        before = _current["device"]
        if device >= 0:
            current(device)
        return before

    class device:  # noqa: N801 - torch.cuda.device
        def __init__(self, value: Any) -> None:
            self.index = -1 if value is None else _index(value)
            self.prev = -1

        def __enter__(self) -> None:
            self.prev = exchange(self.index)

        def __exit__(self, *exc: Any) -> None:
            exchange(self.prev)

    fractions: dict[int, float] = {}  # what the job set: kept for it to read back (a fake GPU never runs out)

    def set_fraction(fraction: float, device: Any = None) -> None:
        fractions[_index(device)] = fraction

    def memory_stats(device: Any = None) -> dict[str, int]:
        return allocator.stats(_index(device))

    def stat(key: str) -> Any:
        return lambda device=None: allocator.stats(_index(device))[key]

    def reset_peak(device: Any = None) -> None:
        torch._C._cuda_resetPeakMemoryStats(_index(device))  # noqa: SLF001 - where a real reset goes (and is watched)

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        used = allocator.stats(_index(device))["reserved_bytes.all.current"]
        return model.total_memory - used, model.total_memory

    def record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        if enabled:
            allocator.start_history()

    def dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
        import pickle

        with open(filename, "wb") as fh:
            pickle.dump(allocator.snapshot(), fh)

    replacements: dict[str, Any] = {
        # Initialised as torch's lazy init is: by set_device, init or a first CUDA tensor; a rank that
        # never got there reads "no allocator figure", as a real one that nvidia-smi never saw.
        "is_available": lambda: True, "is_initialized": lambda: _current["initialized"],
        "_is_in_bad_fork": lambda: False, "init": initialise, "_lazy_init": initialise, "device_count": lambda: DEVICES,
        "current_device": lambda: _current["device"], "set_device": set_device, "device": device,
        "_exchange_device": exchange, "_maybe_exchange_device": exchange,
        "get_device_name": lambda device=None: model.name,
        "get_device_capability": lambda device=None: (model.major, model.minor),
        "get_device_properties": lambda device=None: properties,
        "get_arch_list": lambda: [f"sm_{model.major}{model.minor}"],
        "is_bf16_supported": lambda including_emulation=True: model.major >= 8,
        "is_tf32_supported": lambda: model.major >= 8,
        "can_device_access_peer": lambda device, peer: True,
        "synchronize": noop, "empty_cache": lambda: allocator.empty_cache(), "ipc_collect": noop,
        "is_current_stream_capturing": lambda: False,  # SyncBatchNorm asks before it counts the batch
        "Stream": FakeStream, "Event": FakeEvent, "current_stream": current_stream,
        "default_stream": default_stream, "stream": stream, "set_stream": noop,
        "manual_seed": noop, "manual_seed_all": noop, "seed": noop, "seed_all": noop,
        "initial_seed": lambda: 0, "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)] * DEVICES,
        "set_rng_state": noop, "set_rng_state_all": noop,
        "memory_stats": memory_stats,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "reset_peak_memory_stats": reset_peak, "reset_max_memory_allocated": reset_peak,
        "reset_accumulated_memory_stats": noop, "mem_get_info": mem_get_info,
        "set_per_process_memory_fraction": set_fraction,
        "get_per_process_memory_fraction": lambda device=None: fractions.get(_index(device), 1.0),
    }
    torch._C._cuda_resetPeakMemoryStats = allocator.reset_peak  # noqa: SLF001
    torch._C._cuda_jiterator_compile_and_launch_kernel = _jiterator(torch)  # noqa: SLF001
    for name, value in replacements.items():
        setattr(cuda, name, _own(name, value))  # one function each: torch._dynamo maps them one to one
    cuda.graphs.is_current_stream_capturing = cuda.is_current_stream_capturing
    # torch.accelerator asks the device guard, whose fake stream carries no device (FSDP2's backward
    # waited on it: "Unknown device: 96"): the accelerator's streams are torch.cuda's here
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        accelerator.current_stream = _own("current_stream", current_stream)
        accelerator.synchronize = _own("synchronize", noop)
    memory = cuda.memory
    for name in ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
                 "mem_get_info", "empty_cache", "set_per_process_memory_fraction",
                 "get_per_process_memory_fraction"):
        setattr(memory, name, getattr(cuda, name))
    memory._record_memory_history = record_memory_history  # noqa: SLF001
    memory._snapshot = lambda device=None, **_: allocator.snapshot()  # noqa: SLF001
    memory._dump_snapshot = dump_snapshot  # noqa: SLF001
    torch.Tensor.record_stream = _own("record_stream", noop)  # a stream that orders nothing holds nothing
    if guarded and torch.version.cuda is not None:
        # cuDNN as the CPU build has it, none: a CUDA build's Python side would ask the shim's hooks its
        # version. Set in the module's own namespace (torch.backends.cudnn is a wrapper of it), where
        # version() and is_acceptable() look.
        cudnn = torch.backends.cudnn.is_acceptable.__globals__
        cudnn.update(is_available=_own("is_available", lambda: False), _init=_own("_init", lambda: False))


def _jiterator(torch: ModuleType) -> Any:
    """``torch.cuda.jiterator``'s kernels are compiled for the device at their first call, which a fake
    GPU cannot do: each is the elementwise op it declares, so its outputs are the inputs' broadcast
    shape in their promoted dtype, as TensorIterator makes them, one per declared output."""

    def launch(code: str, name: str, return_by_ref: bool, num_outputs: int, tensors: Any, kwargs: Any) -> Any:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = torch.promote_types(dtype, tensor.dtype)
        outs = tuple(torch.empty(shape, dtype=dtype, device=tensors[0].device) for _ in range(num_outputs))
        return outs[0] if num_outputs == 1 else outs

    return launch
