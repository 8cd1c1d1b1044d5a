"""FSDP1 (given a CPU module and ``device_id``) and FSDP2 move a module's parameters to the device with
``param.data = param.to(device)``: a real tensor cannot take a fake one's data (it would read as a
meta tensor), so on a fake GPU each managed module's parameters and buffers are replaced by their
moved copies first, as ``Module.cuda()`` does, tied ones once."""

from __future__ import annotations

import collections
import functools
from types import ModuleType
from typing import Any, Iterable, Iterator

from .base import Context, Mend


def _move(torch: ModuleType, modules: Iterable[Any], device: Any, ignored_params: Any, ignored_buffers: Any) -> None:
    moved: dict[int, Any] = {}
    with torch.no_grad():
        for owner in modules:
            for states, ignored, wrap in ((owner._parameters, ignored_params, True),
                                          (owner._buffers, ignored_buffers, False)):
                for name, tensor in list(states.items()):
                    if tensor is None or tensor.device.type != "cpu" or tensor in ignored:
                        continue
                    if id(tensor) not in moved:
                        copy = tensor.to(device)
                        moved[id(tensor)] = torch.nn.Parameter(copy, tensor.requires_grad) if wrap else copy
                    states[name] = moved[id(tensor)]


def _to_cuda(torch: ModuleType, device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _fsdp1(module: ModuleType, context: Context) -> None:
    torch, original = context.torch, module._move_module_to_device

    def unwrapped(root: Any) -> Iterator[Any]:
        """The root and its descendants down to (not into) the ones FSDP1 wraps apart."""
        wrapped = module.fsdp_file.FullyShardedDataParallel  # imported after this module
        queue = collections.deque([root])
        while queue:
            current = queue.popleft()
            yield current
            queue.extend(child for child in current.children() if not isinstance(child, wrapped))

    @functools.wraps(original)
    def move(root: Any, ignored_params: Any, ignored_buffers: Any, device: Any) -> None:
        if not _to_cuda(torch, device):
            return original(root, ignored_params, ignored_buffers, device)
        _move(torch, unwrapped(root), device, ignored_params, ignored_buffers)
        return None

    setattr(module, "_move_module_to_device", move)


def _fsdp2(module: ModuleType, context: Context) -> None:
    torch, original = context.torch, module._get_modules_and_states

    @functools.wraps(original)
    def get(arg_module: Any, device: Any, ignored_params: Any) -> Any:
        if _to_cuda(torch, device):
            roots = arg_module if isinstance(arg_module, (list, tuple)) else [arg_module]
            ignored = set(ignored_params or ())
            _move(torch, (owner for root in roots for owner in root.modules()), device, ignored, ignored)
        return original(arg_module, device, ignored_params)

    setattr(module, "_get_modules_and_states", get)


MEND: Mend = Mend(
    name="FSDP's move to the device as Module.cuda()",
    needed_by='tests/test_fake_gpu_ops.py: FSDP1 moving a CPU module with device_id (tied weights); idiom '
              'fsdp2_options',
    on_import=(("torch.distributed.fsdp._init_utils", _fsdp1),
               ("torch.distributed.fsdp._fully_shard._fully_shard", _fsdp2)),  # the name its caller holds
)
