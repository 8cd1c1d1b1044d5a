"""A GPU loads a library's kernels at the job's first call into it, outside the allocator (the
context grows: lazy module loading); the fake GPU has no context, so it notes which libraries the
job called, and the device figure adds what the calibration measured for each (``fakegpu.device``).
cuBLAS is noted where its workspace is taken (``accounting.FakeAllocator.workspace``)."""

from __future__ import annotations

from typing import Any

from .base import Context, Mend, OpHook

CUDNN = ("convolution", "_convolution", "cudnn_convolution", "convolution_backward", "cudnn_batch_norm",
         "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional")
ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")


def _loads(library: str) -> OpHook:
    def hook(context: Context, args: Any, kwargs: dict[str, Any], index: int) -> None:
        context.allocator.called(library)

    return hook


MEND: Mend = Mend(
    name="the libraries' kernels, loaded outside the allocator",
    needed_by="tests/test_fake_gpu_device.py: a convolution's job predicts cuDNN's part of the device figure, "
              "a matrix product's alone does not (benchmarks/gpu/device_figure.py: the hub's and the sweep's models)",
    after_op=tuple((op, _loads("cudnn")) for op in CUDNN) + tuple((op, _loads("attention")) for op in ATTENTION),
)
