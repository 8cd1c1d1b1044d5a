"""Boxing audit for OneFlow eager global tensors: which SBP conversion, on which line, how much.

In eager global mode a conversion is run by the op that needs it, and the memory it takes is
allocated later, on OneFlow's VM threads, where no Python stack exists: a failure could only say
"native code". The conversions themselves are decided on the calling thread, though, so they are
recorded there, each with the Python line that issued it:

* ``Tensor.to_global`` on a global tensor (the conversions a job writes) is wrapped: from -> to SBP,
  placement, shape and dtype are read off the tensors;
* the conversions SBP inference inserts inside an op are OneFlow's own record: its eager boxing
  logger (``oneflow/core/boxing/eager_boxing_logger.cpp``) writes route, logical shape and SBP and
  placement change of every eager boxing to glog's INFO file, synchronously, when OneFlow was in
  debug mode at the moment its library was loaded. ``ONEFLOW_DEBUG_MODE`` is therefore set for the
  ``dlopen`` of ``oneflow._oneflow_internal`` only (the logger is chosen by a static initializer) and
  removed at once, so nothing else runs in debug mode (its extra consistency checks communicate, and
  the full mode crashed at exit on CPU). A line tracer notes the line that runs (the caller's again
  when a frame returns); a boxing that appears in the file between two events belongs to that line.

What is not seen: the dtype of an inferred conversion is read from the tensors in the issuing
frames (``size n/a`` where none matches); a job that sets ``GLOG_logtostderr=1`` or
``GLOG_minloglevel`` above 0 itself, or runs its own tracer (a debugger, coverage), keeps only
its ``to_global`` conversions; ops run from threads other than the main one are not traced.

Records are plain dicts (``Conversion.as_dict``), one list a rank, written at its exit.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..sampling.sites import fold, is_internal
from .boxing import _DTYPE_BYTES, LAZY_CASTS, TINY_BYTES, _ranges, expected_in_data_parallel, format_bytes


@dataclass(frozen=True)
class Conversion:
    """One eager SBP conversion, summed over the times one line ran it."""

    src: str  # "S(0)", "B", "P"; "(S(0), B)" for a 2-D hierarchy
    dst: str
    line: str  # "examples/model.py:25 forward": the user's line that issued the op
    shape: tuple[int, ...]  # logical shape
    dtype: str = ""  # "float32"; "" when not known
    placement: str = ""  # "cpu:0-1", or "cpu:0 -> cpu:0-1" when it changes
    world: int = 1  # ranks in the (output) placement
    how: str = "inferred"  # "to_global" (written by the job) or "inferred" (inside an op)
    count: int = 1

    @property
    def kind(self) -> str:
        """``S(0)->B``; ``B->B [cpu:0 -> cpu:0-1]`` for a move between placements."""
        base = f"{self.src}->{self.dst}"
        return f"{base} [{self.placement}]" if "->" in self.placement else base

    @property
    def key(self) -> tuple[str, str, str]:
        """What a comparison matches on: the kind and the line (shapes grow with the world size)."""
        return (self.kind, self.line, self.how)

    @property
    def logical_bytes(self) -> int | None:
        if self.dtype not in _DTYPE_BYTES:
            return None
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _DTYPE_BYTES[self.dtype]

    def added_bytes(self) -> int | None:
        """Bytes each rank holds more after the conversion than before it (0 for P->B; negative
        for B->S): S(0)->B of a 128 MiB tensor on 2 ranks adds 64 MiB a rank, on 1 rank nothing."""
        total = self.logical_bytes
        if total is None:
            return None
        src_world, _, dst_world = _worlds(self.placement, self.world)
        return _local(total, self.dst, dst_world) - _local(total, self.src, src_world)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Conversion":
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        fields["shape"] = tuple(int(d) for d in raw.get("shape", ()))
        return cls(**fields)

    def describe(self) -> str:
        """``to_global of (2048, 16384) float32, x3``."""
        dims = ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "")
        what = f"({dims}) {self.dtype}".rstrip()
        return f"{self.how} of {what}, x{self.count}"


def _worlds(placement: str, world: int) -> tuple[int, str, int]:
    """Ranks before and after: ``cpu:0 -> cpu:0-1`` is (1, ..., 2)."""
    if "->" not in placement:
        return world, placement, world
    before, after = (p.strip() for p in placement.split("->", 1))
    return _count(before) or world, after, _count(after) or world


def _count(placement: str) -> int:
    ranks = placement.partition(":")[2]
    total = 0
    for part in filter(None, ranks.split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit():
            return 0
        total += int(last or first) - int(first) + 1
    return total


def _local(total: int, sbp: str, world: int) -> int:
    """Bytes one rank holds of a tensor of ``total`` logical bytes (1-D SBP; a 2-D one is split once)."""
    return total // world if "S(" in sbp and world > 0 else total


# --------------------------------------------------------------------------- OneFlow's log lines

_LOG = re.compile(r"eager_boxing_logger\.cpp:\d+\] (?P<what>Boxing route|Logical shape|Altered state of sbp|"
                  r"Altered state of placement): (?P<value>.*)$")
_PLACEMENT = re.compile(r'oneflow\.placement\(type="(?P<type>\w+)", ranks=\[(?P<ranks>[\d,\s\[\]]*)\]'
                        r'(?:, hierarchy=\((?P<dims>[\d,\s]*)\))?\)')


def placement_str(text: str) -> str:
    """``oneflow.placement(type="cpu", ranks=[0, 1])`` -> ``cpu:0-1``; unknown text as it is."""
    m = _PLACEMENT.search(text)
    if not m:
        return text.strip()
    ranks = [int(r) for r in re.findall(r"\d+", m.group("ranks"))]
    return f"{m.group('type')}:{_ranges(ranks)}"


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", text))


def parse_log(text: str) -> list[tuple[str, str, tuple[int, ...], str, str]]:
    """The boxings in glog lines of OneFlow's eager boxing logger, in order:
    ``(src, dst, logical shape, placement before, placement after)``; a boxing that changes neither
    SBP nor placement (a rank of one) is left out."""
    found = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        m = _LOG.search(line)
        if not m:
            continue
        what, value = m.group("what"), m.group("value").strip()
        if what == "Boxing route":
            current = {}
        current[what] = value
        if what != "Altered state of placement" or "Altered state of sbp" not in current:
            continue
        sbps = [s.strip() for s in current["Altered state of sbp"].split(" -> ")]
        places = [placement_str(p) for p in value.split(" -> ")]
        src, dst = _sbp(sbps[0]), _sbp(sbps[-1])
        if src != dst or places[0] != places[-1]:
            found.append((src, dst, _shape(current.get("Logical shape", "")), places[0], places[-1]))
        current = {}
    return found


def _sbp(text: str) -> str:
    """``(S(0))`` -> ``S(0)``, ``(S(0), B)`` kept as it is."""
    inner = text.strip()
    if inner.startswith("(") and inner.endswith(")") and inner.count("(") == inner.count(")") and "," not in inner:
        inner = inner[1:-1]
    return inner.replace(" ", "").replace(",", ", ") if "," in inner else inner


def _sbp_of(tensor: Any) -> str:
    parts = []
    for sbp in tensor.sbp:
        text = str(sbp).replace("oneflow.sbp.", "")
        m = re.match(r"split\(dim=(\d+)\)|split\((?:axis=)?(\d+)\)", text)
        if m:
            parts.append(f"S({m.group(1) or m.group(2)})")
        else:
            parts.append({"broadcast": "B", "partial_sum": "P"}.get(text, text))
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _placement_of(tensor: Any) -> str:
    return placement_str(repr(tensor.placement))


def _dtype_of(tensor: Any) -> str:
    return str(tensor.dtype).replace("oneflow.", "")


# --------------------------------------------------------------------------- the recorder in a rank

def _frames(frame: Any, line: int | None = None) -> list[tuple[str, str, int]]:
    """Innermost first; ``line``: the innermost frame's line when it was noted (it has run on since)."""
    out = []
    if frame is not None and line is not None:
        out.append((frame.f_code.co_name, frame.f_code.co_filename, line))
        frame = frame.f_back
    while frame is not None:
        out.append((frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return out


class Recorder:
    """Collects a rank's conversions: the ``to_global`` wrapper and the line tracer feed it."""

    def __init__(self, out_path: Path, root: Path | None) -> None:
        self.out_path, self.root = Path(out_path), root
        self.found: dict[Conversion, int] = {}  # a conversion with count 1 -> times seen
        self.log_fd: int | None = None
        self.log_pos = 0
        self.pending = ""
        self.last: Any = None  # the frame of the last line event, and its line then
        self.last_line: int | None = None
        self.problem = ""

    # ---- the log file

    def open_log(self, log_dir: str) -> None:
        """Follow this process's glog INFO file from its current end."""
        names = sorted(glob.glob(os.path.join(log_dir, "*", f"*.INFO.*.{os.getpid()}")))
        if not names:
            self.problem = "OneFlow's INFO log was not found: conversions inside ops are not seen"
            return
        self.log_fd = os.open(names[-1], os.O_RDONLY)
        self.log_pos = os.fstat(self.log_fd).st_size

    def drain(self) -> list[tuple[str, str, tuple[int, ...], str, str]]:
        """The boxings logged since the last call."""
        if self.log_fd is None or os.fstat(self.log_fd).st_size == self.log_pos:
            return []
        data = os.pread(self.log_fd, 1 << 20, self.log_pos)
        self.log_pos += len(data)
        text = self.pending + data.decode(errors="replace")
        complete, _, self.pending = text.rpartition("\n")
        return parse_log(complete)

    # ---- recording

    def add(self, conversion: Conversion) -> None:
        self.found[conversion] = self.found.get(conversion, 0) + 1

    def line_of(self, frame: Any, line: int | None = None) -> str:
        site = fold(_frames(frame, line), self.root)
        return f"{site.where} {site.function}"

    def add_logged(self, logged: Iterable[tuple[str, str, tuple[int, ...], str, str]], frame: Any, how: str,
                   line: int | None = None) -> None:
        for src, dst, shape, before, after in logged:
            placement = after if before == after else f"{before} -> {after}"
            self.add(Conversion(src, dst, self.line_of(frame, line), shape, _dtype_near(frame, shape),
                                placement, _count(after) or 1, how))

    def records(self) -> list[dict[str, Any]]:
        return [replace(c, count=n).as_dict() for c, n in self.found.items()]

    def write(self) -> None:
        try:
            self.add_logged(self.drain(), self.last, "inferred", self.last_line)
        except Exception:
            pass
        data = {"conversions": self.records(), "problem": self.problem}
        tmp = self.out_path.with_name(self.out_path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out_path)

    # ---- starting, once OneFlow is imported

    def start(self, flow: Any) -> None:
        """Wrap ``to_global``; follow OneFlow's INFO log and trace lines where the logger writes there."""
        wrap_to_global(flow, self)
        if os.environ.get("GLOG_logtostderr") == "1" or os.environ.get("GLOG_minloglevel", "0") != "0":
            self.problem = "GLOG_logtostderr or GLOG_minloglevel is set: conversions inside ops are not seen"
            return
        self.open_log(_log_dir())
        if self.log_fd is None:
            return
        if sys.gettrace() is not None:
            self.problem = "another tracer runs: conversions inside ops are not given a line"
        else:
            sys.settrace(self.trace)

    # ---- the line tracer

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        """The global trace function: frames of the user's code and of OneFlow's Python are traced."""
        if event != "call":
            return None
        if _skipped(frame.f_code.co_filename):
            return None
        return self.local

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if self.log_fd is not None and os.fstat(self.log_fd).st_size != self.log_pos and self.last is not None:
            try:
                self.add_logged(self.drain(), self.last, "inferred", self.last_line)
            except Exception:
                pass
        if event == "line":
            self.last, self.last_line = frame, frame.f_lineno
        elif event == "return" and frame.f_back is not None:  # the caller's line runs on: note it now
            self.last, self.last_line = frame.f_back, frame.f_back.f_lineno
        return self.local


_SKIPPED_NAMES = ("/_pytest/", "/pluggy/", "/pytest/", "/pytest_gpumem/", "/memray/", "/importlib/")


def _skipped(filename: str) -> bool:
    """Frames the tracer ignores: the standard library, pytest, this plugin (not the user's, not OneFlow's)."""
    if filename.startswith("<") or any(n in filename for n in _SKIPPED_NAMES):
        return True
    return "/oneflow/" not in filename and is_internal(filename) and "site-packages" not in filename


def _dtype_near(frame: Any, shape: tuple[int, ...]) -> str:
    """The dtype of a global tensor of that logical shape in the issuing frames' locals, or ""."""
    depth = 0
    while frame is not None and depth < 6:
        for value in list(frame.f_locals.values()):
            # a module's own parameters and buffers too: ``flow.matmul(x, self.w)``
            inner = [*getattr(value, "_parameters", {}).values(), *getattr(value, "_buffers", {}).values()]
            for candidate in (value, *inner):
                try:
                    if getattr(candidate, "is_global", False) and tuple(candidate.shape) == shape:
                        return _dtype_of(candidate)
                except Exception:
                    continue
        frame, depth = frame.f_back, depth + 1
    return ""


# --------------------------------------------------------------------------- installing it

_FLAG = "_gpumem_eager_boxing"
_DEBUG_VARS = ("ONEFLOW_DEBUG_MODE", "ONEFLOW_DEBUG")
recorder: Recorder | None = None


def wrap_to_global(flow: Any, rec: Recorder) -> None:
    """Record each ``Tensor.to_global`` between global tensors (an installer: it patches OneFlow)."""
    original = flow.Tensor.to_global
    if getattr(original, _FLAG, False):
        return

    def to_global(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            if getattr(self, "is_lazy", False):  # a graph compiling: its audit takes the line
                LAZY_CASTS.append((_sbp_of(self), _sbp_of(result), tuple(self.shape), rec.line_of(sys._getframe(1))))
            elif self.is_global:
                rec.drain()  # the logger's own lines for this call: the tensors say more
                src, dst = _sbp_of(self), _sbp_of(result)
                before, after = _placement_of(self), _placement_of(result)
                if src != dst or before != after:
                    placement = after if before == after else f"{before} -> {after}"
                    rec.add(Conversion(src, dst, rec.line_of(sys._getframe(1)), tuple(self.shape),
                                       _dtype_of(self), placement, _count(after) or 1, "to_global"))
        except Exception:  # the audit never changes the job
            pass
        return result

    setattr(to_global, _FLAG, True)
    to_global.__doc__ = original.__doc__
    flow.Tensor.to_global = to_global


def _log_dir() -> str:
    """Where OneFlow's glog writes (``InitLogging``: ``$GLOG_log_dir/<hostname>``)."""
    return os.environ.get("GLOG_log_dir") or os.path.join(os.getcwd(), "log")


def install_eager_hook(out_path: Path, root: Path | None = None, log_dir: Path | None = None) -> None:
    """In a rank, before OneFlow is imported: record its eager conversions, written by ``write_records``.

    Sets glog to write INFO lines to files (``GLOG_logtostderr=0``, ``GLOG_minloglevel=0``, in
    ``log_dir`` unless the job chose a folder) unless the job set them itself. Costs nothing in a
    rank that never imports OneFlow; nothing is done where OneFlow is already imported.
    """
    global recorder
    if "oneflow" in sys.modules or recorder is not None:
        return
    recorder = Recorder(out_path, root)
    if log_dir is not None and "GLOG_log_dir" not in os.environ:
        os.environ["GLOG_log_dir"] = str(log_dir)
    os.environ.setdefault("GLOG_logtostderr", "0")
    os.environ.setdefault("GLOG_minloglevel", "0")
    sys.meta_path.insert(0, _ImportWatcher(recorder))


def write_records() -> None:
    """At the rank's exit: the conversions seen, as JSON (nothing when OneFlow was never imported)."""
    if recorder is not None and "oneflow" in sys.modules:
        sys.settrace(None)
        recorder.write()


class _ImportWatcher:
    """Loads ``oneflow._oneflow_internal`` with debug mode on (the boxing logger is chosen then), and
    starts the recorder once ``oneflow`` has run its ``__init__``. Removes itself after both."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in ("oneflow", "oneflow._oneflow_internal"):
            return None
        import importlib.util

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)  # the finders after this one
        finally:
            if fullname == "oneflow":  # back for the library, which the package's __init__ imports
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        if fullname == "oneflow":
            spec.loader.exec_module = self._then_start(spec.loader.exec_module)  # type: ignore[method-assign]
        elif hasattr(spec.loader, "create_module"):
            spec.loader.create_module = _in_debug_mode(spec.loader.create_module)  # type: ignore[method-assign]
        return spec

    def _then_start(self, exec_original: Any) -> Any:
        rec = self.rec

        def exec_module(module: Any) -> None:
            exec_original(module)
            try:
                rec.start(module)
            except Exception as exc:  # an unexpected OneFlow: no audit, but the import stands
                rec.problem = f"the eager audit did not start: {exc!r}"

        return exec_module


def _in_debug_mode(create: Any) -> Any:
    """``create_module`` (the ``dlopen``) with ``ONEFLOW_DEBUG_MODE=1``, unless the job set a debug
    variable itself: only the static initializers, among them the boxing logger's, see it."""
    def create_module(spec: Any) -> Any:
        if any(v in os.environ for v in _DEBUG_VARS):
            return create(spec)
        os.environ[_DEBUG_VARS[0]] = "1"
        try:
            return create(spec)
        finally:
            os.environ.pop(_DEBUG_VARS[0], None)

    return create_module


# --------------------------------------------------------------------------- reading and comparing

def read(path: Path) -> tuple[list[Conversion], str]:
    """A rank's conversions and the reason some are not seen ("" when all are); none when absent."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return [], ""
    return [Conversion.from_dict(c) for c in data.get("conversions", [])], str(data.get("problem", ""))


PROVENANCE_PREFIX = "eager_boxing."  # a baseline's provenance keys of the eager audit
_PROVENANCE_KEY = re.compile(r"^(?P<kind>.+) \((?P<how>to_global|inferred)\)$")


def eager_provenance(path: Path) -> dict[str, str]:
    """A rank's eager conversions counted by kind, as flat provenance for the baseline:
    ``{"eager_boxing.S(0)->B (to_global)": "3"}`` (no lines: a line that moves is no news); empty
    when the rank recorded none."""
    found, _ = read(path)
    counts: dict[str, int] = {}
    for c in found:
        key = f"{PROVENANCE_PREFIX}{c.kind} ({c.how})"
        counts[key] = counts.get(key, 0) + c.count
    return {key: str(n) for key, n in sorted(counts.items())}


def stored_counts(provenance: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """``{(kind, how): count}`` as ``eager_provenance`` stored it; empty for a baseline without it."""
    out = {}
    for key, value in provenance.items():
        m = _PROVENANCE_KEY.match(key[len(PROVENANCE_PREFIX):]) if key.startswith(PROVENANCE_PREFIX) else None
        if m and value.isdigit():
            out[(m["kind"], m["how"])] = int(value)
    return out


def by_key(conversions: Iterable[Conversion]) -> dict[tuple[str, str, str], Conversion]:
    """One conversion per key (kind, line, how), counts summed, the largest shape kept."""
    out: dict[tuple[str, str, str], Conversion] = {}
    for c in conversions:
        old = out.get(c.key)
        if old is None:
            out[c.key] = c
            continue
        big = c if (c.added_bytes() or 0) > (old.added_bytes() or 0) else old
        out[c.key] = replace(big, count=old.count + c.count)
    return out


def _tiny(c: Conversion) -> bool:
    """Under :data:`TINY_BYTES` whatever its dtype (8 bytes an element where unknown): a learning rate
    sent to every rank, a loss made partial. Never what inflated a rank."""
    count = 1
    for dim in c.shape:
        count *= dim
    return (c.logical_bytes if c.logical_bytes is not None else 8 * count) < TINY_BYTES


def _figure(c: Conversion | None, size: int) -> str:
    if c is None:
        return f"not at nproc={size}"
    added = c.added_bytes()
    if added is None:
        return f"size n/a at nproc={size}"
    return f"none at nproc={size}" if added <= 0 else f"+{format_bytes(added)} at nproc={size}"


def compare(found: Sequence[Conversion], size: int, reference: Sequence[Conversion], ref_size: int) -> list[str]:
    """The conversions at ``size`` that are news against another size's, the most memory a rank
    gains first::

        S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); to_global of (2048, 16384) float32, x3

    Listed: a conversion (kind and line) the reference lacks, or one that gains a rank more memory
    than it did there. Not listed against a smaller size: data parallelism's P->B and P->S. Nor
    conversions of tiny tensors (a learning rate sent from rank 0 to every rank).
    """
    before = by_key(reference)
    listed: list[tuple[int, str]] = []
    for key, c in by_key(found).items():
        old = before.get(key)
        added = c.added_bytes()
        if ref_size < size and expected_in_data_parallel(c.kind):
            continue
        if (old is not None and (added or 0) <= (old.added_bytes() or 0)) or _tiny(c):
            continue
        listed.append((added if added is not None else -1,
                       f"{c.kind} at {c.line}: {_figure(c, size)} ({_figure(old, ref_size)}); {c.describe()}"))
    return [line for _, line in sorted(listed, key=lambda item: -item[0])]


def against_baseline(found: Sequence[Conversion], size: int, stored: Mapping[tuple[str, str], int]) -> list[str]:
    """The conversions of a kind the baseline's audit did not have, or had fewer of, largest first:
    ``S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (S(0)->B x0 in the baseline); ...``."""
    counts: dict[tuple[str, str], int] = {}
    for c in found:
        counts[(c.kind, c.how)] = counts.get((c.kind, c.how), 0) + c.count
    grown = {key for key, n in counts.items() if n > stored.get(key, 0)}
    listed = [c for c in by_key(found).values() if (c.kind, c.how) in grown and not _tiny(c)]
    listed.sort(key=lambda c: -(c.added_bytes() or -1))
    return [f"{c.kind} at {c.line}: {_figure(c, size)} ({c.kind} {c.how} x{stored.get((c.kind, c.how), 0)} in the "
            f"baseline, x{counts[(c.kind, c.how)]} now); {c.describe()}" for c in listed]


def news(size: int, found: Sequence[Conversion], smaller: Sequence[tuple[int, Sequence[Conversion]]],
         baseline: Mapping[str, str] | None = None) -> tuple[str, list[str]] | None:
    """What ``size``'s conversions are compared with (the baseline's audit where it stored one, else
    the smallest launched size's) and the news against it; None when there is nothing to compare."""
    stored = stored_counts(baseline) if baseline is not None else {}
    if stored:
        return "the baseline", against_baseline(found, size, stored)
    if not smaller:
        return None
    ref_size, reference = min(smaller, key=lambda pair: pair[0])
    return f"nproc={ref_size}", compare(found, size, reference, ref_size)


def scaling_lines(size: int, found: Sequence[Conversion], smaller: Sequence[tuple[int, Sequence[Conversion]]],
                  problem: str = "", baseline: Mapping[str, str] | None = None) -> list[str]:
    """A failure's eager section for ``size``: its news against the baseline's audit, else against
    the smallest launched size."""
    compared = news(size, found, smaller, baseline)
    if compared is None:
        return []
    against, lines = compared
    head = f"  eager boxing (SBP conversions) at nproc={size} against {against}"
    lines = [f"{head}:", *(f"    {line}" for line in lines)] if lines else [
        f"{head}: no new conversions, none that holds more memory a rank"]
    if problem:
        lines.append(f"    ({problem})")
    return lines
