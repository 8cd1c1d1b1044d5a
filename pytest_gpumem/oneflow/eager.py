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

Records are plain dicts (``Conversion.as_dict``), one list a rank, written at its exit; reading
and comparing them is ``oneflow/conversions.py``'s.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from ..sampling.sites import fold, is_internal
from .boxing import LAZY_CASTS
from .conversions import Conversion, _count, parse_log, placement_str

# --------------------------------------------------------------------------- the tensors

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

    When OneFlow is imported, sets glog to write INFO lines to files (``GLOG_logtostderr=0``,
    ``GLOG_minloglevel=0``, in ``log_dir`` unless the job chose a folder) unless the job set them
    itself. Costs nothing in a rank that never imports OneFlow; nothing is done where OneFlow is
    already imported.
    """
    global recorder
    if "oneflow" in sys.modules or recorder is not None:
        return
    recorder = Recorder(out_path, root)
    sys.meta_path.insert(0, _ImportWatcher(recorder, log_dir))


def write_records() -> None:
    """At the rank's exit: the conversions seen, as JSON (nothing when OneFlow was never imported)."""
    if recorder is not None and "oneflow" in sys.modules:
        sys.settrace(None)
        recorder.write()


class _ImportWatcher:
    """Loads ``oneflow._oneflow_internal`` with debug mode on (the boxing logger is chosen then), and
    starts the recorder once ``oneflow`` has run its ``__init__``. Removes itself after both."""

    def __init__(self, rec: Recorder, log_dir: Path | None) -> None:
        self.rec, self.log_dir = rec, log_dir

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
            _info_to_a_file(self.log_dir)  # before the package's __init__ starts OneFlow's logging
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


def _info_to_a_file(log_dir: Path | None) -> None:
    """glog's INFO lines to a file (in ``log_dir`` unless the job chose a folder), unless the job set
    where they go itself: OneFlow reads these variables when it starts its logging."""
    if log_dir is not None and "GLOG_log_dir" not in os.environ:
        os.environ["GLOG_log_dir"] = str(log_dir)
    os.environ.setdefault("GLOG_logtostderr", "0")
    os.environ.setdefault("GLOG_minloglevel", "0")


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
