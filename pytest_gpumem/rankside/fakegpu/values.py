"""Values a fake tensor does not have: the known ones carried beside it, the rest supplied by a policy.

A fake CUDA tensor has a shape and no data. Many of a job's small CUDA tensors have values all the
same: a batch copied from the CPU, ``torch.arange(n, device="cuda")``, a mask filled with -100, the
routing of an MoE layer. Those are kept as a real CPU tensor beside the fake one (a *shadow*, up to
``SHADOW_LIMIT`` elements), and an op whose fake inputs all have one computes its own shadow on the
CPU. So ``.item()``, ``.tolist()``, ``nonzero`` or a boolean mask over such tensors read what the GPU
would read, and a size that depends on them is exact.

What no shadow can know is supplied under a stated policy, and every time it is, the op and the
job's line are recorded (``supplied``), so that the report says what the figure assumed:

- a value read from a CUDA tensor whose values depend on the model's weights or data (a loss, a
  gradient norm, GradScaler's ``found_inf``) reads **0** (False): no inf found, no early stop;
- a copy of such a tensor to the CPU is zeros;
- routing: ``topk``/``argmax``/``max`` indices over computed scores are **balanced**: row ``t`` (the
  scores' rows in order) picks ``(t*k + j) mod E`` for its ``j``-th of ``k`` choices among ``E``, so
  each expert receives its share of the tokens; ``sort``/``argsort`` keep the order;
- a size that depends on values no shadow has (a boolean mask of computed scores) takes the upper
  bound: the mask all True.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

SHADOW_LIMIT = 1 << 22  # elements of an integer or boolean tensor (indices, masks, labels, counts) kept
FLOAT_SHADOW_LIMIT = 1 << 16  # of a floating one (a mask, a scale): a model's weights stay without values
HERE = str(Path(__file__).resolve().parent.parent.parent)  # the package: not the job's line
INTERNALS = (f"{os.sep}torch{os.sep}", f"{os.sep}torch_xla{os.sep}", "<frozen ", "<string>")


class Supplied:
    """What the fake GPU supplied, counted by (what, the job's line)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.counts[(what, job_line())] += 1

    def lines(self) -> list[str]:
        """One line each, in the order first seen: ``what at file.py:12 fn (x3)``."""
        return [f"{what} at {site}" + (f" (x{n})" if n > 1 else "") for (what, site), n in self.counts.items()]


def job_line() -> str:
    """The innermost frame outside torch and this package: the line of the job (or of the library
    it calls, e.g. a transformers model) that asked for the value."""
    frame: Any = sys._getframe(2)  # noqa: SLF001
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(HERE) and not any(part in name for part in INTERNALS):
            return f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


def balanced_indices(torch: ModuleType, shape: tuple[int, ...], k: int, choices: int, dim: int) -> Any:
    """The routing the policy assumes: along ``dim`` of ``k`` slots, row t's j-th choice is
    ``(t*k + j) mod choices``, the rows being every other index of ``shape`` in order."""
    moved = list(shape)
    moved.append(moved.pop(dim))
    rows = 1
    for size in moved[:-1]:
        rows *= size
    flat = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % max(choices, 1)
    return flat.reshape(moved).movedim(-1, dim).contiguous()


class Shadows:
    """The known values of fake CUDA tensors, held beside them while they live."""

    def __init__(self, torch: ModuleType, fake_type: Any, supplied: Supplied) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.torch = torch
        self.fake_type = fake_type
        self.known: Any = WeakIdKeyDictionary()
        self.supplied = supplied

    def of(self, tensor: Any) -> Any:
        return self.known.get(tensor) if isinstance(tensor, self.fake_type) else None

    def fits(self, shape: Any, dtype: Any) -> bool:
        """Whether a tensor of this shape and dtype keeps its values beside it."""
        numel = 1
        for size in shape:
            numel *= int(size)
        return numel <= (FLOAT_SHADOW_LIMIT if dtype.is_floating_point or dtype.is_complex else SHADOW_LIMIT)

    def keep(self, fake: Any, real: Any) -> None:
        if (isinstance(fake, self.fake_type) and isinstance(real, self.torch.Tensor)
                and not isinstance(real, self.fake_type) and tuple(real.shape) == tuple(fake.shape)
                and real.dtype == fake.dtype and self.fits(real.shape, real.dtype)):
            self.known[fake] = real
        else:
            self.forget(fake)

    def forget(self, tensor: Any) -> None:
        if isinstance(tensor, self.fake_type):
            self.known.pop(tensor, None)

    def real(self, value: Any, stand_in: Callable[[Any], Any] | None = None) -> Any:
        """``value`` with each fake tensor replaced by its shadow (or ``stand_in(fake)``; None when a
        fake tensor has neither)."""
        from torch.utils._pytree import tree_map

        missing = []

        def swap(leaf: Any) -> Any:
            if isinstance(leaf, self.fake_type):
                found = self.known.get(leaf)
                if found is None and stand_in is not None:
                    found = stand_in(leaf)
                if found is None:
                    missing.append(leaf)
                return found
            if isinstance(leaf, self.torch.device) and leaf.type == "cuda":
                return self.torch.device("cpu")
            return leaf

        out = tree_map(swap, value)
        return None if missing else out

    def stand_in(self, fake: Any) -> Any:
        """A CPU tensor of a fake one's shape and dtype that costs no memory: True for a mask (the
        upper bound of what it selects), zero otherwise."""
        torch = self.torch
        fill = True if fake.dtype == torch.bool else 0
        return torch.full((), fill, dtype=fake.dtype).expand(fake.shape)


class ValuePolicy:
    """Runs one op on fake CUDA tensors with the values the policy knows or supplies (see the module)."""

    def __init__(self, torch: ModuleType, fake_type: Any, data_dependent: type[Exception],
                 fake_call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any], supplied: Supplied) -> None:
        self.torch = torch
        self.fake_call = fake_call  # runs an op in the fake mode (counted)
        self.shadows = Shadows(torch, fake_type, supplied)
        self.fake_type = fake_type
        self.data_dependent = data_dependent  # what the fake mode raises for an op that needs values
        aten = torch.ops.aten
        self.scalar_reads = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
        self.routing = {aten.topk.default: "topk", aten.argmax.default: "argmax", aten.argmin.default: "argmin",
                        aten.max.dim: "max", aten.min.dim: "min", aten.sort.default: "sort",
                        aten.sort.stable: "sort", aten.argsort.default: "sort", aten.argsort.stable: "sort"}
        self.fills = {aten.fill_.Scalar, aten.zero_.default}
        self.empties = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                        aten.new_empty.default, aten.new_empty_strided.default}

    @property
    def supplied(self) -> Supplied:
        return self.shadows.supplied

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        torch = self.torch
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves((args, kwargs))
        fakes = [leaf for leaf in leaves if isinstance(leaf, self.fake_type)]
        if func in self.scalar_reads:
            return self._scalar(func, args, kwargs, fakes)
        if func is torch.ops.aten._to_copy.default and fakes and _to_cpu(torch, kwargs):
            return self._to_host(func, args, kwargs)
        if func is torch.ops.aten.copy_.default and fakes and not isinstance(args[0], self.fake_type):
            return self._copy_to_host(args)
        if func is torch.ops.aten.index.Tensor and _masks(torch, args[1], self.fake_type):
            return self._masked_index(args)
        try:
            out = self.fake_call(func, args, kwargs)
        except self.data_dependent:
            return self._sized_by_values(func, args, kwargs, fakes)
        self._follow(func, args, kwargs, fakes, out)
        return out

    # -- what an op's outputs hold -----------------------------------------------------------------

    def _follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fakes: list[Any], out: Any) -> None:
        """The shadows of ``out``: computed from the inputs' where all have one, from the policy for
        routing, else none (an op that writes into a tensor forgets what it held)."""
        torch, shadows = self.torch, self.shadows
        from torch.utils._pytree import tree_leaves

        outs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, self.fake_type)]
        if func in self.empties:  # values undefined, as on the GPU: zeros, so that what is written into
            for fake in outs:      # its views (a collective's output) is known in the whole tensor too
                if shadows.fits(fake.shape, fake.dtype):
                    shadows.keep(fake, torch.zeros(tuple(fake.shape), dtype=fake.dtype))
            return
        if not outs:  # an op that writes into its arguments and returns nothing (a fused step)
            if any(shadows.of(leaf) is not None for leaf in fakes):
                self._forget_written(func, args)
            return
        if func in self.routing and fakes and shadows.of(fakes[0]) is None:
            self._route(func, args, kwargs, out)
            return
        if func in self.fills and shadows.of(args[0]) is None and shadows.fits(args[0].shape, args[0].dtype):
            value = args[1] if len(args) > 1 else 0
            shadows.keep(args[0], torch.full(tuple(args[0].shape), value, dtype=args[0].dtype))
            return
        if not all(shadows.fits(o.shape, o.dtype) for o in outs):
            self._forget_written(func, args)
            return
        if func is torch.ops.aten.copy_.default:  # what the destination held does not matter
            source = args[1] if not isinstance(args[1], self.fake_type) else shadows.of(args[1])
            held = shadows.of(args[0])
            if source is None:
                shadows.forget(args[0])
            elif held is not None:
                held.copy_(source)  # in place: a view's shadow writes through to its base's
            else:
                shadows.keep(args[0], source.to(args[0].dtype).expand(args[0].shape).clone())
            return
        real_args = shadows.real(args)
        real_kwargs = shadows.real(kwargs)
        if real_args is None or real_kwargs is None:
            self._forget_written(func, args)
            return
        try:
            if torch.Tag.nondeterministic_seeded in func.tags:
                with torch.random.fork_rng(devices=[]):  # the job's own CPU random stream stays its own
                    real_out = func(*real_args, **real_kwargs)
            else:
                real_out = func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - a kernel the CPU lacks: the values stay unknown
            self._forget_written(func, args)
            return
        for fake, real in zip(outs, [r for r in tree_leaves(real_out) if isinstance(r, torch.Tensor)]):
            shadows.keep(fake, real)

    def _forget_written(self, func: Any, args: tuple[Any, ...]) -> None:
        """An op that writes into tensors whose new values are unknown: what they held is forgotten."""
        from torch.utils._pytree import tree_leaves

        for argument, value in zip(func._schema.arguments, args):  # noqa: SLF001
            if argument.alias_info is not None and argument.alias_info.is_write:
                for leaf in tree_leaves(value):
                    self.shadows.forget(leaf)

    def _route(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        torch = self.torch
        what = self.routing[func]
        scores = args[0]
        if what == "topk":
            k = int(args[1])
            dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
        elif what == "sort":
            k, dim = 0, int(args[1]) if len(args) > 1 and isinstance(args[1], int) else int(kwargs.get("dim", -1))
        else:
            if (len(args) < 2 or args[1] is None) and kwargs.get("dim") is None:
                return  # over the whole tensor: one index, read as 0 if read
            k, dim = 1, int(args[1] if len(args) > 1 else kwargs["dim"])
        dim = dim % max(scores.dim(), 1)
        choices = int(scores.shape[dim]) if scores.dim() else 1
        indices = out if what in ("argmax", "argmin") else out[1] if isinstance(out, (tuple, list)) else out
        if what == "sort":
            real = torch.arange(choices).reshape([-1 if d == dim else 1 for d in range(scores.dim())])
            real = real.expand(tuple(scores.shape)).contiguous()
            self.supplied.add(f"{func.__name__.split('.')[0]} order (kept as it was)")
        else:
            shape = list(indices.shape)
            reduced = len(shape) < scores.dim()  # max(dim=-1) without keepdim: the routed dim is gone
            if reduced:
                shape.insert(dim, 1)
            real = balanced_indices(torch, tuple(shape), k if what == "topk" else 1, choices, dim)
            real = real.squeeze(dim) if reduced else real
            self.supplied.add(f"routing: {what} over {choices} balanced (row t picks (t*k+j) mod {choices})")
        if indices.dtype != real.dtype:
            real = real.to(indices.dtype)
        self.shadows.keep(indices, real)

    # -- values read ----------------------------------------------------------------------------------

    def _scalar(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fakes: list[Any]) -> Any:
        real_args = self.shadows.real(args)
        if real_args is not None:
            return func(*real_args, **(self.shadows.real(kwargs) or {}))
        if func is self.torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            value: Any = False if dtype == self.torch.bool else 0.0 if dtype.is_floating_point else 0
        else:
            value = False
        self.supplied.add(f"value: {_op(func)} read {value!r}")
        return value

    def _to_host(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        torch = self.torch
        source = args[0]
        known = self.shadows.of(source)
        cpu_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
        if known is not None:
            return func(known, **cpu_kwargs)
        self.supplied.add(f"value: {_op(func)} to the CPU read zeros")
        return torch.zeros(tuple(source.shape), dtype=kwargs.get("dtype") or source.dtype)

    def _copy_to_host(self, args: tuple[Any, ...]) -> Any:
        destination, source = args[0], args[1]
        known = self.shadows.of(source)
        if known is None:
            self.supplied.add("value: copy_ to the CPU read zeros")
            return destination.zero_()
        return destination.copy_(known)

    # -- sizes that depend on values ---------------------------------------------------------------------

    def _sized_by_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fakes: list[Any]) -> Any:
        """An op whose output size depends on values: computed on the CPU from the inputs' shadows, or
        from stand-ins (masks all True, zeros) and said so; its outputs are fake CUDA tensors of that size."""
        torch = self.torch
        shadows = self.shadows
        real_args, real_kwargs = shadows.real(args), shadows.real(kwargs)
        if real_args is None or real_kwargs is None:
            real_args = shadows.real(args, shadows.stand_in)
            real_kwargs = shadows.real(kwargs, shadows.stand_in)
            self.supplied.add(f"size: {_op(func)} of values unknown, a mask taken as all True (upper bound)")
        real_out = func(*real_args, **real_kwargs)
        device = next(f.device for f in fakes)

        def fake_of(real: Any) -> Any:
            if not isinstance(real, torch.Tensor):
                return real
            fake = self.fake_call(torch.ops.aten.empty_strided.default, (tuple(real.shape), tuple(real.stride())),
                                  {"dtype": real.dtype, "device": device})
            shadows.keep(fake, real)
            return fake

        from torch.utils._pytree import tree_map

        return tree_map(fake_of, real_out)

    def _masked_index(self, args: tuple[Any, ...]) -> Any:
        """``x[mask]``: the mask's True positions (``nonzero``, through the policy), then a gather of
        those rows on the fake GPU, as the CUDA kernel does it."""
        torch = self.torch
        indices: list[Any] = []
        for index in args[1]:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                found = self.run(torch.ops.aten.nonzero.default, (index,), {})
                indices.extend(self.run(torch.ops.aten.unbind.int, (found, 1), {}))
            else:
                indices.append(index)
        return self.run(torch.ops.aten.index.Tensor, (args[0], indices), {})


def _op(func: Any) -> str:
    return str(func).replace("aten.", "", 1).split(".")[0]


def _to_cpu(torch: ModuleType, kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _masks(torch: ModuleType, indices: Any, fake_type: Any) -> bool:
    return any(isinstance(i, fake_type) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
