"""A rank's CUDA tensors as fake tensors: what runs where and what is counted.

Every op that makes or touches a CUDA tensor runs under torch's ``FakeTensorMode``: shapes, dtypes
and strides are computed (the meta kernels), no data exists. CPU tensors stay real, so data
loading, CPU-side bookkeeping and ``.item()`` on them work as they do in the job. Each CUDA
storage an op returns is counted as the caching allocator counts it (``accounting``).

Where torch's CPU build under fake mode would differ from a GPU (its kernel choices, a library's
checks of values, a kernel's scratch), a mend patches it (``mends``, each with what needs it). An op
the fake mode runs as a decomposition (the first time: later calls hit its cache) is one kernel on
the GPU: only the outermost op's outputs are counted.

What a fake tensor cannot answer (an op whose output size depends on values: ``.item()``,
``nonzero``, a boolean mask) stops the rank with the op's name and what to do (``FakeGpuError``).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from . import cuda_api, rules
from .accounting import FakeAllocator, paused
from .mends import apply_mends
from .mends.base import BoundHook, Context
from .models import GpuModel
from .values import Supplied, ValuePolicy

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True


class FakeGpuError(RuntimeError):
    """What a fake GPU cannot compute; the message names the op and what to do instead."""


class _Depth(threading.local):
    depth = 0


inner = _Depth()  # >0: inside the fake mode's own dispatch (its decompositions run ops of their own)


def install_dispatch(torch: ModuleType, allocator: FakeAllocator, model: GpuModel) -> Any:
    """Enter the fake GPU for the rest of this process; returns the routing mode (entered)."""
    from torch._subclasses.fake_tensor import FakeTensor

    supplied = Supplied()
    op_hooks = apply_mends(Context(torch, allocator, model, FakeTensor, supplied))
    fake = _counting_mode(torch, allocator, supplied, op_hooks)
    policy = ValuePolicy(torch, FakeTensor, FakeGpuError, fake.run_fake, supplied)
    mode = _routing_mode(torch, policy)
    setattr(mode, "policy", policy)  # what it supplied: fakegpu.supplied()
    mode.__enter__()
    return mode


def _cuda_index(tensor: Any) -> int | None:
    device = getattr(tensor, "fake_device", None) or tensor.device
    return (device.index or 0) if device.type == "cuda" else None


def _counting_mode(torch: ModuleType, allocator: FakeAllocator, supplied: Supplied,
                   op_hooks: dict[Any, tuple[BoundHook, ...]]) -> Any:
    """torch's fake mode, counting every CUDA storage its ops return and what the mends add at an op."""
    from torch._ops import HigherOrderOperator
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    resizes = {aten.resize_.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
               aten.set_.source_Tensor}

    def count(value: Any) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, FakeTensor):
                index = _cuda_index(leaf)
                if index is not None:
                    allocator.track(leaf.untyped_storage(), index)

    class CountingFakeMode(FakeTensorMode):
        """torch's fake mode, counting every CUDA storage its ops return."""

        @property
        def avoid_device_init(self) -> bool:  # torch.cuda.is_available() says True here: no device, still
            return True

        def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            inner.depth += 1
            try:
                out = super().dispatch(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException) as exc:
                raise FakeGpuError(_data_dependent(func, exc)) from None
            except FakeGpuError:
                raise
            except (NotImplementedError, RuntimeError) as exc:
                # No shape rule, or one stricter than the CUDA kernel: the op's CPU kernel answers (rules).
                out = self._answered_on_the_cpu(func, args, kwargs, exc)
            finally:
                inner.depth -= 1
            if paused.depth or inner.depth:  # an op inside another (a decomposition): one kernel on the GPU
                return out
            count(out)
            if func in resizes and args:
                count(args[0])
            hooks = op_hooks.get(getattr(func, "overloadpacket", None))  # a higher-order operator has none
            if hooks:
                index = next((_cuda_index(a) for a in tree_leaves(args) if isinstance(a, FakeTensor)), None)
                if index is not None:
                    for hook in hooks:
                        hook(args, kwargs, index)
            return out

        def _answered_on_the_cpu(self, func: Any, args: Any, kwargs: Any, refused: Exception) -> Any:
            """A fused optimizer's in-place step returns nothing to count; any other op without a usable
            rule is answered by its CPU kernel, listed with the job's line, or named."""
            schema = getattr(func, "_schema", None)  # a higher-order operator has none: not an op to stand in for
            if schema is None:
                raise refused
            if isinstance(refused, NotImplementedError) and not schema.returns:
                return None
            name = str(func).replace("aten.", "aten::", 1).removesuffix(".default")
            try:
                out = rules.answer_on_the_cpu(torch, self, FakeTensor, func, args, kwargs)
            except rules.NoAnswer as why:
                raise FakeGpuError(f"a fake GPU has no shape rule for {name} and cannot answer it: {why}. Run this "
                                   "test on a real GPU (fake_gpu='off'), or report the op to pytest-gpumem") from None
            except Exception as job_error:  # noqa: BLE001 - the CPU kernel refuses too: the job's own error, in
                raise job_error from None        # the kernels' words (the shape rule's may be its stricter one)
            reason = "no shape rule" if isinstance(refused, NotImplementedError) else "its shape rule refused it"
            supplied.add(f"rule: {name} answered by its CPU kernel on stand-in data ({reason}: "
                         f"{str(refused).splitlines()[0][:100] if str(refused) else type(refused).__name__})")
            return out

        def run_fake(self, func: Any, args: Any, kwargs: Any) -> Any:
            """Run one op (or higher-order operator) in this mode."""
            if isinstance(func, HigherOrderOperator) and CountingFakeMode not in func.python_key_table:
                rule = func.python_key_table.get(FakeTensorMode)  # registered for torch's class, not a subclass
                if rule is not None:
                    func.python_key_table[CountingFakeMode] = rule
            with self:
                return func(*args, **kwargs)

    return CountingFakeMode(allow_non_fake_inputs=True)


def _routing_mode(torch: ModuleType, policy: ValuePolicy) -> Any:
    """The mode the job runs under: every op that makes or touches a CUDA tensor goes to the fake mode."""
    from torch._ops import HigherOrderOperator
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type as is_wrapper
    from torch.utils._pytree import tree_leaves

    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    cpu_key = torch._C.DispatchKey.CPU
    cuda_type = "cuda"

    def wants_fake(args: Any, kwargs: Any) -> bool:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, FakeTensor):
                return True
            if isinstance(leaf, torch.device) and leaf.type == cuda_type:
                return True
        return False

    initialised = {"done": False}  # the first op on a fake CUDA tensor is torch's lazy CUDA init

    class FakeGpuMode(TorchDispatchMode):
        """Sends every op that makes or touches a CUDA tensor to the fake mode; CPU ops run real."""

        supports_higher_order_operators = True  # flex_attention & co.: fake mode has their shape rules

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if isinstance(func, HigherOrderOperator):
                if wants_fake(args, kwargs or {}):
                    return policy.fake_call(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))
            if any(is_wrapper(t) for t in types):
                # A wrapper subclass (DTensor): let it unwrap with this mode still on, so what it does
                # inside (its local ops, a CUDA RNG state it makes) comes back here.
                return NotImplemented
            kwargs = kwargs or {}
            if (func.namespace == "aten" and func.has_kernel_for_dispatch_key(composite)
                    and not func.has_kernel_for_dispatch_key(cpu_key)):
                # Seen unexpanded under a subclass's dispatch (``to.dtype_layout`` in DTensor's RNG set-up):
                # expand it here, so its parts come back one by one (fake mode would run it on the CPU).
                # One with a kernel of its own (``silu_backward``, see rules) is one kernel on a GPU.
                with self:
                    expanded = func.decompose(*args, **kwargs)
                if expanded is not NotImplemented:
                    return expanded
            if wants_fake(args, kwargs):
                if not initialised["done"]:
                    initialised["done"] = True
                    cuda_api.initialise()
                return policy.run(func, args, kwargs)
            return func(*args, **kwargs)

    return FakeGpuMode()


def _data_dependent(func: Any, exc: Exception) -> str:
    name = str(func).replace("aten.", "aten::", 1)
    what = ("reads a value of a CUDA tensor (.item(), a Python bool or int of it)"
            if "_local_scalar_dense" in name else "has an output whose size depends on the values of a CUDA tensor")
    return (f"a fake GPU cannot run {name}: it {what}, and a fake tensor has no values. Keep that value on "
            "the CPU (compute it from CPU tensors), declare a fixed size, or run this test on a real GPU "
            "(fake_gpu='off')")
