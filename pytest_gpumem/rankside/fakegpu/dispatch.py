"""A rank's CUDA tensors as fake tensors: what runs where, what is counted, what is mended.

Every op that makes or touches a CUDA tensor runs under torch's ``FakeTensorMode``: shapes, dtypes
and strides are computed (the meta kernels), no data exists. CPU tensors stay real, so data
loading, CPU-side bookkeeping and ``.item()`` on them work as they do in the job. Each CUDA
storage an op returns is counted as the caching allocator counts it (``accounting``).

Mended, each where the fake figure differs from the real GPU's:

- attention (``scaled_dot_product_attention``) picks the kernel the GPU model would (cuDNN,
  flash, memory-efficient, math), not the CPU build's math path, which holds a full seq x seq matrix;
- DTensor's sharding propagation runs its ops on global-shape fake tensors in the same fake mode:
  not the job's memory, not counted;
- DDP's construction reads parameter values (its shape check across ranks) and its reducer
  rebuilds buckets from them: skipped, as the real ranks would agree;
- matrix products take cuBLAS's and cuBLASLt's workspaces once per thread, and an operand cuBLAS
  cannot read in place (an expanded gradient) is copied for the product's duration;
- an op the fake mode runs as a decomposition (the first time: later calls hit its cache) is one
  kernel on the GPU: only the outermost op's outputs are counted.

What a fake tensor cannot answer (an op whose output size depends on values: ``.item()``,
``nonzero``, a boolean mask) stops the rank with the op's name and what to do (``FakeGpuError``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import ModuleType
from typing import Any

from ..imports import after_import
from . import cuda_api, rules
from .accounting import FakeAllocator
from .models import GpuModel
from .scratch import KERNEL_SCRATCH
from .values import ValuePolicy

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True


class FakeGpuError(RuntimeError):
    """What a fake GPU cannot compute; the message names the op and what to do instead."""


GEMM = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "matmul", "dot")
LT = ("addmm", "_addmm_activation")  # with a 1-D bias: cuBLASLt's epilogue
SDPA_MATH, SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN = 0, 1, 2, 3  # torch's SDPBackend


class _Paused(threading.local):
    depth = 0


paused = _Paused()  # >0: ops run fake but nothing is counted (DTensor's sharding propagation)
inner = _Paused()  # >0: inside the fake mode's own dispatch (its decompositions run ops of their own)


def install_dispatch(torch: ModuleType, allocator: FakeAllocator, model: GpuModel) -> Any:
    """Enter the fake GPU for the rest of this process; returns the routing mode (entered)."""
    from torch._ops import HigherOrderOperator
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type as is_wrapper
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    gemm = {getattr(aten, name) for name in GEMM if hasattr(aten, name)}
    lt = {getattr(aten, name) for name in LT if hasattr(aten, name)}
    operands_last = {aten.addmm, aten.baddbmm, aten.addbmm, aten._addmm_activation}  # (bias, a, b)
    resizes = {aten.resize_.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset,
               aten.set_.source_Tensor}
    scratch = {getattr(aten, name): rule for name, rule in KERNEL_SCRATCH.items() if hasattr(aten, name)}

    def cuda_index(tensor: Any) -> int | None:
        device = getattr(tensor, "fake_device", None) or tensor.device
        return (device.index or 0) if device.type == "cuda" else None

    def count(value: Any) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, FakeTensor):
                index = cuda_index(leaf)
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
            packet = getattr(func, "overloadpacket", None)  # a higher-order operator has none
            if packet in scratch:
                index = next((cuda_index(a) for a in tree_leaves(args) if isinstance(a, FakeTensor)), None)
                if index is not None:
                    allocator.transient(index, scratch[packet](model, args, kwargs))
            if packet in gemm:
                index = next((cuda_index(a) for a in tree_leaves(args) if isinstance(a, FakeTensor)), None)
                if index is not None:
                    for operand in args[-2:] if packet in operands_last else args[:2]:
                        if isinstance(operand, FakeTensor) and _cublas_copies(operand):
                            allocator.transient(index, operand.numel() * operand.element_size())
                    allocator.workspace("cublas", index)
                    if packet in lt and len(args) > 0 and getattr(args[0], "dim", lambda: 0)() == 1:
                        allocator.workspace("cublaslt", index)
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

    fake = CountingFakeMode(allow_non_fake_inputs=True)
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

    def fake_call(func: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(func, HigherOrderOperator) and CountingFakeMode not in func.python_key_table:
            rule = func.python_key_table.get(FakeTensorMode)  # registered for torch's class, not a subclass
            if rule is not None:
                func.python_key_table[CountingFakeMode] = rule
        with fake:
            return func(*args, **kwargs)

    policy = ValuePolicy(torch, FakeTensor, FakeGpuError, fake_call)
    supplied = policy.supplied

    class FakeGpuMode(TorchDispatchMode):
        """Sends every op that makes or touches a CUDA tensor to the fake mode; CPU ops run real."""

        supports_higher_order_operators = True  # flex_attention & co.: fake mode has their shape rules

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if isinstance(func, HigherOrderOperator):
                if wants_fake(args, kwargs or {}):
                    return fake_call(func, args, kwargs or {})
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

    _storage_resize(torch, allocator)
    _attention(torch, model, FakeTensor)
    after_import("torch.distributed.tensor._sharding_prop", _pause_sharding_propagation)
    after_import("torch.nn.parallel.distributed", _mend_ddp)
    after_import("torch.distributed.tensor._random", _mend_dtensor_rng)
    after_import("torch.distributed.fsdp._init_utils", _mend_fsdp1_move)
    after_import("torch.distributed.fsdp._flat_param", lambda m: _mend_fsdp1_allocated(m, FakeTensor))
    after_import("torch.utils._foreach_utils", lambda m: _foreach_for_fakes(m, FakeTensor))
    after_import("torch.optim.optimizer", lambda m: _foreach_for_fakes(m, FakeTensor))
    # torch.tensor(data, device="cuda") builds its tensor below the dispatcher's Python key, on the
    # device asked for (a CUDA kernel the CPU build lacks); with this set it builds on the CPU and
    # moves it with a dispatched ``_to_copy``, as inside FakeTensorMode (torch's NOTE "torch.tensor,
    # lift_fresh, and device movement").
    torch._C._set_only_lift_cpu_tensors(True)
    _keep_ties(torch, FakeTensor)
    rules.install_rules(torch)
    _compile_runs_eagerly(torch, supplied)
    _save_from_the_host(torch, FakeTensor)
    after_import("torch.distributed.fsdp._fully_shard._fully_shard", _mend_fsdp2_move)  # the name its caller holds
    mode = FakeGpuMode()
    setattr(mode, "policy", policy)  # what it supplied: fakegpu.supplied()
    mode.__enter__()
    return mode


def _cublas_copies(matrix: Any) -> bool:
    """Whether CUDA's GEMM copies this operand before calling cuBLAS (``prepare_matrix_for_cublas``
    in ATen's Blas.cpp): one that is neither dense nor a strided view cuBLAS takes (an expanded
    gradient, stride 0) is cloned contiguous for the product's duration, a scratch the meta kernel
    never allocates."""
    if matrix.dim() not in (2, 3) or _dense(tuple(matrix.shape), tuple(matrix.stride())):
        return False
    sizes, strides = matrix.shape[-2:], matrix.stride()[-2:]
    if strides[0] == 1 and strides[1] >= max(1, sizes[0]):
        return False
    if strides[1] == 1 and strides[0] >= max(1, sizes[1]):
        return False
    return True


def _dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Non-overlapping and dense: the strides are a contiguous layout's, in some order of the dims."""
    expected = 1
    for size, stride in sorted((p for p in zip(sizes, strides) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage_resize(torch: ModuleType, allocator: FakeAllocator) -> None:
    """``UntypedStorage.resize_`` is no op the modes see (FSDP frees parameters with it): counted here."""
    resize = torch.UntypedStorage.resize_

    @functools.wraps(resize)
    def resize_(self: Any, size: int) -> Any:
        out = resize(self, size)
        if not paused.depth:
            allocator.resized(self)
        return out

    torch.UntypedStorage.resize_ = resize_


def _pause_sharding_propagation(module: ModuleType) -> None:
    propagator = module.ShardingPropagator
    original = propagator._propagate_tensor_meta_non_cached  # noqa: SLF001

    @functools.wraps(original)
    def uncounted(*args: Any, **kwargs: Any) -> Any:
        paused.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            paused.depth -= 1

    propagator._propagate_tensor_meta_non_cached = uncounted  # noqa: SLF001


class _QuietLogger:
    """DDP's logger, minus its per-step runtime figures: they read the reducer's CUDA timer, which
    the CPU build has none of (an internal assert)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def set_runtime_stats_and_log(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def _keep_ties(torch: ModuleType, fake_type: Any) -> None:
    """``Module.cuda()``/``.to("cuda")`` keeps a real parameter's identity by giving it the moved data;
    a real tensor cannot take a fake one's (nor be swapped with it), so torch makes a new Parameter in
    each module that holds it, and a tied weight (transformers' input and output embeddings) would be
    moved twice and untied: twice its memory, its gradient and its optimizer state. Here a tensor is
    moved once per call, and the modules that shared a parameter share its moved one.

    A parameter that is already fake (``.cuda().bfloat16()``, ``.to(memory_format=...)``) torch would
    swap in place, which a fake tensor refuses (its fake mode holds a weak reference to it): it is
    replaced by a new Parameter instead, with its gradient converted alike."""
    module_type = torch.nn.Module
    parameter = torch.nn.Parameter
    original = module_type._apply
    depth = threading.local()

    def fakes_replaced(module: Any, fn: Any, recurse: bool) -> Any:
        if recurse:
            for child in module.children():
                child._apply(fn)
        order = list(module._parameters)
        replaced: dict[str, Any] = {}
        for name, param in module._parameters.items():
            if param is None or not isinstance(param, fake_type):
                continue
            with torch.no_grad():
                applied = fn(param)
                grad = None if param.grad is None else fn(param.grad)
            if applied is param:
                replaced[name] = param
                continue
            new = parameter(applied, param.requires_grad)
            if grad is not None:
                new.grad = grad
            replaced[name] = new
        if not replaced:
            return original(module, fn, False)
        for name in replaced:
            del module._parameters[name]
        try:
            return original(module, fn, False)  # the real parameters and the buffers, as torch moves them
        finally:
            kept = dict(module._parameters)
            module._parameters.clear()
            module._parameters.update((name, replaced[name] if name in replaced else kept[name]) for name in order)

    @functools.wraps(original)
    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        if getattr(depth, "n", 0):
            return fakes_replaced(self, fn, recurse)
        held = [(m, name, p) for m in self.modules() for name, p in m._parameters.items() if p is not None]
        moved: dict[int, tuple[Any, Any]] = {}  # id(tensor) -> (the tensor, kept alive; its moved copy)

        def once(tensor: Any) -> Any:
            if id(tensor) not in moved:
                moved[id(tensor)] = (tensor, fn(tensor))
            return moved[id(tensor)][1]

        depth.n = 1
        try:
            out = fakes_replaced(self, once, recurse)
        finally:
            depth.n = 0
        first: dict[int, Any] = {}
        for owner, name, before in held:
            now = owner._parameters.get(name)
            if id(before) in first:
                owner._parameters[name] = first[id(before)]
            else:
                first[id(before)] = now
        return out

    module_type._apply = _apply


# benchmarks/results/fake_gpu_compile.txt: an 8-block GPT-like stack on one H100 against the fake GPU.
COMPILED_VS_EAGER = ("the figure is the eager job's; on a GPT-like stack it read 0.43% above the GPU's Inductor "
                     "run, equal to its aot_eager run")


def _compile_runs_eagerly(torch: ModuleType, supplied: Any) -> None:
    """``torch.compile`` on a fake GPU: Inductor's kernels cannot be built without a device, and
    Dynamo would fall back to eager under the fake mode anyway, without a word. The function or module
    is returned as it is, and the report says the figure is the eager one (docs/fake-gpu.md: how far
    a compiled job's figure was from eager on a GPU)."""
    original = getattr(torch, "compile")

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - torch.compile
        if model is None:
            return lambda fn: compile(fn, **kwargs)
        if f"{os.sep}torch{os.sep}" not in sys._getframe(1).f_code.co_filename:  # noqa: SLF001 - torch's own: inside
            name = getattr(model, "__qualname__", None) or type(model).__name__
            supplied.add(f"compile: torch.compile({name}) ran eagerly ({COMPILED_VS_EAGER})")
        return model

    setattr(torch, "compile", compile)


def _save_from_the_host(torch: ModuleType, fake_type: Any) -> None:
    """``torch.save`` of CUDA tensors (a checkpoint, a state dict) writes their values: a fake GPU's
    are copied to the host first, through the value policy (known values, else zeros, reported)."""
    from torch.utils._pytree import tree_map

    original = getattr(torch, "save")

    @functools.wraps(original)
    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        def host(leaf: Any) -> Any:
            return leaf.cpu() if isinstance(leaf, fake_type) and leaf.device.type == "cuda" else leaf

        return original(tree_map(host, obj), *args, **kwargs)

    setattr(torch, "save", save)
    setattr(torch.serialization, "save", save)


def _mend_fsdp2_move(module: ModuleType) -> None:
    """FSDP2 moves a CPU module's parameters to its mesh's device with ``param.data = param.to(device)``:
    a real tensor cannot take a fake one's data, so on a fake GPU each managed module's parameters
    and buffers are replaced by their moved copies first, as ``Module.cuda()`` does, tied ones once."""
    import torch

    original = module._get_modules_and_states

    @functools.wraps(original)
    def get(arg_module: Any, device: Any, ignored_params: Any) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            roots = arg_module if isinstance(arg_module, (list, tuple)) else [arg_module]
            ignored = set(ignored_params or ())
            moved: dict[int, Any] = {}
            with torch.no_grad():
                for root in roots:
                    for owner in root.modules():
                        for states, wrap in ((owner._parameters, True), (owner._buffers, False)):
                            for name, tensor in list(states.items()):
                                if tensor is None or tensor.device.type != "cpu" or tensor in ignored:
                                    continue
                                if id(tensor) not in moved:
                                    copy = tensor.to(device)
                                    moved[id(tensor)] = parameter_of(copy, tensor) if wrap else copy
                                states[name] = moved[id(tensor)]
        return original(arg_module, device, ignored_params)

    def parameter_of(copy: Any, before: Any) -> Any:
        return torch.nn.Parameter(copy, before.requires_grad)

    setattr(module, "_get_modules_and_states", get)


def _mend_ddp(module: ModuleType) -> None:
    """DDP on a fake GPU: its check that reads parameter values across ranks is skipped (the ranks
    of a simulated world agree), and its logger takes no CUDA timings."""
    setattr(module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)
    ddp = module.DistributedDataParallel
    init = ddp.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "logger", None) is not None and not isinstance(self.logger, _QuietLogger):
            self.logger = _QuietLogger(self.logger)

    ddp.__init__ = __init__


def _mend_dtensor_rng(module: ModuleType) -> None:
    """DTensor's random ops keep the CUDA generator's state (16 bytes) as a CUDA tensor and compare
    it across ranks; a fake one has no values to compare or to advance, so it stays on the CPU."""
    tracker = getattr(module, "OffsetBasedRNGTracker", None)
    if tracker is not None and hasattr(tracker, "_get_device_state"):
        tracker._get_device_state = lambda self: self._device_handle.get_rng_state()


def _mend_fsdp1_move(module: ModuleType) -> None:
    """FSDP1 given a CPU module and ``device_id`` moves it with ``param.data = param.to(device)``:
    a real tensor cannot take a fake one's data (it would read as a meta tensor), so on a fake GPU
    each module's parameters and buffers are replaced by their moved copies, as ``Module.cuda()``
    does, tied ones once."""
    import collections

    import torch

    original = module._move_module_to_device

    @functools.wraps(original)
    def move(root: Any, ignored_params: Any, ignored_buffers: Any, device: Any) -> None:
        if device is None or torch.device(device).type != "cuda":
            return original(root, ignored_params, ignored_buffers, device)
        moved: dict[int, Any] = {}
        queue = collections.deque([root])
        with torch.no_grad():
            while queue:
                current = queue.popleft()
                for states, ignored, wrap in ((current._parameters, ignored_params, True),
                                              (current._buffers, ignored_buffers, False)):
                    for name, tensor in list(states.items()):
                        if tensor is None or tensor.device.type != "cpu" or tensor in ignored:
                            continue
                        if id(tensor) not in moved:
                            copy = tensor.to(device)
                            moved[id(tensor)] = torch.nn.Parameter(copy, tensor.requires_grad) if wrap else copy
                        states[name] = moved[id(tensor)]
                wrapped = module.fsdp_file.FullyShardedDataParallel  # imported after this module
                queue.extend(c for c in current.children() if not isinstance(c, wrapped))
        return None

    setattr(module, "_move_module_to_device", move)


def _mend_fsdp1_allocated(module: ModuleType, fake_type: Any) -> None:
    """FSDP1 asks whether a flat parameter's storage is allocated by its data pointer, and a fake
    storage's is always 0: at a world above 1 with ``SHARD_GRAD_OP`` and ``use_orig_params`` its
    pre-unshard check failed. A fake storage is allocated when it has bytes."""
    original = module._data_ptr_allocated

    def allocated(tensor: Any) -> bool:
        if isinstance(tensor, fake_type):
            return bool(tensor.untyped_storage().nbytes() > 0)
        return bool(original(tensor))

    setattr(module, "_data_ptr_allocated", allocated)


def _foreach_for_fakes(module: ModuleType, fake_type: type) -> None:
    """The optimizers' foreach path is taken for tensors of the listed types only (two lists: the
    optimizers' own, and the one for gradient clipping and the like); a fake parameter's type is
    FakeTensor, and without it Adam would run per tensor (another peak: the foreach path holds a
    full-size temporary, the per-tensor one a step's slice)."""
    supported = getattr(module, "_foreach_supported_types", None)
    if isinstance(supported, list) and fake_type not in supported:
        supported.append(fake_type)


def _sdp_choice(torch: ModuleType, model: GpuModel, query: Any, key: Any, value: Any, attn_mask: Any,
                dropout: float, is_causal: bool, enable_gqa: bool) -> int:
    """The attention kernel torch's CUDA build picks on the model (``sdp_utils.cpp`` of torch 2.11,
    checked against an H100's choices: benchmarks/results/sdpa_choice_gpu.json): on sm90 and sm10x
    cuDNN's first (torch >= 2.9 with cuDNN >= 9.15), then flash, then memory-efficient, then math,
    each as far as shapes, strides, dtypes and the switches decide it.
    A mask whose last dimension is strided (T5's position bias, a permuted view) sends every call to
    the math path, which keeps the seq x seq weights."""
    backends = torch.backends.cuda
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return SDPA_MATH
    batch, heads, s_q, d_qk = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    same_dtype = query.dtype == key.dtype == value.dtype
    sm = (model.major, model.minor)
    grouped = (enable_gqa and key.shape[-3] == value.shape[-3] and key.shape[-3] > 0
               and heads % key.shape[-3] == 0)
    batches = key.shape[0] == batch and value.shape[0] == batch and s_q > 0 and s_k > 0
    shared = batches and (grouped or key.shape[-3] == heads == value.shape[-3])
    unit_mask = attn_mask is None or attn_mask.stride(-1) == 1  # every fused kernel's condition on a GPU
    unit = all(t.stride(-1) == 1 for t in (query, key, value))

    def cudnn() -> bool:
        deterministic = torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled()
        limit = 256 if sm[0] in (9, 10) else 128
        trained_mask = attn_mask is not None and attn_mask.requires_grad  # Swin's bias: cuDNN has no gradient for it
        return (backends.cudnn_sdp_enabled() and not deterministic and half and same_dtype and not trained_mask
                and (8, 0) <= sm <= (12, 1) and shared and unit_mask and (unit or d_qk == 1)
                and max(batch, heads) <= 65535 and d_qk <= limit and d_v <= limit and d_qk % 8 == 0
                and d_v % 8 == 0 and s_k != 1 and not (dropout and s_q == 1))

    def flash() -> bool:  # a head size off a multiple of 8 is padded to one (scaled_dot_product_attention)
        return (backends.flash_sdp_enabled() and attn_mask is None and half and same_dtype
                and (8, 0) <= sm <= (12, 1) and d_qk == key.shape[-1] == d_v and d_qk <= 256
                and not (is_causal and s_q != s_k) and shared and (unit or d_qk == 1))

    def efficient() -> bool:
        align = 8 if half else 4  # the GEMM alignment on sm80+, in elements
        return (backends.mem_efficient_sdp_enabled() and (5, 0) <= sm <= (12, 1) and same_dtype
                and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and d_qk == key.shape[-1] and d_qk % align == 0 and d_v % align == 0
                and all(t.storage_offset() % align == 0 for t in (query, key, value))
                and batches and key.shape[-3] == heads == value.shape[-3] and unit and unit_mask)

    order = (SDPA_CUDNN, SDPA_FLASH, SDPA_EFFICIENT) if sm[0] in (9, 10) else (SDPA_FLASH, SDPA_EFFICIENT)
    usable = {SDPA_CUDNN: cudnn, SDPA_FLASH: flash, SDPA_EFFICIENT: efficient}
    return next((kernel for kernel in order if usable[kernel]()), SDPA_MATH)


def _attention(torch: ModuleType, model: GpuModel, fake_type: Any) -> None:
    """``scaled_dot_product_attention`` picks its kernel in C++ for the device, and the CPU build
    has no CUDA choice: it would take the math path, which holds the seq x seq weights. On fake CUDA
    tensors the kernel the model would run is called instead (its meta kernel gives its outputs), on
    the arguments as autocast hands them over (it is on autocast's lower-precision list)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    aten = torch.ops.aten

    def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                     dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                                     enable_gqa: bool = False) -> Any:
        as_given = (query, key, value, attn_mask)
        fake_cuda = isinstance(query, fake_type) and query.device.type == "cuda"
        if fake_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            query, key, value, attn_mask = (t.to(dtype) if t is not None and t.is_floating_point() else t
                                            for t in as_given)
        choice = (_sdp_choice(torch, model, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
                  if fake_cuda else SDPA_MATH)
        if choice == SDPA_MATH:
            query, key, value, attn_mask = as_given
            if fake_cuda:  # the math kernel itself: a CUDA build's own choice would ask the driver (the
                # CPU build's path takes the same kernel)
                return aten._scaled_dot_product_attention_math(  # noqa: SLF001
                    query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if choice == SDPA_FLASH:
            head = query.shape[-1]
            pad = -head % 8  # padded to a multiple of 8, the output cut back
            if pad:
                scale = head ** -0.5 if scale is None else scale
                query, key, value = (functional.pad(t, (0, pad)) for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention(  # noqa: SLF001
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :head] if pad else out
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill_(
                bias.logical_not(), float("-inf"))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if choice == SDPA_CUDNN:
            return aten._scaled_dot_product_cudnn_attention(  # noqa: SLF001
                query, key, value, bias, grad, dropout_p, is_causal, False, scale=scale)[0]
        if bias is not None:
            if bias.stride(-1) != 1 or any(stride % 8 for stride in bias.stride()[:-1]):
                # padded to a multiple of 8 and viewed back (sdpa's pad_bias): the copy is what backward keeps
                columns = bias.shape[-1]
                bias = functional.pad(bias, (0, 8 - columns % 8))[..., :columns]
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(  # noqa: SLF001
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = scaled_dot_product_attention


def _data_dependent(func: Any, exc: Exception) -> str:
    name = str(func).replace("aten.", "aten::", 1)
    what = ("reads a value of a CUDA tensor (.item(), a Python bool or int of it)"
            if "_local_scalar_dense" in name else "has an output whose size depends on the values of a CUDA tensor")
    return (f"a fake GPU cannot run {name}: it {what}, and a fake tensor has no values. Keep that value on "
            "the CPU (compute it from CPU tensors), declare a fixed size, or run this test on a real GPU "
            "(fake_gpu='off')")
