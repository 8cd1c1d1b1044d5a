"""``Module.cuda()``/``.to("cuda")`` keeps a real parameter's identity by giving it the moved data;
a real tensor cannot take a fake one's (nor be swapped with it), so torch makes a new Parameter in
each module that holds it, and a tied weight (transformers' input and output embeddings) would be
moved twice and untied: twice its memory, its gradient and its optimizer state. Here a tensor is
moved once per call, and the modules that shared a parameter share its moved one.

A parameter that is already fake (``.cuda().bfloat16()``, ``.to(memory_format=...)``) torch would
swap in place, which a fake tensor refuses (its fake mode holds a weak reference to it): it is
replaced by a new Parameter instead, with its gradient converted alike."""

from __future__ import annotations

import functools
import threading
from types import ModuleType
from typing import Any

from .base import Context, Mend


def _patch(torch: ModuleType, context: Context) -> None:
    fake_type = context.fake_type
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


MEND: Mend = Mend(
    name='tied parameters moved once',
    needed_by="tests/test_fake_gpu.py's transformers GPT-2 under DDP (tied embeddings); idioms "
              'cuda_then_bfloat16, channels_last_convnet',
    on_import=(("torch", _patch),),
)
