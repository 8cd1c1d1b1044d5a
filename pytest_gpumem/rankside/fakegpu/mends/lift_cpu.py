"""``torch.tensor(data, device="cuda")`` builds its tensor below the dispatcher's Python key, on the
device asked for (a CUDA kernel the CPU build lacks); with only CPU tensors lifted it builds on the
CPU and moves with a dispatched ``_to_copy``, as inside FakeTensorMode (torch's NOTE "torch.tensor,
lift_fresh, and device movement")."""

from __future__ import annotations

from types import ModuleType

from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    torch._C._set_only_lift_cpu_tensors(True)  # noqa: SLF001


MEND: Mend = Mend(
    name='torch.tensor on CUDA built on the host',
    needed_by="tests/test_fake_gpu_ops.py: torch.tensor of data on CUDA (transformers' cache)",
    on_import=(("torch", _patch),),
)
