"""Shape rules: what a CUDA op returns (shape, dtype, strides), where torch's fake mode has no rule or
one stricter than the CUDA kernel.

Three kinds, tried in this order:

- **registered** here, for CUDA ops torch registers no meta kernel for: SyncBatchNorm's statistics
  kernels (``batch_norm_stats`` and its four siblings, run at every world above 1) and the GRU
  cell that ``nn.GRU`` takes where cuDNN is not used;
- **one kernel** where the CUDA build has one: an op with a CPU kernel and a decomposition
  (``silu_backward``) or a fused CUDA-only one (``_fused_rms_norm``) is sent down whole to its
  shape rule, not through a decomposition whose intermediates a GPU never holds;
- **answered by the CPU kernel** (``answer_on_the_cpu``) for any other op whose shape rule is
  missing or refuses what the CUDA kernel takes (``_grouped_mm`` in float32: its rule asks for
  bfloat16, CUDA's kernel loops over the groups in any float type): the op's CPU kernel runs once on
  stand-in inputs of the same shapes, strides and dtypes (zeros), and its outputs' metadata become
  the fake outputs. The report lists each such op with the job's line, as it lists a supplied value.
  An op the CPU kernel refuses too is the job's error, raised in the kernel's words.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

# Fused ops with a CUDA kernel only (none for the CPU, a decomposition elsewhere): RMSNorm on a GPU
# holds its output and the inverse RMS, not the decomposition's five intermediates.
CUDA_ONLY_FUSED = ("aten::_fused_rms_norm",)
# Stand-in inputs above this many bytes are not made: the op is named instead (a host the size of the GPU
# would be needed to answer it this way).
STAND_IN_LIMIT = 4 << 30
_kept_libraries: list[Any] = []  # a Library's registrations last as long as the object


def install_rules(torch: ModuleType) -> None:
    """Register the missing rules and the one-kernel routes, for the life of the process."""
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(_RefusedRuleLog())
    library = torch.library.Library("aten", "IMPL")
    _kept_libraries.append(library)
    _one_kernel(torch, library)
    has_meta = torch._C._dispatch_has_kernel_for_dispatch_key  # noqa: SLF001
    for name, rule in _missing(torch).items():
        if not has_meta(f"aten::{name}", "Meta"):
            library.impl(name, rule, "Meta")


def _one_kernel(torch: ModuleType, library: Any) -> None:
    """A CUDA kernel registered (never run) for each op that has a CPU kernel and a decomposition, or is
    fused on CUDA only: in the CPU build a CUDA tensor would take the decomposition, whose intermediates
    (three activation-sized tensors for SiLU's backward) a GPU never holds. The op goes down whole, to
    the fake mode, which runs it on its shape rule."""

    def no_kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pytest-gpumem's fake GPU: a CUDA op reached no fake tensor")

    has = torch._C._dispatch_has_kernel_for_dispatch_key  # noqa: SLF001
    for name in torch._C._dispatch_get_all_op_names():  # noqa: SLF001
        if name.startswith("aten::") and has(name, "CompositeImplicitAutograd") and (
                has(name, "CPU") or name in CUDA_ONLY_FUSED):
            library.impl(name.removeprefix("aten::"), no_kernel, "CUDA")


def _missing(torch: ModuleType) -> dict[str, Callable[..., Any]]:
    """Shape rules for CUDA ops with none, as the CUDA kernels allocate their outputs
    (``native/cuda/Normalization.cu{,h}``, ``RNN.cu``)."""

    def stat_dtype(tensor: Any) -> Any:  # batch norm's statistics accumulate reduced floats in float32
        return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype

    def like_input(tensor: Any) -> Any:
        return torch.empty_like(tensor, memory_format=tensor.suggest_memory_format()) \
            if hasattr(tensor, "suggest_memory_format") else torch.empty_like(tensor)

    def stats(input: Any, eps: float) -> Any:
        features = input.shape[1]
        return (input.new_empty((features,), dtype=stat_dtype(input)),
                input.new_empty((features,), dtype=stat_dtype(input)))

    def gather(input: Any, mean: Any, invstd: Any, running_mean: Any, running_var: Any, momentum: float,
               eps: float, *counts: Any) -> Any:
        features = mean.shape[-1]
        dtype = torch.float32 if mean.dtype == torch.float16 else mean.dtype
        return mean.new_empty((features,), dtype=dtype), mean.new_empty((features,), dtype=dtype)

    def elemt(input: Any, weight: Any, bias: Any, mean: Any, invstd: Any, eps: float) -> Any:
        return like_input(input)

    def backward_reduce(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any, input_g: bool,
                        weight_g: bool, bias_g: bool) -> Any:
        features = input.shape[1]
        nothing = mean.new_empty((0,))

        def per_feature(wanted: bool) -> Any:
            return weight.new_empty((features,)) if wanted and weight is not None else nothing

        sum_dy = torch.empty_like(mean, memory_format=torch.contiguous_format) if input_g else nothing
        sum_dy_xmu = torch.empty_like(mean, memory_format=torch.contiguous_format) if input_g else nothing
        return sum_dy, sum_dy_xmu, per_feature(weight_g), per_feature(bias_g)

    def backward_elemt(grad_out: Any, input: Any, *rest: Any) -> Any:
        return like_input(input)

    def gru_cell(input_gates: Any, hidden_gates: Any, hx: Any, input_bias: Any = None, hidden_bias: Any = None) -> Any:
        return hx.new_empty(hx.shape), hx.new_empty((hx.shape[0], hx.shape[1] * 5))

    def gru_cell_backward(grad_hy: Any, workspace: Any, has_bias: bool) -> Any:
        batch, hidden = grad_hy.shape
        gates = grad_hy.new_empty((batch, 3 * hidden))
        bias = grad_hy.new_empty((3 * hidden,)) if has_bias else grad_hy.new_empty((0,))
        return gates, gates.new_empty(gates.shape), grad_hy.new_empty(grad_hy.shape), bias, bias.new_empty(bias.shape)

    def library_ctc(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, blank: int) -> bool:
        return False  # cuDNN's (MIOpen's) CTC wants int32 targets on the CPU: a fake GPU takes CUDA's own kernel

    return {**{f"_use_{library}_ctc_loss{overload}": library_ctc for library in ("cudnn", "miopen")
               for overload in ("", ".Tensor")},
            "batch_norm_stats": stats, "batch_norm_gather_stats": gather,
            "batch_norm_gather_stats_with_counts": gather, "batch_norm_elemt": elemt,
            "batch_norm_backward_reduce": backward_reduce, "batch_norm_backward_elemt": backward_elemt,
            "_thnn_fused_gru_cell": gru_cell, "_thnn_fused_gru_cell_backward": gru_cell_backward}


class _RefusedRuleLog(logging.Filter):
    """Fake mode logs each shape rule that raises, with its traceback, before raising: here that is the
    cue for the CPU kernel's answer (listed in the report), not an error of the job's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta for")


class NoAnswer(Exception):
    """The CPU kernel could not stand in (no CPU kernel either, or stand-ins too large): why, in words."""


def answer_on_the_cpu(torch: ModuleType, mode: Any, fake_type: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``func``'s outputs as fake tensors, from its CPU kernel run once on zeros shaped as the fake
    inputs. Raises the CPU kernel's own error where it refuses the inputs, ``NoAnswer`` where it
    cannot be run. Called inside ``mode``'s dispatch (no mode on the stack)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((args, kwargs))
    fakes = [leaf for leaf in leaves if isinstance(leaf, fake_type)]
    if any(fake.layout != torch.strided for fake in fakes):
        layouts = ", ".join(sorted({str(f.layout) for f in fakes}))
        raise NoAnswer(f"its inputs are {layouts} (no storage to stand in for)")
    storages = {f.untyped_storage()._cdata: f.untyped_storage().nbytes() for f in fakes}  # noqa: SLF001
    size = sum(storages.values())
    if size > STAND_IN_LIMIT:
        raise NoAnswer(f"its inputs ({size / 2**30:.1f} GiB) are too large to stand in for on the host")
    # one stand-in per fake storage, shared by the inputs that share it, as on the GPU
    stand_ins = {key: torch.zeros(nbytes, dtype=torch.uint8) for key, nbytes in storages.items()}
    by_data: dict[int, list[Any]] = {}  # a stand-in's data pointer -> the fake tensors on that storage

    def stand_in(leaf: Any) -> Any:
        if isinstance(leaf, fake_type):
            bytes_ = stand_ins[leaf.untyped_storage()._cdata]  # noqa: SLF001
            real = bytes_.view(leaf.dtype).as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
            if bytes_.numel():
                by_data.setdefault(bytes_.data_ptr(), []).append(leaf)
            return real
        if isinstance(leaf, torch.device) and leaf.type == "cuda":
            return torch.device("cpu")
        return leaf

    with _disable_current_modes():  # a decomposition's op is dispatched with the fake mode re-entered
        real_args, real_kwargs = tree_unflatten([stand_in(leaf) for leaf in leaves], spec)
        try:
            out = func(*real_args, **real_kwargs)
        except NotImplementedError as exc:  # no CPU kernel either
            raise NoAnswer(f"it has no CPU kernel either ({str(exc).splitlines()[0][:120]})") from None
    device = next((f.fake_device for f in fakes), torch.device("cuda", 0))

    def faked(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.layout != torch.strided:
            raise NoAnswer(f"its CPU kernel returns a {leaf.layout} tensor, which a fake GPU does not count")
        sources = by_data.get(leaf.untyped_storage().data_ptr()) if leaf.untyped_storage().nbytes() else None
        if sources:  # written in place or a view of an input: the fake input itself, or a view of its storage
            geometry = (leaf.shape, leaf.stride(), leaf.storage_offset())
            same = [f for f in sources if (f.shape, f.stride(), f.storage_offset()) == geometry]
            if same:
                return same[0]
            with mode:
                return sources[0].as_strided(*geometry)
        itemsize = leaf.element_size() or 1
        with _disable_current_modes():
            base = torch.empty(leaf.untyped_storage().nbytes() // itemsize, dtype=leaf.dtype, device="meta")
            meta = base.as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
        return fake_type(mode, meta, device)

    flat_out, out_spec = tree_flatten(out)
    return tree_unflatten([faked(leaf) for leaf in flat_out], out_spec)
