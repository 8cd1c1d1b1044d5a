"""``torch.compile`` on a fake GPU: Inductor's kernels cannot be built without a device, and Dynamo
would fall back to eager under the fake mode anyway, without a word. The function or module is
returned as it is, and the report says the figure is the eager one (docs/fake-gpu.md: how far a
compiled job's figure was from eager on a GPU)."""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

from .base import Context, Mend

# benchmarks/results/fake_gpu_compile.txt: an 8-block GPT-like stack on one H100 against the fake GPU.
COMPILED_VS_EAGER = ("the figure is the eager job's; on a GPT-like stack it read 0.43% above the GPU's Inductor "
                     "run, equal to its aot_eager run")


def _patch(torch: ModuleType, context: Context) -> None:
    original = getattr(torch, "compile")

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - torch.compile
        if model is None:
            return lambda fn: compile(fn, **kwargs)
        if f"{os.sep}torch{os.sep}" not in sys._getframe(1).f_code.co_filename:  # noqa: SLF001 - torch's own: inside
            name = getattr(model, "__qualname__", None) or type(model).__name__
            context.supplied.add(f"compile: torch.compile({name}) ran eagerly ({COMPILED_VS_EAGER})")
        return model

    setattr(torch, "compile", compile)


MEND: Mend = Mend(
    name='torch.compile runs eagerly, said',
    needed_by='idiom torch_compile',
    on_import=(("torch", _patch),),
)
