"""Start a rank by forking pytest, which has already imported the test module and its frameworks.

An exec'd rank starts an interpreter, imports pytest and its plugins, and collects the test again,
importing torch a second time: ~2 s per rank on an H200 machine for a test file that imports
torch at its top, the largest part of what a GPU test cost beyond its job (benchmarks/speed.py).
A forked rank finds all of that in place and starts its own pytest session over the one test at
once: the frameworks stay imported, the project's own modules are imported afresh
(:func:`forget_project_modules`). It runs the same rank code (``rankside.rank.main``), in a
session of its own, with the same environment, log and exit report as an exec'd one.

Forking is safe only in a parent that nothing has made unsafe, so :func:`refusal` names what
would: CUDA initialised here (no child can use CUDA after its parent did), OneFlow imported (its
runtime threads hold locks), Python threads other than the plugin's samplers (they may hold the
locks the child needs), and an OpenMP thread count other than 1 for the ranks (the child cannot
re-size the pool it inherits, which may be dead in it; torch's DataLoader sets 1 in its forked
workers for the same reason). Where it refuses, the rank is exec'd as always, and the reason is
kept with the launch.

What a fork cannot give a rank is what is read as a process starts: ``PYTHON*``, the loader's,
malloc's, OpenMP's and the frameworks' start-up variables (:func:`startup_env_changes`: a marker's
``env`` or a changed environment setting one of them gets an exec'd rank), and the host allocation
tracker (it must see the frameworks' imports: the host figure includes them; ``TestDriver._fork_refusal``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Mapping, NoReturn, Sequence

from ..config.env_names import ROOTDIR_ENV
from ..rankside.rank import STARTUP_CWD

_CUDA_ERROR_NOT_INITIALIZED = 3
_SAMPLER_THREADS = ("gpumem-host-sampler", "gpumem-nvml-sampler")
_OMP_ENV = "OMP_NUM_THREADS"
_BYTECODE_ENV = "PYTHONDONTWRITEBYTECODE"


def pytest_refusal(faulthandler_timeout: object) -> str | None:
    """What in the pytest session forbids forking ranks from it, from its ini value
    ``faulthandler_timeout``: its watchdog thread is armed during the test, and a child re-arming it
    would hang."""
    try:
        timeout = float(str(faulthandler_timeout or 0))
    except ValueError:
        timeout = 0.0
    if timeout > 0:
        return "faulthandler_timeout is set (its watchdog cannot be re-armed in a forked rank)"
    return None


def refusal(rank_env: Mapping[str, str]) -> str | None:
    """Why this process cannot fork ranks now, or None when it can."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return f"fork start is for Linux ({sys.platform} here)"
    if "oneflow" in sys.modules:
        return "OneFlow is imported in pytest (its runtime threads cannot be forked)"
    if cuda_initialized():
        return ("CUDA is initialised in pytest, which no forked child can follow (a CUDA call at import or in an "
                "earlier test; for torch.cuda.is_available() set PYTORCH_NVML_BASED_CUDA_CHECK=1)")
    others = [t.name for t in threading.enumerate()
              if t is not threading.main_thread() and t.name not in _SAMPLER_THREADS]
    if others:
        return f"pytest runs other Python threads ({', '.join(sorted(others)[:3])})"
    if rank_env.get(_OMP_ENV, "1").strip() != "1":
        return f"{_OMP_ENV}={rank_env[_OMP_ENV]} for the ranks (a forked rank keeps pytest's OpenMP pool)"
    changed = startup_env_changes(rank_env)
    if changed:
        return (f"the ranks' {', '.join(changed[:3])} differ{'s' if len(changed) == 1 else ''} from what pytest "
                "started with (read as an interpreter or a library starts, before a fork could set it)")
    return None


# Read when an interpreter or a library starts (the loader, malloc, OpenMP and BLAS, CPython, the
# frameworks' import): a forked rank keeps pytest's. Those read later (NCCL_*, CUDA_*, the test's own)
# are set in the child like any other variable.
_STARTUP_ENV = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "BLIS_",
                "TORCH", "ONEFLOW_", "GLOG_")
# PYTHONUNBUFFERED and PYTHONDONTWRITEBYTECODE the child applies itself (its output, sys.dont_write_bytecode:
# pytest-xdist's workers have the latter set after they start).
# Read as a library loads (not as the interpreter starts): where the environment is applied after the
# start and before those loads (pytest-xdist's workers), what they read is the applied one.
_LOADED_LATER = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "BLIS_", "TORCH", "ONEFLOW_", "GLOG_")
_LATE_ENV = ("PYTHONUNBUFFERED", _BYTECODE_ENV, _OMP_ENV, "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG", "TORCHELASTIC_")


def startup_env_changes(rank_env: Mapping[str, str], initial: Path = Path("/proc/self/environ")) -> list[str]:
    """The start-up variables whose value for the ranks is not the one this process started with
    (``initial``: its environment at exec, as the loader and the interpreter read it)."""
    try:
        started = dict(item.split("=", 1) for item in initial.read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
    except OSError:
        return ["the environment (unreadable)"]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist starts a worker with an almost empty environment and applies the controller's
        # before anything is imported: the libraries it loads since (OpenBLAS, OpenMP, torch) read that.
        started.update({k: v for k, v in os.environ.items() if k.startswith(_LOADED_LATER)})
    changed = []
    for key in sorted(set(rank_env) | set(started)):
        if not read_at_startup(key):
            continue
        want, had = rank_env.get(key), started.get(key)
        if key == "PYTHONPATH" and want is not None:
            # What counts is where this process imports from: pytest-xdist starts its workers without
            # PYTHONPATH and puts the controller's entries on sys.path. Every entry must be there.
            if not _on_sys_path(want):
                changed.append(key)
        elif want != had:
            changed.append(key)
    return changed


def _on_sys_path(pythonpath: str) -> bool:
    base = STARTUP_CWD or "/"
    here = {os.path.normpath(os.path.join(base, entry)) for entry in sys.path}
    return all(os.path.normpath(os.path.join(base, entry)) in here for entry in pythonpath.split(os.pathsep))


def cuda_initialized(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process has initialised the CUDA driver (``cuInit``), after which no forked child
    can use CUDA (torch raises "Cannot re-initialize CUDA in forked subprocess").

    Asked of the driver rather than of a framework: ``torch.cuda.is_available()`` initialises it
    without initialising torch's CUDA (``torch.cuda.is_initialized()`` stays False), and so may any
    other library. ``import torch`` maps the driver's library without initialising it, which a fork
    survives: so where it is mapped, ``cuCtxGetCurrent`` says which (CUDA_ERROR_NOT_INITIALIZED
    before ``cuInit``; it initialises nothing itself). NVML is another library and is not counted.
    """
    try:
        if "/libcuda.so" not in maps.read_text():
            return False
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)  # the copy already loaded, or none
    except OSError:
        return True  # mapped, but not found by its name: cannot tell, so do not fork
    context = ctypes.c_void_p()
    return lib.cuCtxGetCurrent(ctypes.byref(context)) != _CUDA_ERROR_NOT_INITIALIZED


# What the launch's signal guard answers (signal_guard.SignalGuard): held, not handled, while a rank is forked.
_HELD = frozenset(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a rank is forked and recorded, then let them in.

    Handled inside the fork, a signal's exception would be raised in the fork hooks that logging and
    filelock run after it (where Python reports and drops it: the launch then ran on to its timeout),
    or in a child not yet detached from pytest (a second pytest, back in the session). Held, it
    arrives once the rank is in the launch's list, which the cleanup that follows ends.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


class ForkedRank:
    """A forked rank, supervised like a :class:`subprocess.Popen` (poll, wait, kill, returncode)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def forget_project_modules(rootdir: str | None) -> list[str]:
    """Drop the project's own modules (the test module, its conftests, the project's helpers: files
    under the rootdir, not installed packages and not this plugin), so that the rank's pytest imports
    them afresh: their module-level code then runs in the rank, with its RANK, WORLD_SIZE, LOCAL_RANK
    and marker env, over none of the state earlier tests left in pytest, as in an exec'd rank. The
    frameworks stay imported: that is what forking saves."""
    if not rootdir:
        return []
    root = os.path.join(os.path.realpath(rootdir), "")
    own = os.path.join(os.path.dirname(os.path.realpath(__file__)).rsplit(os.sep, 1)[0], "")
    dropped = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__":
            continue
        real = os.path.realpath(path)
        if real.startswith(root) and not real.startswith(own) and not installed(real):
            del sys.modules[name]
            dropped.append(name)
    return dropped


_INSTALLED = frozenset(("site-packages", "dist-packages"))


def installed(path: str) -> bool:
    """Whether a module's file is an installed package's (a framework's, kept imported in a fork)."""
    return bool(_INSTALLED.intersection(path.split(os.sep)))


def read_at_startup(name: str) -> bool:
    """Whether a variable is read as an interpreter or a library starts (a fork keeps its value)."""
    return name.startswith(_STARTUP_ENV) and not name.startswith(_LATE_ENV)


_TORCH_DEFAULT_SEED = 67280421310721  # c10's default_rng_seed_val: a fresh interpreter's CPU generator


def _as_a_fresh_interpreter() -> None:
    """What an exec'd rank starts with and a fork would not: the frameworks' thread count and seeds."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives an exec'd rank (refusal() checked it is 1)
        torch.random.default_generator.manual_seed(_TORCH_DEFAULT_SEED)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as at numpy's import (Python's random reseeds itself)


def fork_rank(rank_argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> ForkedRank:
    """Fork a rank that runs ``rankside.rank.main(rank_argv)`` with ``env``, its output in ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    # Frozen, pytest's objects are left alone by the child's collector, which would otherwise write
    # to every one of them and so copy every page they sit on (torch's import leaves ~10^6). The child
    # keeps them frozen; pytest thaws its own at once. A process that froze
    # objects itself is left as it is.
    freeze = gc.get_freeze_count() == 0
    pid = -1
    try:
        if freeze:
            gc.freeze()
        with warnings.catch_warnings():
            # Python 3.12 warns whenever any thread exists; the ones left here are C threads of
            # torch's import and NVML, and the samplers, none of which the child uses (refusal()).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            become_rank(list(rank_argv), env, cwd, fd)
    finally:
        if pid != 0:
            if freeze:
                gc.unfreeze()
            os.close(fd)  # the parent's copy (the child never returns here)
    return ForkedRank(pid)


def become_rank(rank_argv: list[str], env: Mapping[str, str], cwd: Path, fd: int) -> NoReturn:
    """The forked side (of pytest, or of the fake GPU's fork server): become a rank as an exec'd one
    would start, then never return into the process it was forked from."""
    code = 70  # EX_SOFTWARE: the rank did not get as far as its own exit
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(null)
        # pytest's capture replaced sys.std*: fresh, unbuffered ones on the rank's own descriptors
        # (PYTHONUNBUFFERED, as an exec'd rank has: the last line before a crash reaches the log).
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        os.chdir(cwd)
        for sig in signal.valid_signals():  # pytest's handlers (and the launch's guard) stay in pytest
            try:
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            except (OSError, ValueError):
                continue
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # held by the launch for the fork (signals_held)
        atexit._clear()  # noqa: SLF001 - pytest's exit handlers are not the rank's
        os.environ.clear()
        os.environ.update(env)
        sys.dont_write_bytecode = bool(env.get(_BYTECODE_ENV))  # as an exec'd rank's interpreter would read it
        forget_project_modules(env.get(ROOTDIR_ENV))
        _as_a_fresh_interpreter()
        from ..rankside import rank

        rank.main(rank_argv)  # "pytest" mode ends the process itself (rank._exit_fast)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever it is, the child must not return into pytest
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001 - as rank._exit_fast
            atexit._run_exitfuncs()  # noqa: SLF001 - the rank's exit report
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
