"""Inside a rank of a simulated world: rank R of a world of W whose other ranks do not run.

The launch sets ``GPUMEM_SIMULATED_RANK=R/W`` (and ``RANK``, ``WORLD_SIZE`` as the real world has them).
Every torch process group the job creates, whatever backend it names, is torch's fake process
group: no communication, and every tensor a collective reads or writes keeps the size it has in
the real world. So the rank's allocator figure (parameter shards, collective buffers, gradients,
optimizer state, activations) is the real one; only the values received from other ranks are not
(``received``: where the job reads them, the rank stops, or goes on under a declared assumption).

What the fake group alone gets wrong, mended here:

- DDP's reducer expects its collective's future to hold the bucket; the fake one holds None. A
  no-op communication hook (torch's own ``noop_hook``) hands the bucket back, as an all-reduce in
  place would. A comm hook of the job's own is not run (its buffers are not counted): noted.
- Python objects from other ranks (``all_gather_object`` and the like) do not exist. Gathers are
  answered with this rank's own object (the world's ranks taken as alike) and noted; receiving
  another rank's object (a broadcast from, or a scatter by, another rank) stops the rank with a
  message, rather than run on a garbage size.
- A pipeline's stages vote on whether every stage declared its tensors' shapes (torch 2.13; 2.11 has none), and
  learn undeclared shapes from their neighbours: the vote is answered as if every stage voted as this
  one (stages taken as alike in that), and receiving a neighbour's shapes stops the rank with what to
  declare instead.
- A real backend keeps a tensor it sends: gloo's send work holds it until the work is dropped, NCCL
  at least until the send completes; the fake group's work holds nothing. A pipeline schedule keeps
  a step's send works until the step ends, so its gradients sent back stayed live in the real world
  and not here (GPipe at 8 stages: 7.6 MiB under real gloo). Here a send's work holds its tensor for
  as long as the work lives, as gloo's does (on NCCL: the longest it can be held).
- OneFlow has no such group: a simulated rank that imports it stops with a message.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from . import received
from .imports import after_import

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

SIMULATE_ENV = "GPUMEM_SIMULATED_RANK"  # "R/W": this process is rank R of a simulated world of W
# Groups made with a CUDA device_id for NCCL: NCCL makes their communicator at once, not at a first
# collective (a fake GPU's device figure counts it)
eager_nccl: list[str] = []


class SimulationError(RuntimeError):
    """What a simulated rank cannot compute; the message says what to do instead."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    def __str__(self) -> str:
        return f"{self.rank}/{self.size}"


def world(env: Any = os.environ) -> World | None:
    """The simulated world this process is a rank of, or None in a real launch."""
    text = env.get(SIMULATE_ENV, "")
    rank, sep, size = text.partition("/")
    if not sep or not rank.isdecimal() or not size.isdecimal():  # isdigit takes "²", which int() refuses
        return None
    return World(int(rank), int(size))


notes: list[str] = []  # what the simulation did that the figure's reader should know, said once each
# What the job asked for that the stand-in did not run, so its memory is missing from the figure (a
# DDP comm hook's buffers): the parent does not gate a figure that reads below nproc=1 because of it.
uncounted: list[str] = []


def _note(text: str, skipped: str = "") -> None:
    if text not in notes:
        notes.append(text)
    if skipped and skipped not in uncounted:
        uncounted.append(skipped)


def install_world(where: World) -> None:
    """Arm the stand-in: now where torch is imported already (a forked rank), else at its import."""
    after_import("torch", lambda torch: _patch_torch(torch, where))
    sys.meta_path.insert(0, _Refuse("oneflow", f"OneFlow cannot run as rank {where.rank} of a simulated world "
                                               f"of {where.size}: it has no stand-in communicator. Launch this "
                                               "size for real (simulate='off') on enough GPUs"))


# ------------------------------------------------------------------------------------ torch


def _patch_torch(torch: ModuleType, where: World) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    helper = c10d._new_process_group_helper  # noqa: SLF001

    def rendezvous(url: str, rank: int = -1, world_size: int = -1, **_: Any) -> Any:
        yield FakeStore(), where.rank, where.size  # no TCP store: the other ranks do not exist

    @functools.wraps(helper)
    def new_group(group_size: int, group_rank: int, global_ranks: Any, backend: Any, store: Any,
                  group_name: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # backend_options, positionally: a real backend's options mean nothing to the fake one
            args = (None, *args[1:])
        kwargs.pop("backend_options", None)
        if "nccl" in str(backend) and getattr(kwargs.get("device_id"), "type", None) == "cuda":
            eager_nccl.append(str(group_name))
        return helper(group_size, group_rank, global_ranks, "fake", store, group_name, *args, **kwargs)

    # Module globals, looked up at each call: callers that imported these names are covered too.
    c10d.rendezvous = rendezvous
    c10d._new_process_group_helper = new_group  # type: ignore[assignment]  # noqa: SLF001
    _patch_ddp(torch)
    _patch_sends(dist, c10d)
    _patch_object_collectives(dist, c10d, where)
    received.follow_received(torch, dist, c10d, where, _note)
    after_import("torch.distributed.pipelining.stage", lambda stage: _patch_pipeline_vote(torch, stage, where))


def _patch_ddp(torch: ModuleType) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    ddp = torch.nn.parallel.DistributedDataParallel
    init, register = ddp.__init__, ddp.register_comm_hook

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        register(self, None, noop_hook)
        self._gpumem_simulated = True

    @functools.wraps(register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if getattr(self, "_gpumem_simulated", False):
            named = getattr(hook, "func", hook)  # a functools.partial: the function it wraps
            name = f"DDP comm hook {getattr(named, '__name__', repr(named))!r}"
            _note(f"{name} not run in the simulated world (its own buffers are not counted)", name)
            return
        register(self, state, hook)

    def builtin_hook(self: Any, comm_hook_type: Any) -> None:
        name = f"DDP built-in comm hook {comm_hook_type}"
        _note(f"{name} not run in the simulated world (its own buffers are not counted)", name)

    ddp.__init__ = __init__
    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = builtin_hook  # noqa: SLF001


def _patch_sends(dist: ModuleType, c10d: ModuleType) -> None:
    """``isend``'s work holds its tensor while it lives, as gloo's does."""
    original = c10d.isend

    @functools.wraps(original)
    def isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(tensor, *args, **kwargs)
        if work is not None:  # None: a rank outside the group, or inside a coalescing manager
            weakref.finalize(work, _held, tensor)
        return work

    for module in (c10d, dist):  # P2POp accepts what c10d's global is
        setattr(module, "isend", isend)


def _held(tensor: Any) -> None:
    """The tensor a send's work held, released with the work."""


def _patch_object_collectives(dist: ModuleType, c10d: ModuleType, where: World) -> None:
    def rank_of(group: Any) -> int:
        return int(dist.get_rank(group)) if group is not None else where.rank

    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        _note("all_gather_object answered with this rank's own object for every rank (ranks taken as alike)")
        object_list[:] = [obj] * len(object_list)

    def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                      group: Any = None, **_: Any) -> None:
        if object_gather_list is not None:
            _note("gather_object answered with this rank's own object for every rank (ranks taken as alike)")
            object_gather_list[:] = [obj] * len(object_gather_list)

    def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                              device: Any = None, **_: Any) -> None:
        if (src or 0) != rank_of(group):
            raise SimulationError(
                f"broadcast_object_list from rank {src or 0} in rank {where.rank} of a simulated world of "
                f"{where.size}: another rank's Python objects do not exist here, and what this rank does "
                "with them could not be measured. Gate the source rank (rank=0), or launch this size for "
                "real (simulate='off')")

    def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: Any = None,
                            src: int | None = None, group: Any = None, **_: Any) -> None:
        if (src or 0) != rank_of(group):
            raise SimulationError(
                f"scatter_object_list from rank {src or 0} in rank {where.rank} of a simulated world of "
                f"{where.size}: another rank's Python objects do not exist here. Launch this size for "
                "real (simulate='off')")
        scatter_object_output_list[0] = scatter_object_input_list[rank_of(group)]

    def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None, *_: Any,
                         **__: Any) -> None:
        raise SimulationError(
            f"recv_object_list from rank {src} in rank {where.rank} of a simulated world of {where.size}: "
            "another rank's Python objects do not exist here. A pipeline stage receives its neighbours' "
            "shapes this way when it was not told them: give every PipelineStage input_args= and "
            f"output_args= ({_GRADS}), or launch this size for real (simulate='off')")

    for name, fn in (("all_gather_object", all_gather_object), ("gather_object", gather_object),
                     ("broadcast_object_list", broadcast_object_list),
                     ("scatter_object_list", scatter_object_list), ("recv_object_list", recv_object_list)):
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


# What a stage's declared shapes must say about gradients, or a stage sends none back and the one before waits.
_GRADS = "requiring grad where one flows back: every output, and every input but the first stage's"


def _patch_pipeline_vote(torch: ModuleType, stage: ModuleType, where: World) -> None:
    """Answer the stages' vote on declared shapes (torch 2.13; 2.11 has none) as every stage voting as this one.

    The vote's tensors come from the neighbours, which do not run: the fake group leaves zeros, read
    as "some stage did not declare", and the stage then waits for shapes nobody sends.
    """
    cls = getattr(stage, "PipelineStage", None)
    mode = getattr(stage, "InferenceMode", None)
    if cls is None or mode is None or not hasattr(cls, "_warmup_forward_vote"):
        return  # an older torch: declared shapes skip the exchange, undeclared ones reach recv_object_list

    def forward_vote(self: Any, has_backward: bool, received_acc: Any = None) -> Any:
        if mode.needs_dynamic(self._user_meta, has_backward):  # noqa: SLF001
            raise SimulationError(
                f"pipeline stage {self.stage_index} in rank {where.rank} of a simulated world of {where.size} "
                "did not declare its tensors' shapes, and its neighbours, which would send them, do not run "
                f"here: give every PipelineStage input_args= and output_args= ({_GRADS}), or launch this "
                "size for real (simulate='off')")
        _note("pipeline stages' shape vote answered as every stage declaring its shapes, as this one does")
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def backward_result(self: Any, received_result: Any = None) -> Any:
        return torch.ones(1, dtype=torch.int32, device=self.device)

    cls._warmup_forward_vote = forward_vote  # noqa: SLF001
    cls._warmup_backward_result = backward_result  # noqa: SLF001


# ------------------------------------------------------------------------------------ OneFlow


class _Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, why: str) -> None:
        self.name, self.why = name, why

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == self.name:
            raise SimulationError(self.why)
        return None
