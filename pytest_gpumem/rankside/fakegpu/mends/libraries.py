"""A GPU loads a library's kernels at the job's first call into it, outside the allocator (the
context grows: lazy module loading), and NCCL makes a communicator at a group's first collective; the
fake GPU has no context, so it notes which the job called, and the device figure adds what the
calibration measured for each (``fakegpu.device``). cuBLAS is noted where its workspace is taken
(``accounting.FakeAllocator.workspace``). On an H100 with torch 2.11 attention in half precision runs
cuDNN's kernel (benchmarks/results/sdpa_choice.txt): it loads cuDNN."""

from __future__ import annotations

from typing import Any

from .base import Context, Mend, OpHook

CUDNN = ("convolution", "_convolution", "cudnn_convolution", "convolution_backward", "cudnn_batch_norm",
         "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
         "_scaled_dot_product_cudnn_attention")
ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_flash_attention_forward", "_efficient_attention_forward")
# a collective on a CUDA tensor: NCCL's (the process group's and the functional collectives' ops)
NCCL = tuple(f"c10d.{op}" for op in (
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "broadcast_", "reduce_", "gather_", "scatter_", "alltoall_",
    "alltoall_base_", "send", "recv_", "recv_any_source_")) + tuple(f"_c10d_functional.{op}" for op in (
    "all_reduce", "all_reduce_", "all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor",
    "all_to_all_single", "broadcast", "broadcast_"))


def _loads(library: str) -> OpHook:
    def hook(context: Context, args: Any, kwargs: dict[str, Any], index: int) -> None:
        context.allocator.called(library)

    return hook


MEND: Mend = Mend(
    name="the libraries' kernels and NCCL's communicator, outside the allocator",
    needed_by="tests/test_fake_gpu_device.py: a convolution's job predicts cuDNN's part of the device figure, "
              "a matrix product's alone does not, a collective's NCCL's (benchmarks/results/device_figure.txt)",
    after_op=tuple((op, _loads("cudnn")) for op in CUDNN) + tuple((op, _loads("attention")) for op in ATTENTION)
    + tuple((op, _loads("nccl")) for op in NCCL),
)
