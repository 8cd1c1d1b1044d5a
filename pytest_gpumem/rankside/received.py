"""Inside a simulated rank: values that other ranks would have sent, found where the job reads them.

The fake process group moves no data: a tensor a collective fills keeps what it held (zeros, or
whatever ``torch.empty`` left). That costs nothing where only sizes matter (gradients, shards,
activations), but a job that sizes a buffer or picks a branch from a received value, as a mixture-of-
experts layer does with its token counts (``all_to_all_single`` of counts, then ``.tolist()`` for the
split sizes), would be measured on garbage. So integer and bool tensors a collective fills are
marked, and so is every integer or bool tensor computed from them (a TorchFunctionMode follows
them); floating tensors are data, not sizes, and are left alone.

Where the job reads a marked tensor as Python numbers (``item``, ``tolist``, ``int``, ``bool``,
indexing with it, a factory sized by it), the rank

- stops with a message naming the read and the collective, unless the test declared an assumption;
- under ``assume="alike"`` (every rank sends what this rank sends) goes on: the collective's output
  was filled with the values that assumption gives, and the read is noted, so the figure is exact
  under that assumption and says so. For expert routing that is balanced routing where the router is
  balanced (each rank receives what it sends), and a router that favours an expert shows at that
  expert's rank (``rank="all"`` finds it).

Point-to-point receives are marked but never filled: no assumption says what a neighbour sends.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from typing import Any, Callable

from ..config.spec import ASSUME
from .imports import after_import

ASSUME_ENV = "GPUMEM_SIMULATE_ASSUME"  # the marker's assume=: "" or "alike"
ALIKE = "every rank sends what this rank sends"
_MARK = "_gpumem_received"  # attribute of a marked tensor: which collective filled what it came from

__tracebackhide__ = True


class ReceivedValueError(RuntimeError):
    """A simulated rank read values other ranks would have sent, and no assumption says what they are."""


def assumption(env: Any = os.environ) -> str | None:
    value = env.get(ASSUME_ENV, "")
    return value if value in ASSUME else None


def follow_received(torch: Any, dist: Any, c10d: Any, where: Any, note: Callable[[str], None]) -> None:
    """Mark (and, under an assumption, fill) what collectives receive; follow and flag its reads."""
    tracker = _Tracker(torch, where, assumption(), note)
    tracker.wrap_collectives(dist, c10d)
    tracker.follow()


class _Tracker:
    def __init__(self, torch: Any, where: Any, assume: str | None, note: Callable[[str], None]) -> None:
        self.torch, self.where, self.assume, self.note = torch, where, assume, note  # note: said once each

    # ------------------------------------------------------------------ marking at the collective

    def integral(self, tensor: Any) -> bool:
        return isinstance(tensor, self.torch.Tensor) and _integral(tensor)

    def mark(self, tensor: Any, origin: str) -> None:
        if self.integral(tensor):
            setattr(tensor, _MARK, origin)

    def group_size(self, group: Any) -> int:
        import torch.distributed as dist

        return int(dist.get_world_size(group)) if group is not None else self.where.size

    def rank_in(self, group: Any) -> int:
        import torch.distributed as dist

        return int(dist.get_rank(group)) if group is not None else self.where.rank

    def wrap_collectives(self, dist: Any, c10d: Any) -> None:
        alike, integral = self.assume == "alike", self.integral

        def all_reduce(tensor: Any, op: Any = None, group: Any = None, *_: Any, before: Any = None,
                       **__: Any) -> None:
            if alike and before is not None:  # n alike ranks: a sum is n times this one's, a max is this one's
                if op is None or op == dist.ReduceOp.SUM:
                    before = before * self.group_size(group)
                elif op == dist.ReduceOp.PRODUCT:
                    before = before ** self.group_size(group)
                tensor.copy_(before)  # from the input, whatever the fake group left in place
            self.mark(tensor, "all_reduce")

        def all_gather(tensor_list: Any, tensor: Any, *_: Any, **__: Any) -> None:
            for part in tensor_list:
                if alike and integral(part) and part.shape == tensor.shape:
                    part.copy_(tensor)
                self.mark(part, "all_gather")

        def all_gather_into_tensor(output: Any, input: Any, *_: Any, **__: Any) -> None:  # noqa: A002
            if alike and integral(output) and input.numel() and output.numel() % input.numel() == 0:
                output.view(-1, input.numel()).copy_(input.reshape(1, -1))
            self.mark(output, "all_gather_into_tensor")

        def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                              input_split_sizes: Any = None, group: Any = None, *_: Any, **__: Any) -> None:
            if alike and integral(output):  # every rank j sends this rank what this rank sends to itself
                mine = _chunk(input, input_split_sizes, self.group_size(group), self.rank_in(group))
                if mine is not None and mine.numel() * self.group_size(group) == output.numel():
                    output.view(self.group_size(group), -1).copy_(mine.reshape(1, -1))
            self.mark(output, "all_to_all_single")

        def all_to_all(output_list: Any, input_list: Any, group: Any = None, *_: Any, **__: Any) -> None:
            mine = input_list[self.rank_in(group)] if len(input_list) > self.rank_in(group) else None
            for out in output_list:
                if alike and integral(out) and mine is not None and out.shape == mine.shape:
                    out.copy_(mine)
                self.mark(out, "all_to_all")

        def reduce_scatter_tensor(output: Any, input: Any, op: Any = None, group: Any = None,  # noqa: A002
                                  *_: Any, **__: Any) -> None:
            n = self.group_size(group)
            if alike and integral(output) and input.numel() == n * output.numel():
                output.copy_(input.reshape(n, -1)[self.rank_in(group)].view_as(output))
                if op is None or op == dist.ReduceOp.SUM:
                    output.mul_(n)
            self.mark(output, "reduce_scatter_tensor")

        def broadcast(tensor: Any, src: Any = None, group: Any = None, *_: Any, group_src: Any = None,
                      **__: Any) -> None:
            if group_src is None and src is None:
                return
            # src is a global rank, group_src a place in the group.
            from_rank = group_src if group_src is not None else (
                dist.get_group_rank(group, src) if group is not None else src)
            if from_rank != self.rank_in(group):  # alike: rank src holds what this rank holds
                self.mark(tensor, "broadcast")

        def recv(tensor: Any, *_: Any, **__: Any) -> None:
            self.mark(tensor, "recv")

        after: dict[str, Callable[..., None]] = {
            "all_reduce": all_reduce, "all_gather": all_gather, "all_gather_into_tensor": all_gather_into_tensor,
            "all_to_all_single": all_to_all_single, "all_to_all": all_to_all,
            "reduce_scatter_tensor": reduce_scatter_tensor, "broadcast": broadcast, "recv": recv, "irecv": recv}
        for name, then in after.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = _after(original, then, snapshot=name == "all_reduce" and alike)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        after_import("torch.distributed._functional_collectives", lambda funcol: self._wrap_functional(dist, funcol))

    def _wrap_functional(self, dist: Any, funcol: Any) -> None:
        """The functional collectives return new tensors (wrapped once imported: a job that does not use
        them pays nothing)."""
        alike = self.assume == "alike"

        def wrap(name: str) -> None:
            original = getattr(funcol, name, None)
            if original is None:
                return

            @functools.wraps(original)
            def all_to_all_single(input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,  # noqa: A002
                                  group: Any = None, *args: Any, **kwargs: Any) -> Any:
                out = original(input, output_split_sizes, input_split_sizes, group, *args, **kwargs)
                if not self.integral(out):
                    return out
                out = funcol.wait_tensor(out)
                pg = group if isinstance(group, dist.ProcessGroup) else None
                n, rank = (self.group_size(pg), self.rank_in(pg)) if pg is not None or group is None else (0, 0)
                mine = _chunk(input, input_split_sizes, n, rank) if alike and n else None
                if mine is not None and mine.numel() * n == out.numel():
                    out.view(n, -1).copy_(mine.reshape(1, -1))
                setattr(out, _MARK, name)
                return out

            setattr(funcol, name, all_to_all_single)

        wrap("all_to_all_single")
        wrap("all_to_all_single_autograd")

    # ------------------------------------------------------------------ following and reading

    def follow(self) -> None:
        from torch.overrides import TorchFunctionMode

        torch, tracker = self.torch, self
        tensor = torch.Tensor
        reads = {tensor.item, tensor.tolist, tensor.__int__, tensor.__index__, tensor.__bool__, tensor.__float__}
        reads |= {getattr(torch, name) for name in ("empty", "zeros", "ones", "full", "arange", "randn", "rand")}

        class Follow(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                origin = _origin(args, kwargs)
                if origin is not None and func in reads:
                    tracker.read(getattr(func, "__name__", str(func)), origin)
                out = func(*args, **kwargs)
                if origin is not None:
                    for each in out if isinstance(out, (tuple, list)) else (out,):
                        tracker.mark(each, origin)
                return out

        Follow().__enter__()  # for the rank's whole life, below any mode the job enters

    def read(self, how: str, origin: str) -> None:
        where = _caller()
        if self.assume is None:
            raise ReceivedValueError(
                f"{how}() at {where} reads values that other ranks send ({origin}), in rank {self.where.rank} of "
                f"a simulated world of {self.where.size}: they do not exist here, and what the job sizes from "
                "them would be measured on garbage. Declare assume='alike' on the marker to take it that "
                f"{ALIKE}, or launch this size for real (simulate='off')")
        if origin in ("recv", "irecv"):
            raise ReceivedValueError(
                f"{how}() at {where} reads values a neighbour sends ({origin}), in rank {self.where.rank} of a "
                f"simulated world of {self.where.size}: no assumption says what another rank sends point to "
                "point. Launch this size for real (simulate='off')")
        self.note(f"values received from other ranks ({origin}) read at {where}, taken as {self.assume}: {ALIKE}")


def _origin(args: Any, kwargs: Any) -> str | None:
    for value in (*args, *kwargs.values()):
        origin = getattr(value, _MARK, None) if not isinstance(value, (list, tuple)) else next(
            (getattr(v, _MARK) for v in value if hasattr(v, _MARK)), None)
        if origin is not None:
            return origin
    return None


def _chunk(tensor: Any, splits: Any, n: int, index: int) -> Any:
    """What ``tensor`` sends to rank ``index`` of ``n`` in an all-to-all: its index-th split along dim 0."""
    sizes = list(splits) if splits else ([tensor.shape[0] // n] * n if n and tensor.shape[0] % n == 0 else None)
    if sizes is None or len(sizes) != n or sum(sizes) != tensor.shape[0]:
        return None
    return tensor.narrow(0, sum(sizes[:index]), sizes[index])


def _after(original: Callable[..., Any], then: Callable[..., None], snapshot: bool = False) -> Callable[..., Any]:
    """``original``, then ``then`` with its arguments; ``snapshot``: and with ``before``, a copy of the
    first argument's integer values as the collective found them (it works in place)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        # Bound to torch's own names: callers pass them by keyword too (DeepSpeed's output_tensor=),
        # and ``then`` takes them in torch's order.
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        first: Any = bound.args[0] if bound.args else None
        before = first.clone() if snapshot and first is not None and _integral(first) else None
        result = original(*args, **kwargs)
        then(*bound.args, **bound.kwargs, **({"before": before} if before is not None else {}))
        return result

    return collective


def _integral(tensor: Any) -> bool:
    return hasattr(tensor, "is_floating_point") and not (tensor.is_floating_point() or tensor.is_complex())


def _caller() -> str:
    """``moe.py:42``: the job's own line that read the value (torch's and this package's frames skipped)."""
    torch_dir = os.path.dirname(sys.modules["torch"].__file__ or "")
    here = os.path.dirname(os.path.dirname(__file__))
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith((torch_dir, here)):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"
