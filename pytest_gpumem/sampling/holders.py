"""What keeps the memory alive at a rank's peak: the object and the line that stored it.

A site names the line that allocated a tensor, which is often not the line a user must change:
``logits = model(x)`` allocates, ``kept.append(logits.detach())`` keeps. So near the peak the rank
walks what its code can reach (the locals of every frame of its threads that is the user's, and the
globals of the user's modules), a few containers deep (lists, tuples, dicts, sets, an object's
attributes), and names, for each large storage it finds, the variable and the line that stored into
it: ``list 'kept' stored at train.py:63 (append)``. Storages held by autograd for backward are named
by the node that saved them, an optimizer's by its states (``AdamW's state (exp_avg, exp_avg_sq)``), and
FSDP2's unsharded parameters kept after forward by the setting that keeps them
(``reshard_after_forward=False``).

A walk costs what the job's live objects cost to visit (a few milliseconds for a training loop, a
fraction of a second for a large model): it is taken as the peak grows by a step, within a share of
the job's time (:class:`PeakWatch`), and the one nearest the peak is kept.

Plain Python over plain objects; the tensor's storage key is the caller's (``key_of``), so the walk
is tested on any object.
"""

from __future__ import annotations

import ast
import inspect
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from .sites import is_internal, short_path

DEPTH = 3  # containers below a variable: kept[i], self.cache[k][j]
MAX_VISITS = 50_000  # objects visited in one walk, at most
STEP = 1.01  # a new walk once the peak is this much above the last walk's
SHARE = 0.10  # of the job's time, at most, spent walking, beyond ALLOWANCE_S
ALLOWANCE_S = 1.0  # walking time any job may spend (a short job's peak is walked to as a long one's)
STORING = ("append", "extend", "insert", "add", "update", "setdefault", "appendleft", "put")
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type)


@dataclass(frozen=True)
class Holder:
    """One variable that keeps storages alive: ``list 'kept'`` stored at ``train.py:63``."""

    what: str  # "list 'kept'", "attribute 'self.cache'", "saved for backward by MmBackward0"
    where: str = ""  # the line that stored into it (file:line), when found
    how: str = ""  # the statement's kind there: append, setitem, assign, ...
    framework: bool = False  # held by a framework's own object (autograd, FSDP), not the user's

    def label(self) -> str:
        """``train.py:63 (list 'kept', append)``; ``saved for backward by MmBackward0`` where no line stored it."""
        if not self.where:
            return self.what
        return f"{self.where} ({self.what}{', ' + self.how if self.how else ''})"


def walk(keys: set[int], key_of: Callable[[Any], int | None], root: Any = None,
         frames: Mapping[int, Any] | None = None, modules: Mapping[str, Any] | None = None) -> dict[int, Holder]:
    """``{storage key: holder}`` for the storages in ``keys`` that the user's code reaches, the
    innermost frame's variable first (``frames``: ``sys._current_frames()``; ``modules``:
    ``sys.modules``; ``root``: the rootdir, for short paths)."""
    found: dict[int, Holder] = {}
    reach = _Reach(key_of)
    fsdp: dict[int, Any] = {}  # FSDP2 modules the user's variables name: their own holdings
    optimizers: dict[int, Any] = {}  # optimizers they name: their states
    for kind, name, value, context in _roots(frames, modules):
        try:
            if hasattr(value, "_get_fsdp_state"):
                fsdp[id(value)] = value
            if isinstance(getattr(value, "state", None), Mapping) and hasattr(value, "param_groups"):
                optimizers[id(value)] = value
            for tensor in reach.tensors(value):
                key = key_of(tensor)
                if key is not None and key in keys and key not in found:
                    found[key] = _holder(kind, name, value, context, root, key_of)
        except Exception:  # noqa: BLE001 - an object whose attributes raise (transformers' placeholders for
            continue       # a missing library raise ImportError): it holds nothing this walk can name
    for key, holder in _fsdp_unsharded(keys - set(found), key_of, fsdp.values()).items():
        found.setdefault(key, holder)
    for key, holder in _optimizer_states(keys - set(found), key_of, optimizers.values()).items():
        found.setdefault(key, holder)
    for key, holder in _saved_for_backward(keys - set(found), key_of, reach.graphs).items():
        found.setdefault(key, holder)
    return found


def _optimizer_states(keys: set[int], key_of: Callable[[Any], int | None], optimizers: Any) -> dict[int, Holder]:
    """The storages of ``keys`` that an optimizer keeps per parameter, named by the optimizer and its
    states' names: ``AdamW's state (exp_avg, exp_avg_sq)``."""
    found: dict[int, Holder] = {}
    for optimizer in optimizers:
        mine: list[int] = []
        names: set[str] = set()
        for per_param in list(optimizer.state.values()):
            for name, value in list(per_param.items()) if isinstance(per_param, Mapping) else ():
                key = key_of(value)
                if key is not None and key in keys:
                    mine.append(key)
                    names.add(str(name))
        holder = Holder(f"{type(optimizer).__name__}'s state ({', '.join(sorted(names))})", framework=True)
        found.update((key, holder) for key in mine if key not in found)
    return found


def _fsdp_unsharded(keys: set[int], key_of: Callable[[Any], int | None], models: Any) -> dict[int, Holder]:
    """The storages of ``keys`` that FSDP2 keeps unsharded after forward, named by the setting that keeps
    them (``reshard_after_forward=False``, the root's default) and the modules it is set on."""
    kept: dict[int, str] = {}  # storage key -> the module's name ("" for the root)
    for model in models:
        for module in model.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None  # noqa: SLF001
            for group in getattr(state, "_fsdp_param_groups", None) or ():
                if getattr(group, "post_forward_mesh_info", True) is not None:
                    continue  # resharded after forward: not kept
                for param in group.fsdp_params:
                    for tensor in [getattr(param, "_unsharded_param", None), *getattr(param, "all_gather_outputs", ())]:
                        key = key_of(tensor) if tensor is not None else None
                        if key is not None and key in keys:
                            kept.setdefault(key, getattr(group, "_module_fqn", ""))
    names = sorted({name or "the root" for name in kept.values()})
    shown = ", ".join(f"'{n}'" if n != "the root" else n for n in names[:3]) + (", ..." if len(names) > 3 else "")
    why = Holder(f"FSDP2's unsharded parameters kept after forward (reshard_after_forward=False on {shown})",
                 framework=True)
    return {key: why for key in kept}


def _roots(frames: Mapping[int, Any] | None, modules: Mapping[str, Any] | None) -> Iterator[tuple[str, str, Any, Any]]:
    """``(kind, name, value, frame or module)``: the user's frames' locals, innermost first, then the
    user's modules' globals; a user object's attributes each as a root of its own (``self.cache``)."""
    def named(kind: str, name: str, value: Any, context: Any) -> Iterator[tuple[str, str, Any, Any]]:
        try:
            attributes = getattr(value, "__dict__", None) if _is_users(value) else None
        except Exception:  # noqa: BLE001 - an object whose attributes raise: taken whole
            attributes = None
        if isinstance(attributes, dict):
            for attr, child in list(attributes.items()):
                yield kind, f"{name}.{attr}", child, context
        else:
            yield kind, name, value, context

    for top in (frames if frames is not None else sys._current_frames()).values():  # noqa: SLF001
        frame = top
        while frame is not None:
            if not is_internal(frame.f_code.co_filename):
                for name, value in _locals(frame):
                    yield from named("local", name, value, frame)
            frame = frame.f_back
    for module in list((modules if modules is not None else sys.modules).values()):
        filename = getattr(module, "__file__", None) or ""
        if filename and not is_internal(filename):
            for name, value in list(vars(module).items()):
                if not name.startswith("__") and not inspect.ismodule(value):
                    yield from named("global", name, value, module)


def _locals(frame: Any) -> list[tuple[str, Any]]:
    """A frame's locals, leaving no copy behind: before Python 3.13 ``f_locals`` of a function's frame
    is a snapshot stored on the frame, which kept a tensor the function had since dropped alive (a
    peak 1 GiB above the GPU's on a job that rebinds its activations)."""
    names = list(frame.f_locals.items())
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        frame.f_locals.clear()  # rebuilt whole at the next read: nothing of the user's is lost
    return names


def _is_users(value: Any) -> bool:
    """An instance of a class defined in the user's code (not a container, not a framework's)."""
    if isinstance(value, _LEAVES) or inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
        return False
    module = sys.modules.get(type(value).__module__)
    filename = getattr(module, "__file__", None) or ""
    return bool(filename) and not is_internal(filename)


class _Reach:
    """One walk's visits: each object once, :data:`MAX_VISITS` at most; the tensors met that carry an
    autograd graph are kept (``graphs``) for the saved tensors' walk."""

    def __init__(self, key_of: Callable[[Any], int | None]) -> None:
        self.key_of = key_of
        self.seen: set[int] = set()
        self.graphs: list[Any] = []

    def tensors(self, value: Any, depth: int = 0) -> Iterator[Any]:
        """The tensors ``value`` holds (itself included), :data:`DEPTH` containers deep."""
        if isinstance(value, _LEAVES) or id(value) in self.seen or len(self.seen) >= MAX_VISITS:
            return
        self.seen.add(id(value))
        if self.key_of(value) is not None:
            if getattr(value, "grad_fn", None) is not None:
                self.graphs.append(value)
            yield value
            return
        if depth >= DEPTH:
            return
        if isinstance(value, Mapping):
            children: Any = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
            children = list(value)
        elif _is_users(value) and isinstance(getattr(value, "__dict__", None), dict):
            children = list(vars(value).values())
        else:
            return  # a framework's object (a module, an optimizer) holds its own memory, not the user's holding
        for child in children:
            yield from self.tensors(child, depth + 1)


def _holder(kind: str, name: str, value: Any, context: Any, root: Any,
            key_of: Callable[[Any], int | None]) -> Holder:
    dotted = "." in name
    if key_of(value) is not None:
        what = f"{'attribute' if dotted else kind} '{name}'"
    else:
        what = f"{'global ' if kind == 'global' else ''}{type(value).__name__} '{name}'"
    code = getattr(context, "f_code", None)
    line, how, filename = 0, "", ""
    if code is not None:
        (line, how), filename = _storing_line(code, name), code.co_filename
    if not line and dotted and code is not None:  # self.cache.append(...) in another method of self's class
        owner = dict(_locals(context)).get(name.split(".", 1)[0])
        if owner is not None:
            try:
                inside = "self." + name.split(".", 1)[1]  # as the class's methods name it
                (line, how), filename = _storing_line(type(owner), inside), inspect.getsourcefile(type(owner)) or ""
            except TypeError:
                line = 0
    where = f"{short_path(filename, root)}:{line}" if line else ""
    return Holder(what, where, how)


def _storing_line(source: Any, name: str) -> tuple[int, str]:
    """The line in ``source`` (a code object or a class) that stores into ``name`` (``name.append(...)``,
    ``name[k] = ...``, ``name += ...``; ``name`` may be dotted: ``self.cache``), else the line that binds
    it; ``(0, "")`` when the source is not at hand."""
    try:
        lines, first = inspect.getsourcelines(source)
        text = "".join(lines)
        tree = ast.parse(text if not text[:1].isspace() else "if 1:\n" + text)
        first -= 1 if text[:1].isspace() else 0  # the "if 1:" line
    except (OSError, TypeError, SyntaxError):
        return 0, ""
    binds: list[int] = []
    for node in ast.walk(tree):
        line = first + getattr(node, "lineno", 1) - 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORING \
                and _dotted(node.func.value) == name:
            return line, node.func.attr
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) and _dotted(t.value) == name
                                                for t in node.targets):
            return line, "setitem"
        if isinstance(node, ast.AugAssign) and _dotted(node.target) == name:
            return line, "+="
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(_dotted(t) == name for t in targets):
            binds.append(line)
    return (min(binds), "assign") if binds else (0, "")


def _dotted(node: Any) -> str:
    """``self.cache`` for the expression ``self.cache``; ``""`` for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _saved_for_backward(keys: set[int], key_of: Callable[[Any], int | None], tensors: list[Any]) -> dict[int, Holder]:
    """The storages of ``keys`` that autograd keeps for backward, from the graphs of the tensors the
    walk met: each named by the node that saved it. What a node holds is read as packed
    (``_raw_saved_*``), never unpacked: unpacking runs the saved-tensor hooks, and activation
    checkpointing's recomputed the forward there (BERT under FSDP1: its flat parameters' state broken)."""
    found: dict[int, Holder] = {}
    if not keys:
        return found
    stack = [t.grad_fn for t in tensors]
    seen: set[int] = set()
    while stack and len(seen) < MAX_VISITS:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in dir(node):
            if not attr.startswith("_raw_saved_"):
                continue
            try:
                raw = getattr(node, attr)
            except Exception:  # noqa: BLE001 - freed by an earlier backward
                continue
            for packed in raw if isinstance(raw, (tuple, list)) else (raw,):
                tensor = getattr(packed, "data", None)  # what the node holds: the tensor, or a hook's object
                key = key_of(tensor)
                if key is not None and key in keys:
                    found.setdefault(key, Holder(f"saved for backward by {node.name()}", framework=True))
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return found


class PeakWatch:
    """Walks as a rank's live bytes reach new peaks: each time they pass the last walk's by
    :data:`STEP`, within :data:`SHARE` of the time since the watch began; the holders of the walk
    nearest the peak are the rank's."""

    def __init__(self, min_bytes: int, live: Callable[[], Mapping[int, int]], key_of: Callable[[Any], int | None],
                 root: Any = None) -> None:
        self.min_bytes = min_bytes  # storages smaller than this are not looked for
        self.live = live  # {storage key: bytes} of the storages live now
        self.key_of = key_of
        self.root = root
        self.holders: dict[int, Holder] = {}
        self.walked_at = 0  # the live bytes at the last walk
        self.walks = 0
        self.spent_s = 0.0
        self._began = time.perf_counter()
        self._busy = False

    def grew(self, current: int) -> None:
        """The live bytes rose to ``current``, a new peak."""
        if self._busy or current < self.walked_at * STEP:
            return
        if self.spent_s > ALLOWANCE_S + SHARE * (time.perf_counter() - self._began):
            return
        self._busy = True
        started = time.perf_counter()
        try:
            keys = {key for key, size in self.live().items() if size >= self.min_bytes}
            self.holders = walk(keys, self.key_of, self.root)
            self.walked_at = current
            self.walks += 1
        finally:
            self.spent_s += time.perf_counter() - started
            self._busy = False
