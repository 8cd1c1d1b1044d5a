"""Matrix products take cuBLAS's workspace (and, with a 1-D bias, cuBLASLt's epilogue's) once per
thread that runs one, and an operand cuBLAS cannot read in place (an expanded gradient) is copied
for the product's duration: neither is an output the meta kernel allocates."""

from __future__ import annotations

from typing import Any

from .base import Context, Mend

GEMM = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_addmm_activation", "matmul", "dot")
LT = ("addmm", "_addmm_activation")  # with a 1-D bias: cuBLASLt's epilogue
OPERANDS_LAST = ("addmm", "baddbmm", "addbmm", "_addmm_activation")  # (bias, a, b)


def _gemm(op: str) -> Any:
    def hook(context: Context, args: Any, kwargs: dict[str, Any], index: int) -> None:
        allocator = context.allocator
        for operand in args[-2:] if op in OPERANDS_LAST else args[:2]:
            if isinstance(operand, context.fake_type) and _cublas_copies(operand):
                allocator.transient(index, operand.numel() * operand.element_size())
        allocator.workspace("cublas", index)
        if op in LT and len(args) > 0 and getattr(args[0], "dim", lambda: 0)() == 1:
            allocator.workspace("cublaslt", index)

    return hook


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


MEND: Mend = Mend(
    name="cuBLAS's workspaces and operand copies",
    needed_by="tests/test_fake_gpu.py's tier: its FSDP and DDP jobs read the GPU's figures to 0.01 MiB with"
              " the workspaces and an expanded gradient's copy counted",
    after_op=tuple((op, _gemm(op)) for op in GEMM),
)
