"""Boxing audit for OneFlow nn.Graph: which SBP conversions the compiled graph performs.

A data-parallel training graph should box only its gradients (``P->B``, the all-reduce before the
update). When SBP inference inserts anything else -- a ``P->S(0)`` reduce-scatter, an ``S(0)->B``
all-gather of the batch -- every rank's memory grows with the world size (LiBai's Swin went
5734 -> 15190 MiB at 8 ranks that way). This module lists those conversions so that a memory
failure can say "new: P->S(0) x1 (was 0)" next to the number.

How the conversions are found
-----------------------------
From the compiled job proto (``graph._compiled_graph_proto``; ``graph._compiled_job_proto`` in
OneFlow 0.8/0.9 -- it is what ``nn.Graph`` parses from ``get_current_job_str()`` after compiling).
Its fields have had the same names and meaning from OneFlow 0.7 to today's master:

* ``net.op``: every op, including the ones the passes insert (``Sys-Boxing-GroupIdentity-*``,
  ``_nccl_logical_*``, optimizer ops);
* ``helper.op_name2arg_signature[op].bn_in_op2lbi``: each blob name of an op -> the logical blob it
  reads or writes (an input is a blob whose ``op_name`` is another op);
* ``job_parallel_view_conf.op_name2nd_sbp_signature_conf[op].bn_in_op2nd_sbp``: the SBP each op
  wants on each input and gives each output;
* ``placement.placement_group``: each op's ``parallel_conf``;
* ``helper.lbn2logical_blob_desc``: logical shape and dtype of each blob.

A conversion is an edge where the consumer wants an input SBP (or placement) other than the one its
producer gives; the runtime inserts a boxing there (P->B is an all-reduce, P->S a reduce-scatter,
S->B an all-gather, S(i)->S(j) an all-to-all). Explicit conversion ops that already sit in the job
(``_nccl_logical_*``, inserted when ``nccl_use_compute_stream`` is on, on GPUs only) have matching
SBPs on their edges, so for them the op's own input SBP -> output SBP is the conversion. Tick and
control ops (no data) are ignored.

Why the proto and not ``print(graph)``: the repr is generated from this same proto
(``oneflow/nn/graph/util.py: operators_repr``), so it carries no more information; it is a
format for people that changed between releases (0.8 writes ``-> (outs):placement=(...)`` and
prints graph inputs/outputs as ``...``; 0.9 writes ``-> (outs), placement=(...)``), it leaves out ops
it does not know how to print, and its placements are wrong in 0.9.0 (``GraphIR.get_op_placement``
reuses its argument as a loop variable, so a parameter on ranks [0, 1] prints as ``ranks=[0]``;
fixed after the release by OneFlow PR #9770). The boxing CSV of ``ONEFLOW_DEBUG_MODE`` would be
the runtime's own list, but it crashed (SIGSEGV) on CPU here and switches the whole process to
debug logging, which changes what is measured.
The repr is kept as a fallback (``audit_repr``) for a OneFlow whose proto lacks these fields: it
sees SBP changes but no placement changes.

Everything here is plain Python; OneFlow is imported only inside functions that run in a rank that
already imported it.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Boxing:
    """One SBP conversion the compiled graph performs."""

    src: str  # the producer's SBP, e.g. "P", "S(0)", "B"; "(P, S(0))" for a 2-D hierarchy
    dst: str  # the SBP the consumer wants
    op: str  # the consuming op, "name (type)"
    tensor: str  # the logical blob, "producer/blob (shape) dtype"
    placement: str = ""  # "cpu:0 -> cpu:0-1" when the placement changes too, else ""
    line: str = ""  # "model.py:25 forward": the user's line that built the consuming op (its ``loc``), or ""

    @property
    def kind(self) -> str:
        """What ``summarize`` counts: ``P->B``, or ``B->B [cpu:0 -> cpu:0-1]`` for a move."""
        base = f"{self.src}->{self.dst}"
        return f"{base} [{self.placement}]" if self.placement else base

    def __str__(self) -> str:
        return f"{self.kind}: {self.tensor} into {self.op}"


# --------------------------------------------------------------------------- rendering

def _sbp_str(sbp: Any) -> str:
    if sbp.HasField("split_parallel"):
        return f"S({sbp.split_parallel.axis})"
    if sbp.HasField("broadcast_parallel"):
        return "B"
    if sbp.HasField("partial_sum_parallel"):
        return "P"
    return "?"


def _nd_sbp_str(nd_sbp: Any) -> str:
    parts = [_sbp_str(s) for s in nd_sbp.sbp_parallel]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _ranges(numbers: Iterable[int]) -> str:
    nums = sorted(set(numbers))
    out: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def _devices(parallel_conf: Any) -> list[tuple[str, int]]:
    """``device_name`` entries ("@0:0", "1:0-3") -> [(machine, device), ...]."""
    out: list[tuple[str, int]] = []
    for name in parallel_conf.device_name:
        machine, _, devs = name.lstrip("@").partition(":")
        first, _, last = devs.partition("-")
        try:
            out.extend((machine, d) for d in range(int(first), int(last or first) + 1))
        except ValueError:
            out.append((machine, -1))
    return out


def _placement_str(parallel_conf: Any) -> str:
    """``cpu:0-1``, ``cuda:0-7``, ``cuda:0-7 (2, 4)``: the ranks (machine ids) it spans, and its hierarchy."""
    devices = _devices(parallel_conf)
    machines = [m for m, _ in devices]
    if len(set(machines)) == len(machines) and all(m.isdigit() for m in machines):
        text = f"{parallel_conf.device_tag}:{_ranges(int(m) for m in machines)}"
    else:  # several devices per process (single-client OneFlow): show them as OneFlow writes them
        text = f"{parallel_conf.device_tag}:{' '.join(parallel_conf.device_name)}"
    dims = list(parallel_conf.hierarchy.dim) if parallel_conf.HasField("hierarchy") else []
    if len(dims) > 1:
        text += " (" + ", ".join(map(str, dims)) + ")"
    return text


def _placement_key(parallel_conf: Any) -> tuple:
    dims = tuple(parallel_conf.hierarchy.dim) if parallel_conf.HasField("hierarchy") else ()
    return (parallel_conf.device_tag, tuple(sorted(_devices(parallel_conf))), dims if len(dims) > 1 else ())


def _dtype_str(data_type: int) -> str:
    try:
        import oneflow

        return str(oneflow.dtype.get(int(data_type))).replace("oneflow.", "")
    except Exception:
        return f"dtype#{data_type}"


def _blob_str(lbn: str, blob_desc: Any) -> str:
    if blob_desc is None:
        return lbn
    dims = list(blob_desc.shape.dim)
    shape = "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
    return f"{lbn} {shape} {_dtype_str(blob_desc.data_type)}"


# --------------------------------------------------------------------------- the proto audit

# Ops that carry only control (ticks, callbacks): their edges move no data.
_CONTROL_CONFS = ("wait_and_send_ids_conf", "callback_notify_conf")


def _is_control(op_conf: Any) -> bool:
    kind = op_conf.WhichOneof("op_type")
    return kind is None or "tick" in kind or kind in _CONTROL_CONFS


def _op_type(op_conf: Any) -> str:
    kind = op_conf.WhichOneof("op_type") or "?"
    if kind == "user_conf":
        return op_conf.user_conf.op_type_name
    return kind[: -len("_conf")] if kind.endswith("_conf") else kind


def _is_conversion_op(op_type: str) -> bool:
    """Ops that are themselves a boxing: their input SBP -> output SBP is the conversion.

    Only the ``_nccl_logical_*`` user ops reach the job; the runtime's own boxing ops
    (``boxing_conf``, ``slice_boxing_*``, ``collective_boxing_*``) exist only in the plan.
    """
    return op_type.startswith("_nccl_logical")


def _bn_key(bn: str) -> tuple:
    """``in_0`` < ``in_1`` < ``in_10``: the order of an argument's tensors."""
    head, _, idx = bn.rpartition("_")
    return (head, int(idx)) if idx.isdigit() else (bn, -1)


_LOC_FRAME = re.compile(r"Python Stack\[(-?\d+)\]: '?([^' ]+)'? at '([^']+)': line (\d+)")


def loc_line(loc: str, root: Path | None = None) -> str:
    """The user's line in an op's ``loc`` (``Python Stack[-2]: 'forward' at '/x/model.py': line 25; ...``,
    what nn.Graph records of the Python stack that built the op), as ``model.py:25 forward``; ""
    when the recorded frames are all OneFlow's (or there are none)."""
    from ..sampling.sites import fold

    frames = sorted(((int(i), fn, file, int(line)) for i, fn, file, line in _LOC_FRAME.findall(loc)), reverse=True)
    if not frames:
        return ""
    site = fold([(fn, file, line) for _, fn, file, line in frames], root)
    return "" if site.internal else f"{site.where} {site.function}"


_INPUT_UID = re.compile(r"_\d+$")  # "_Step_0_input.0.0_2": the trailing id differs between jobs


def graph_inputs(job: Any) -> list[dict[str, Any]]:
    """The graph's inputs as it was compiled: ``{"name": "_Step_0_input.0.0", "sbp": "B", "tensor":
    "(8192, 256) float32", "ranks": 2}`` each (the batch a job broadcast before the call is one)."""
    sigs = job.job_parallel_view_conf.op_name2nd_sbp_signature_conf
    descs = job.helper.lbn2logical_blob_desc
    ranks = {name: len(_devices(g.parallel_conf)) for g in job.placement.placement_group for name in g.op_set.op_name}
    out = []
    for op in job.net.op:
        if op.WhichOneof("op_type") != "input_conf" or op.name not in sigs:
            continue
        bn2sbp = sigs[op.name].bn_in_op2nd_sbp
        if "out" not in bn2sbp:
            continue
        blob = _blob_str(f"{op.name}/out", descs.get(f"{op.name}/out"))
        out.append({"name": _INPUT_UID.sub("", op.name), "sbp": _nd_sbp_str(bn2sbp["out"]),
                    "tensor": blob.split(" ", 1)[1] if " " in blob else "", "ranks": ranks.get(op.name, 1)})
    return out


def _rank_bytes(item: Mapping[str, Any]) -> int | None:
    """Bytes of a graph input on each rank: a split one is shared out, any other held whole."""
    total = tensor_bytes(f"x {item.get('tensor', '')}")
    if total is None:
        return None
    return total // max(1, int(item.get("ranks", 1))) if "S(" in str(item.get("sbp")) else total


def input_lines(size: int, inputs: Sequence[Mapping[str, Any]], ref_size: int,
                reference: Sequence[Mapping[str, Any]]) -> list[str]:
    """Graph inputs that a rank holds more of than at the reference, or with another SBP:
    ``graph input _Step_0_input.0.0 (8192, 256) float32: B, 8.0 MiB a rank at nproc=2 (B, 4.0 MiB at nproc=1)``."""
    before = {item["name"]: item for item in reference}
    lines = []
    for item in inputs:
        old = before.get(item["name"])
        now, then = _rank_bytes(item), _rank_bytes(old) if old is not None else None
        grew = now is not None and then is not None and now - then >= TINY_BYTES
        if old is None or not (grew or old.get("sbp") != item.get("sbp")):
            continue
        lines.append(f"graph input {item['name']} {item['tensor']}: {item['sbp']}, {format_bytes(now)} a rank at "
                     f"nproc={size} ({old.get('sbp')}, {format_bytes(then)} at nproc={ref_size})")
    return lines


def audit_job(job: Any, root: Path | None = None) -> list[Boxing]:
    """Every SBP/placement conversion in a compiled ``Job`` proto (``oneflow.core.job.job_pb2.Job``),
    each with the user's line that built the op it feeds (else the op that produced the tensor)."""
    ops = {op.name: op for op in job.net.op}
    sigs = job.job_parallel_view_conf.op_name2nd_sbp_signature_conf
    args = job.helper.op_name2arg_signature
    descs = job.helper.lbn2logical_blob_desc
    if not ops or not len(sigs) or not len(args):
        raise ValueError("the job proto has no ops, SBP signatures or arg signatures")
    groups = list(job.placement.placement_group)
    group_of: dict[str, int] = {}  # op name -> index of its placement group
    for i, group in enumerate(groups):
        for name in group.op_set.op_name:
            group_of[name] = i
    group_key = [_placement_key(g.parallel_conf) for g in groups]
    group_str = [_placement_str(g.parallel_conf) for g in groups]
    group_single = [len(_devices(g.parallel_conf)) == 1 for g in groups]

    # lbn -> (producer op, output nd_sbp)
    produced: dict[str, tuple[str, Any]] = {}
    for name, op in ops.items():
        if name not in args or name not in sigs:
            continue
        bn2sbp = sigs[name].bn_in_op2nd_sbp
        for bn, lbi in args[name].bn_in_op2lbi.items():
            if lbi.op_name == name and bn in bn2sbp:
                produced[f"{lbi.op_name}/{lbi.blob_name}"] = (name, bn2sbp[bn])

    found: list[Boxing] = []
    seen: set[tuple] = set()
    for name, op in ops.items():
        if _is_control(op) or name not in args or name not in sigs:
            continue
        op_type = _op_type(op)
        op_label = f"{name} ({op_type})"
        bn2sbp = sigs[name].bn_in_op2nd_sbp
        inputs: list[tuple[str, str]] = []
        outputs: list[tuple[str, str]] = []
        for bn, lbi in sorted(args[name].bn_in_op2lbi.items(), key=lambda kv: _bn_key(kv[0])):
            (outputs if lbi.op_name == name else inputs).append((bn, f"{lbi.op_name}/{lbi.blob_name}"))
        for bn, lbn in inputs:
            if lbn not in produced or bn not in bn2sbp:
                continue
            producer, src_sbp = produced[lbn]
            if _is_control(ops[producer]):
                continue
            dst_sbp = bn2sbp[bn]
            src_group, dst_group = group_of.get(producer), group_of.get(name)
            moved = (src_group is not None and dst_group is not None and src_group != dst_group
                     and group_key[src_group] != group_key[dst_group])
            src, dst = _nd_sbp_str(src_sbp), _nd_sbp_str(dst_sbp)
            if src == dst and not moved:
                continue
            if not moved and dst_group is not None and group_single[dst_group]:
                continue  # on one device every SBP is the same data: nothing moves
            where = f"{group_str[src_group]} -> {group_str[dst_group]}" if moved and src_group is not None \
                and dst_group is not None else ""  # moved implies both groups are known
            key = (name, lbn, dst, where)
            if key in seen:  # the same blob read twice by one op is boxed once
                continue
            seen.add(key)
            line = loc_line(op.loc, root) or loc_line(ops[producer].loc, root)
            found.append(Boxing(src, dst, op_label, _blob_str(lbn, descs.get(lbn)), where, line))
        if (_is_conversion_op(op_type) and len(inputs) == len(outputs)
                and not (name in group_of and group_single[group_of[name]])):
            for (ibn, lbn), (obn, _) in zip(inputs, outputs):
                if ibn in bn2sbp and obn in bn2sbp:
                    src, dst = _nd_sbp_str(bn2sbp[ibn]), _nd_sbp_str(bn2sbp[obn])
                    if src != dst:
                        found.append(Boxing(src, dst, op_label, _blob_str(lbn, descs.get(lbn)),
                                            line=loc_line(op.loc, root)))
    return found


# --------------------------------------------------------------------------- the repr fallback

# 0.9: "name(ins) -> (outs), placement=(...)"; 0.8: "name(ins) -> (outs):placement=(...)".
_OP_LINE = re.compile(r"\(OPERATOR: (?P<name>[^\s(]+)\((?P<ins>.*?)\) -> \((?P<outs>.*?)\)(?:,\s*placement=|:placement=|\)$)")  # noqa: E501
_TENSOR = re.compile(
    r"(?P<lbn>[\w.\-/]+):\(?sbp=\((?P<sbp>(?:[^()]|\([^()]*\))*)\), size=\((?P<size>[^)]*)\), dtype=\((?P<dtype>[^)]*)\)\)?"  # noqa: E501
)


def audit_repr(text: str) -> list[Boxing]:
    """The same audit from ``repr(graph)`` after the first call (SBP changes only, no placements).

    Lines look like ``(OPERATOR: name(lbn:(sbp=(S(0)), size=(8, 4), dtype=(oneflow.float32)), ...)
    -> (lbn:(sbp=(P), ...)), placement=(...))``; an output written as a bare blob name (variables,
    identities) belongs to the op itself.
    """
    ops: list[tuple[str, list[tuple[str, str, str]], list[tuple[str, str, str]]]] = []
    for line in text.splitlines():
        m = _OP_LINE.search(line.strip())
        if not m:
            continue
        name = m.group("name")

        def tensors(part: str, own: bool) -> list[tuple[str, str, str]]:
            out = []
            for t in _TENSOR.finditer(part):
                lbn = t.group("lbn")
                if own and "/" not in lbn:
                    lbn = f"{name}/{lbn}"
                sbp = t.group("sbp").replace(" ", "")
                sbp = sbp if "," not in sbp else "(" + sbp.replace(",", ", ") + ")"
                dtype = t.group("dtype").replace("oneflow.", "")
                dims = [d.strip() for d in t.group("size").split(",") if d.strip()]
                shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
                out.append((lbn, sbp, f"{lbn} {shape} {dtype}"))
            return out

        ops.append((name, tensors(m.group("ins"), False), tensors(m.group("outs"), True)))
    if not ops:
        raise ValueError("no operator lines in the graph's repr (not compiled yet?)")
    produced = {lbn: sbp for _, _, outs in ops for lbn, sbp, _ in outs}
    found, seen = [], set()
    for name, ins, _ in ops:
        for lbn, dst, label in ins:
            src = produced.get(lbn)
            if src is None or src == dst or (name, lbn, dst) in seen:
                continue
            seen.add((name, lbn, dst))
            found.append(Boxing(src, dst, name, label))
    return found


# --------------------------------------------------------------------------- public API

def graph_job(graph: Any) -> Any:
    """The compiled job proto of a graph that has run once, or None."""
    for attr in ("_compiled_graph_proto", "_compiled_job_proto"):
        try:
            job = getattr(graph, attr, None)
        except Exception:
            job = None
        if job is not None:
            return job
    return None


def audit_graph(graph: Any, root: Path | None = None) -> list[Boxing]:
    """The conversions of ``graph`` (an ``oneflow.nn.Graph`` after its first call).

    From the compiled job proto; from ``repr(graph)`` when the proto is missing or lacks the fields
    (another OneFlow version). Raises ValueError when neither works (e.g. the graph never ran).
    """
    if getattr(graph, "_is_compiled", True) is False:
        raise ValueError(f"graph {getattr(graph, 'name', '?')} has not run yet: nothing is compiled")
    job = graph_job(graph)
    errors = []
    if job is not None:
        try:
            return audit_job(job, root)
        except Exception as exc:  # a proto of another shape: try the repr
            errors.append(f"proto: {exc!r}")
    try:
        return audit_repr(repr(graph))
    except Exception as exc:
        errors.append(f"repr: {exc!r}")
    raise ValueError("cannot audit the graph's boxing: " + "; ".join(errors))


def summarize(boxings: Iterable[Boxing | Mapping[str, Any]]) -> dict[str, int]:
    """``{"P->B": 3, "P->S(0)": 1}``: conversions counted by kind, keys sorted."""
    counts: Counter[str] = Counter()
    for b in boxings:
        if not isinstance(b, Boxing):
            b = Boxing(**{k: b[k] for k in ("src", "dst", "op", "tensor") if k in b},
                       placement=b.get("placement", ""))
        counts[b.kind] += 1
    return dict(sorted(counts.items()))


def diff(old: Mapping[str, int], new: Mapping[str, int]) -> list[str]:
    """Human lines, the likely culprits first.

    Kinds that are new, then kinds that grew (each group by the number added, largest first),
    then kinds that shrank, then kinds that are gone:
    ``["new: P->S(0) x2 (was 0)", "more: P->B x6 (was 4)", "gone: S(0)->B (was x1)"]``.
    Empty when the counts are equal.
    """
    new_kinds, more, fewer, gone = [], [], [], []
    for kind in set(old) | set(new):
        a, b = int(old.get(kind, 0)), int(new.get(kind, 0))
        if a == b:
            continue
        if a == 0:
            new_kinds.append((a - b, kind, f"new: {kind} x{b} (was 0)"))
        elif b == 0:
            gone.append((b - a, kind, f"gone: {kind} (was x{a})"))
        elif b > a:
            more.append((a - b, kind, f"more: {kind} x{b} (was {a})"))
        else:
            fewer.append((b - a, kind, f"fewer: {kind} x{b} (was {a})"))
    return [line for group in (new_kinds, more, fewer, gone) for _, _, line in sorted(group)]


# ``to_global`` calls on lazy tensors while a graph compiles, as (src, dst, logical shape, line): the
# eager audit's wrapper appends them (oneflow/eager.py). OneFlow's passes fold the cast op such a call
# builds into its consumer's input SBP, and with it the line; this list gives the line back.
LAZY_CASTS: list[tuple[str, str, tuple[int, ...], str]] = []


def _shape_of(tensor: str) -> tuple[int, ...] | None:
    m = _SHAPE_DTYPE.search(tensor)
    return tuple(int(d) for d in m.group(1).split(",") if d.strip()) if m else None


def with_cast_lines(found: Sequence[Boxing], casts: Sequence[tuple[str, str, tuple[int, ...], str]]) -> list[Boxing]:
    """The conversions, each that a ``to_global`` in the graph asked for (same SBPs and shape) given
    that call's line."""
    lines = {(src, dst, shape): line for src, dst, shape, line in casts}
    return [replace(b, line=lines.get((b.src, b.dst, _shape_of(b.tensor) or ()), b.line)) for b in found]


def graph_record(graph: Any, root: Path | None = None,
                 casts: Sequence[tuple[str, str, tuple[int, ...], str]] = ()) -> dict[str, Any]:
    """``{"graph": name, "boxings": [...]}`` or, when the audit fails, ``{"graph": name, "error": ...}``."""
    name = str(getattr(graph, "name", None) or type(graph).__name__)
    try:
        record: dict[str, Any] = {"graph": name,
                                  "boxings": [asdict(b) for b in with_cast_lines(audit_graph(graph, root), casts)]}
        job = graph_job(graph)
        if job is not None:
            record["inputs"] = graph_inputs(job)
        return record
    except Exception as exc:
        return {"graph": name, "error": f"{type(exc).__name__}: {exc}"}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a rank's hook wrote (none when the file is missing); broken lines are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def summarize_records(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """``summarize`` over every graph of a rank's records."""
    return summarize(b for r in records for b in r.get("boxings", []))


TINY_BYTES = 64 * 1024  # placement-only moves below this (LR scalars, step counters) are folded

# Bytes per element of the dtypes OneFlow prints ("float32", "int64", ...).
_DTYPE_BYTES = {
    "bool": 1, "int8": 1, "uint8": 1, "char": 1, "float16": 2, "half": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "float": 4, "int32": 4, "int": 4, "uint32": 4, "float64": 8, "double": 8,
    "int64": 8, "long": 8, "uint64": 8, "complex64": 8, "complex128": 16,
}
_SHAPE_DTYPE = re.compile(r"\(([\d,\s]*)\)\s+(\w+)\s*$")


def tensor_bytes(tensor: str) -> int | None:
    """Logical bytes of ``"name (2048, 16384) float32"``; None when shape or dtype is unknown."""
    m = _SHAPE_DTYPE.search(tensor)
    if not m or m.group(2) not in _DTYPE_BYTES:
        return None
    count = 1
    for dim in (d.strip() for d in m.group(1).split(",")):
        if dim:
            count *= int(dim)
    return count * _DTYPE_BYTES[m.group(2)]


def format_bytes(count: int | None) -> str:
    if count is None:
        return "size n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _as_boxing(b: Boxing | Mapping[str, Any]) -> Boxing:
    if isinstance(b, Boxing):
        return b
    return Boxing(**{k: b[k] for k in ("src", "dst", "op", "tensor")}, placement=b.get("placement", ""),
                  line=b.get("line", ""))


def _tiny_move(b: Boxing) -> bool:
    """A placement change of a tiny tensor with no SBP change: an LR scalar going to every rank."""
    size = tensor_bytes(b.tensor)
    return bool(b.placement) and b.src == b.dst and size is not None and size < TINY_BYTES


def _biggest_first(items: list[Boxing]) -> list[Boxing]:
    return sorted(items, key=lambda b: -(tensor_bytes(b.tensor) or -1))


def explain(old: Mapping[str, int], boxings: Iterable[Boxing | Mapping[str, Any]], limit: int = 3) -> list[str]:
    """``diff(old, summarize(boxings))`` with the biggest "why" first, what to print under a failure::

        new: S(0)->B x2 (was 0); 128.0 MiB moved
          128.0 MiB  _TrainGraph_1_input.0.0_2/out (2048, 16384) float32 into hierarchical_parallel_cast-0 (...)
          16.0 KiB  _TrainGraph_1_input.0.1_3/out (2048,) int64 into hierarchical_parallel_cast-1 (...)
        gone: P->B (was x6)
        also 1 placement-only move of tiny tensors (< 64 KiB): B->B [cpu:0 -> cpu:0-1] x1 (was 0)

    New kinds, then grown kinds, each group ordered by the bytes its conversions move (shape x
    dtype of the logical tensor), each kind followed by up to ``limit`` of its conversions, largest
    first; then the kinds that shrank or went. New or grown kinds made only of placement moves of
    tiny tensors are folded into one line at the end.
    """
    found = [_as_boxing(b) for b in boxings]
    by_kind: dict[str, list[Boxing]] = {}
    for b in found:
        by_kind.setdefault(b.kind, []).append(b)
    groups: dict[str, list[tuple[int, list[str]]]] = {"new": [], "more": [], "rest": []}
    folded: list[str] = []
    folded_count = 0
    for line in diff(old, summarize(found)):
        kind = line.split(": ", 1)[1].rsplit(" x", 1)[0]
        if not line.startswith(("new:", "more:")):
            groups["rest"].append((0, [line]))
            continue
        same = _biggest_first(by_kind.get(kind, []))
        if same and all(_tiny_move(b) for b in same):
            folded.append(line.split(": ", 1)[1])
            folded_count += len(same) - int(old.get(kind, 0))
            continue
        sizes = [tensor_bytes(b.tensor) for b in same]
        total = sum(s for s in sizes if s is not None)
        head = line + (f"; {format_bytes(total)} moved" if any(s is not None for s in sizes) else "")
        block = [head] + [f"  {format_bytes(tensor_bytes(b.tensor))}  {b.line + ': ' if b.line else ''}{b.tensor} "
                          f"into {b.op}" for b in same[:limit]]
        if len(same) > limit:
            block.append(f"  ... and {len(same) - limit} more")
        groups["new" if line.startswith("new:") else "more"].append((total, block))
    lines = []
    for name in ("new", "more", "rest"):
        for _, block in sorted(groups[name], key=lambda item: -item[0]):  # stable: diff's order on ties
            lines.extend(block)
    if folded:
        moves = "move" if folded_count == 1 else "moves"
        lines.append(f"also {folded_count} placement-only {moves} of tiny tensors (< {format_bytes(TINY_BYTES)}): "
                     + ", ".join(folded))
    return lines


# ---------------------------------------------------------- baseline provenance (flat strings)

PROVENANCE_PREFIX = "boxing."
_GRAPHS_KEY = PROVENANCE_PREFIX + "graphs"
_ERROR_KEY = PROVENANCE_PREFIX + "error"


def rank_provenance(path: Path) -> dict[str, str]:
    """A rank's audit as flat provenance entries, for the baseline next to the framework versions.

    ``{"boxing.graphs": "2", "boxing.P->B": "8", "boxing.P->S(0)": "2"}``; ``boxing.error`` names a
    graph whose audit failed. Empty when the rank compiled no nn.Graph (the file is absent), so
    tests without graphs keep the provenance they had.
    """
    records = read_records(path)
    if not records:
        return {}
    prov = {_GRAPHS_KEY: str(len(records))}
    prov.update({PROVENANCE_PREFIX + k: str(v) for k, v in summarize_records(records).items()})
    errors = [f"{r.get('graph')}: {r['error']}" for r in records if "error" in r]
    if errors:
        prov[_ERROR_KEY] = "; ".join(errors)[:500]
    return prov


def from_provenance(provenance: Mapping[str, str]) -> dict[str, int] | None:
    """The summary stored by ``rank_provenance``; None when that run audited no graph."""
    if _GRAPHS_KEY not in provenance:
        return None
    out = {}
    for key, value in provenance.items():
        if key.startswith(PROVENANCE_PREFIX) and key not in (_GRAPHS_KEY, _ERROR_KEY):
            try:
                out[key[len(PROVENANCE_PREFIX):]] = int(value)
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------- the hook inside a rank

_HOOK_FLAG = "_gpumem_boxing_hook"


STACK_DEPTH = 8  # frames nn.Graph keeps in each op's ``loc`` while it compiles (OneFlow's default: 2)


def _deeper_stacks(flow: Any) -> Any:
    """Let the ops a graph builds record enough frames to reach the user's line past OneFlow's own
    modules (``nn.Sequential`` -> ``nn.Linear`` -> the op); returns the undo."""
    internal = flow._oneflow_internal
    before = internal.GetGraphDebugMaxPyStackDepth()
    internal.SetGraphDebugMaxPyStackDepth(max(before, STACK_DEPTH))
    return lambda: internal.SetGraphDebugMaxPyStackDepth(before)


def _patch(flow: Any, out_path: Path, root: Path | None = None) -> None:
    graph_cls = flow.nn.Graph
    if getattr(graph_cls.__call__, _HOOK_FLAG, False):
        return
    original = graph_cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get(_HOOK_FLAG):  # after the first call: one dict lookup, nothing else
            return original(self, *args, **kwargs)
        try:
            undo = _deeper_stacks(flow)
        except Exception:  # another OneFlow: the lines stay as deep as it records them
            undo = None
        LAZY_CASTS.clear()
        try:
            result = original(self, *args, **kwargs)
        finally:
            if undo is not None:
                undo()
        self.__dict__[_HOOK_FLAG] = True
        try:
            record = graph_record(self, root, list(LAZY_CASTS))
            with open(out_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except Exception:  # the audit must never change the test's outcome
            pass
        return result

    functools.update_wrapper(__call__, original)  # keeps the docstring; __wrapped__ = the original
    setattr(__call__, _HOOK_FLAG, True)
    graph_cls.__call__ = __call__


def install_graph_hook(out_path: Path, root: Path | None = None) -> None:
    """In a rank: after each nn.Graph's first call, append its audit to ``out_path`` (JSON lines).

    Costs nothing and writes nothing when the rank never imports OneFlow: if it is already
    imported the hook is set now, otherwise when ``oneflow.nn.graph`` is first imported (a
    meta-path finder that steps aside at once). After a graph's first call the wrapper is one
    dict lookup. A failed audit is recorded as ``{"graph": ..., "error": ...}``; it never raises.
    """
    out_path = Path(out_path)
    flow = sys.modules.get("oneflow")
    if flow is not None and hasattr(getattr(flow, "nn", None), "Graph"):
        _patch(flow, out_path, root)
    else:
        sys.meta_path.insert(0, _GraphImportWatcher(out_path, root))


class _GraphImportWatcher:
    """A meta-path finder that waits for ``import oneflow``, lets the real finder load it, and wraps
    ``oneflow.nn.Graph.__call__`` right after the package's ``__init__`` ran. It removes itself at
    that import; until then it costs one string comparison per new import."""

    def __init__(self, out_path: Path, root: Path | None = None) -> None:
        self.out_path, self.root = out_path, root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "oneflow":
            return None
        import importlib.util

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the finders after us
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_original, out_path, root = spec.loader.exec_module, self.out_path, self.root

        def exec_module(module: Any) -> None:
            exec_original(module)
            try:
                _patch(module, out_path, root)
            except Exception:  # an unexpected OneFlow: no audit, but the import stands
                pass

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


def expected_in_data_parallel(kind: str) -> bool:
    """``P->B``, ``P->S(0)``: a partial sum made whole or scattered, as data parallelism does with its
    gradients at any size above one; not news against one rank."""
    src, _, dst = kind.partition("->")
    return src == "P" and (dst == "B" or (dst.startswith("S(") and dst.endswith(")") and "[" not in dst))


def _against(size: int, baseline: Mapping[str, str] | None,
             smaller: Sequence[tuple[int, Sequence[Boxing | Mapping[str, Any]]]]) -> tuple[dict[str, int], str, bool]:
    """What a size's audit is compared with: the baseline's audit, else the smallest launched size's;
    and whether that is a smaller size (data parallelism's own conversions are then expected)."""
    old = from_provenance(baseline) if baseline is not None else None
    if old is not None:
        return old, "against the baseline", False
    if smaller:
        n, first = min(smaller, key=lambda pair: pair[0])
        return summarize(first), f"against nproc={n} (no audited baseline)", True
    return {}, "(no audited baseline to compare)", True


def _news(boxings: Sequence[Boxing | Mapping[str, Any]], old: Mapping[str, int], scaling: bool) -> list[Boxing]:
    """Against a smaller size, what any size above it does is no news: data parallelism's P->B and
    P->S, and a tiny tensor (a learning rate) sent from one rank to all."""
    found = [_as_boxing(b) for b in boxings]
    if not scaling:
        return found
    return [b for b in found if not (expected_in_data_parallel(b.kind) and not old.get(b.kind)) and not _tiny_move(b)]


def headlines(size: int, boxings: Sequence[Boxing | Mapping[str, Any]], baseline: Mapping[str, str] | None,
              smaller: Sequence[tuple[int, Sequence[Boxing | Mapping[str, Any]]]]) -> list[str]:
    """One line per new or grown kind and line, largest first, in the shape the eager audit writes:
    ``S(0)->B at model.py:25 forward: 32.0 MiB moved at nproc=2 (new against nproc=1)``."""
    old, against, scaling = _against(size, baseline, smaller)
    found = _news(boxings, old, scaling)
    counts = summarize(found)
    grown = {kind for kind, n in counts.items() if n > int(old.get(kind, 0))}
    best: dict[tuple[str, str], Boxing] = {}
    for b in found:
        if b.kind not in grown or _tiny_move(b):
            continue
        key = (b.kind, b.line or b.op)
        if key not in best or (tensor_bytes(b.tensor) or -1) > (tensor_bytes(best[key].tensor) or -1):
            best[key] = b
    ranked = sorted(best.values(), key=lambda b: -(tensor_bytes(b.tensor) or -1))
    return [f"{b.kind} at {b.line or b.op}: {format_bytes(tensor_bytes(b.tensor))} moved at nproc={size} "
            f"(nn.Graph, new {against.split(' (')[0]})" for b in ranked]


def failure_lines(size: int, boxings: Sequence[Boxing | Mapping[str, Any]], baseline: Mapping[str, str] | None,
                  smaller: Sequence[tuple[int, Sequence[Boxing | Mapping[str, Any]]]]) -> list[str]:
    """A failure's nn.Graph section for the audited size: its new or grown conversions against the
    baseline's audit (its provenance), else against the smallest launched size's (one rank: none),
    where data parallelism's P->B and P->S are expected, not new."""
    old, against, scaling = _against(size, baseline, smaller)
    found = explain(old, _news(boxings, old, scaling))
    if not found:
        return [f"  nn.Graph boxing (SBP conversions) at nproc={size} {against}: "
                "no new or grown conversions; the memory came from elsewhere"]
    return [f"  nn.Graph boxing (SBP conversions) at nproc={size} {against}:", *(f"    {line}" for line in found)]
