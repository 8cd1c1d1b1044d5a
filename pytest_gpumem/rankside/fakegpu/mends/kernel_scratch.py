"""Scratch a CUDA kernel allocates and frees inside itself, beyond the outputs its meta kernel gives.

Each rule is ``op name -> bytes(model, args, kwargs)``; the bytes are counted at the op, on top of
what is live (``FakeAllocator.transient``). Each was found in a GPU's allocator history and is
checked there to the byte:

- cuDNN attention's backward keeps dQ in float32 and the rows' dO.O sums (ViT-B/16's 18.76 MiB and
  T5's cross-attention 4.06 MiB on an H100: benchmarks/results/sdpa_choice.txt), and so does the
  memory-efficient one in half precision, over rows padded to 64;
- a reduction over a dimension that is not the innermost (a bias gradient, ``grad.sum(0)``) that
  splits its inputs across blocks stages partial sums in global memory (``Reduce.cuh``'s
  ``setReduceConfig``): 16 MiB for a [1024, 2048] bias gradient on an H100, the torch-only MoE's peak.
"""

from __future__ import annotations

from typing import Any, Callable

from ..models import GpuModel
from .base import Context, Mend

MAX_THREADS = 512  # a reduction block's (Reduce.cuh ReduceConfig::MAX_NUM_THREADS)
THREADS_PER_SM = 2048  # maxThreadsPerMultiProcessor, sm80 to sm90
MIN_VALUES, MAX_VALUES = 16, 256  # a thread's share of the inputs before the reduction splits them


def _cudnn_attention_backward(model: GpuModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    query = args[1]
    return query.numel() * 4 + query.numel() // query.shape[-1] * 4


def _efficient_attention_backward(model: GpuModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """In half precision the memory-efficient backward accumulates dQ in float32 over query rows
    padded to 64, beside the rows' dO.O sums (ViT-B/16 with the kernel forced: 24.31 MiB on an H100,
    24.29 here). Its float32 buffers (two query-sized ones in the fp32 idiom) are not modelled."""
    query = args[1]
    if query.element_size() != 2 or query.dim() != 4:
        return 0
    batch, heads, rows, head = query.shape
    return batch * heads * (-(-rows // 64) * 64) * head * 4 + batch * heads * rows * 4


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _reduction(model: GpuModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """``setReduceConfig`` for a reduction whose innermost input dimension is kept ("vectorize along
    output"): the global staging buffer and its semaphores, when the inputs are split across blocks.
    Reductions along the innermost dimension stage one value per output and block: not counted."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if not dims or x.dim() == 0 or not x.is_floating_point():
        return 0
    reduced = {d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)}
    # TensorIterator's view: dims of size > 1 from the fastest, adjacent ones of a kind coalesced
    order = sorted((x.stride(d), x.shape[d], d in reduced) for d in range(x.dim()) if x.shape[d] > 1)
    groups: list[list[Any]] = []
    for stride, size, is_reduced in order:
        last = groups[-1] if groups else None
        if last is not None and last[2] == is_reduced and last[0] * last[1] == stride:
            last[1] *= size
        else:
            groups.append([stride, size, is_reduced])
    if not groups or groups[0][2] or all(not g[2] for g in groups):
        return 0
    outputs = 1
    inputs = 1
    for _, size, is_reduced in groups:
        if is_reduced:
            inputs *= size
        else:
            outputs *= size
    vec = 1
    if groups[0][0] == 1:  # the fastest kept dimension is dense: outputs vectorised by 4, 2 or 1
        vec = 4
        kept = [size for _, size, is_reduced in groups if not is_reduced]
        strides = [1]
        for size in kept[:-1]:
            strides.append(strides[-1] * size)
        while vec > 1 and any(n % vec for n in [kept[0], *strides[1:]]):
            vec //= 2
    limit = MAX_THREADS // vec
    dim0, dim1 = outputs // vec, inputs
    dim0_pow2 = _last_pow2(dim0) if dim0 < limit else limit
    dim1_pow2 = _last_pow2(dim1) if dim1 < limit else limit
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, limit // width)
    width = min(dim0_pow2, limit // height)
    step_output, step_input = width, 1
    if inputs >= height * MIN_VALUES or inputs >= MAX_VALUES:
        step_input = height  # inputs split across the block's warps
    else:
        return 0  # each warp its own outputs: no global staging
    grid = -(-(outputs // vec) // step_output)
    per_thread = -(-inputs // step_input)
    target = model.multi_processor_count * (THREADS_PER_SM // (width * height))
    if per_thread < MAX_VALUES or grid > target:
        return 0
    ctas = max(min(-(-target // grid), -(-per_thread // MIN_VALUES)), -(-per_thread // MAX_VALUES))
    if ctas <= 1:
        return 0
    accumulator = 8 if x.element_size() == 8 else 4
    return accumulator * outputs * ctas * width * vec + 4 * grid


KERNEL_SCRATCH: dict[str, Callable[[GpuModel, tuple[Any, ...], dict[str, Any]], int]] = {
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_attention_backward,
    "_scaled_dot_product_efficient_attention_backward": _efficient_attention_backward,
    "sum": _reduction,
    "mean": _reduction,
}


def _counted(rule: Callable[[GpuModel, tuple[Any, ...], dict[str, Any]], int]) -> Any:
    def hook(context: Context, args: Any, kwargs: dict[str, Any], index: int) -> None:
        context.allocator.transient(index, rule(context.model, args, kwargs))

    return hook


MEND: Mend = Mend(
    name="kernels' own scratch",
    needed_by="idioms sdpa_flash_bf16, sdpa_with_mask_fp32; tests/jobs.py's torch-only MoE (a bias "
              "gradient's staged sums)",
    after_op=tuple((op, _counted(rule)) for op, rule in KERNEL_SCRATCH.items()),
)
