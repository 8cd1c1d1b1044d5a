"""Start N ranks through a real launcher, supervise them, and make sure every process is gone.

Every launcher shares one environment contract (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK): ``python -m oneflow.distributed.launch``, ``torchrun``, ``direct`` (we spawn the
ranks), ``srun`` (``slurm.py``) and any registered through the ``pytest_gpumem_launchers`` hook.
Every launch runs in sessions of its own, because OneFlow's launcher answers a failed rank with
``killpg(getpid(), SIGTERM)``, which would otherwise take pytest with it. The launch owns its
timeout: no launcher has one, and a rank stuck in a collective waits forever. What a launch
learns while it runs is its own state; its :class:`LaunchResult` is built once, when it ends."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from ..config.env_names import LAUNCH_ID_ENV, SLOT_ENV, WORKDIR_ENV
from ..config.settings import DEFAULT_FAIL_FAST_GRACE_S
from ..rankside import protocol
from ..rankside.rank import STARTUP_CWD
from ..rankside.simulate import SIMULATE_ENV
from . import fork_server, forking
from .leases import LeaseError
from .ports import PortError, PortLease, default_port_dir, lease_port
from .processes import LaunchProcesses
from .signal_guard import FatalSignal, SignalGuard

# Variables a launcher sets per rank; inherited values from an outer job would confuse it.
_CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID", SIMULATE_ENV, SLOT_ENV)
_TICK_S = 0.02
STACK_DUMP_WAIT_S = 1.0
# How torch's TCPStore ("EADDRINUSE, message: address already in use") and OneFlow's control
# server ("Address already in use") say that the rendezvous port was taken.
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


@dataclass(frozen=True)
class LaunchRequest:
    """One launch, handed to the launcher that starts it: how many ranks, what each rank runs, where it may write."""

    nproc: int
    rank_argv: tuple[str, ...]      # arguments of ``python -m pytest_gpumem.rankside.rank``
    env: Mapping[str, str]          # extra environment (marker env, CUDA_VISIBLE_DEVICES, ...)
    cwd: Path
    workdir: Path                   # private folder of this launch (logs, pids, results)
    timeout: float
    nnodes: int | None = None       # srun only: spread the ranks over this many nodes
    # direct only: "fork" forks the ranks from pytest where it is safe (forking), "serve" from the fake
    # GPU's warm server (fork_server)
    start: str = "exec"
    # direct only: a simulated world (rankside.simulate): process i is rank simulated[i] of a world of
    # world_size, on the i-th of the GPUs it sees (modulo their number, gpus); () for a real world
    simulated: tuple[int, ...] = ()
    world_size: int = 0
    gpus: int = 1
    fail_fast_grace: float = DEFAULT_FAIL_FAST_GRACE_S  # after a rank failed, before the others are ended
    port_dir: Path | None = None    # where rendezvous ports are leased (None: ports.default_port_dir())


@dataclass
class LaunchResult:
    nproc: int
    command: list[str]
    pids: dict[int, int] = field(default_factory=dict)
    returncodes: dict[int, int] = field(default_factory=dict)  # direct launcher only
    launcher_returncode: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    stacks: dict[int, str] = field(default_factory=dict)
    leftovers: list[int] = field(default_factory=list)
    nodes: dict[int, str] = field(default_factory=dict)  # srun: the node of each rank
    problems: list[str] = field(default_factory=list)    # what the launcher itself found wrong
    # a simulated world: process i stood for rank simulated[i] of world_size (the request's)
    simulated: tuple[int, ...] = ()
    world_size: int = 0
    results: dict[int, protocol.RankResult] = field(default_factory=dict)  # each rank's test outcome
    # How the launch ended: "done" (every process the plugin started ended by itself), "fail-fast"
    # (a rank failed; the plugin ended the others after a grace) or "timeout".
    end: str = "done"
    # Seconds after the start at which each rank was seen to end, and to report a failed test,
    # while the launch ran: the order in which the ranks failed.
    ended_at: dict[int, float] = field(default_factory=dict)
    failed_at: dict[int, float] = field(default_factory=dict)
    stopped: frozenset[int] = frozenset()  # ranks still running when the plugin ended the launch
    pythonpath: str | None = None          # the ranks' PYTHONPATH (relative entries made absolute)
    start: str = "exec"                    # how the ranks were started: "fork" or "exec"
    start_refusal: str | None = None       # a fork was asked for and refused here: why
    port: int | None = None                # the rendezvous port (MASTER_PORT) the launch was given
    port_note: str | None = None           # why the port was not leased (a free one was chosen)
    # The rendezvous port was taken by another program before any rank's test body started: the line
    # that says so (a relaunch on another port runs no user test body twice; size_launch.py does it).
    port_lost: str | None = None

    def rank_log(self, workdir: Path, rank: int, lines: int = 40) -> str:
        """The end of a rank's output, without the pytest/pluggy/runpy frames of a crash dump
        (~35 of them: they pushed "Fatal Python error: Segmentation fault" and the test's own
        frame out of the 40 lines shown)."""
        text = protocol.read_tail(workdir, rank, "log")
        return "\n".join(_user_frames(text).splitlines()[-lines:]) if text else ""


def free_port() -> int:
    """A port the OS says is free now; rank 0 binds it a moment later. Only where no port can be
    leased (``ports.py``), and for Slurm, whose rank 0 binds on another node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def oneflow_library_dirs() -> list[str]:
    """cuDNN/cuBLAS folders that a pip-installed OneFlow needs even on a CPU-only machine."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    dirs = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in ("cudnn", "cublas"):
            path = Path(root) / lib / "lib"
            if path.is_dir():
                dirs.append(str(path))
    return dirs


def absolute_pythonpath(value: str, cwd: str | None) -> str:
    """PYTHONPATH with its relative entries (an empty one means the folder itself) resolved against
    ``cwd``, as this interpreter resolved them into ``sys.path`` when it started: a rank runs from
    another folder (pytester's, the launch's), where ``.`` would name something else."""
    if cwd is None:
        return value
    return os.pathsep.join(entry if os.path.isabs(entry) else os.path.normpath(os.path.join(cwd, entry))
                           for entry in value.split(os.pathsep))


def rank_environment(base: Mapping[str, str], request: LaunchRequest, launch_id: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _CONTRACT}
    if env.get("PYTHONPATH"):  # the session's own; a marker's env= below is the user's, left as given
        env["PYTHONPATH"] = absolute_pythonpath(env["PYTHONPATH"], STARTUP_CWD)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    # Same thread count at every world size, so 1 -> N compares like with like
    # (both launchers would set 1 only when N > 1).
    env.setdefault("OMP_NUM_THREADS", "1")
    if importlib.util.find_spec("oneflow") is not None:
        env.setdefault("ONEFLOW_TEST_DEVICE_NUM", str(request.nproc))  # else skip_unless_1nXd skips
        env.setdefault("ONEFLOW_TEST_NODE_NUM", "1")
        libs = oneflow_library_dirs()
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env.update(request.env)
    env[WORKDIR_ENV] = str(request.workdir)
    env[LAUNCH_ID_ENV] = launch_id
    env["PYTHONUNBUFFERED"] = "1"
    return env


def bound_python() -> list[str]:
    """A launcher is started through ``rank exec``, which binds it to die with pytest (its ranks
    die with it): even a SIGKILLed pytest leaves nothing running."""
    return [sys.executable, "-m", "pytest_gpumem.rankside.rank", "exec", sys.executable]


def rank_target(request: LaunchRequest) -> list[str]:
    """What each rank's interpreter runs: ``-m pytest_gpumem.rankside.rank <rank_argv>``."""
    return ["-m", "pytest_gpumem.rankside.rank", *request.rank_argv]


def direct_env(env: Mapping[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}


def simulated_env(slot: int, request: LaunchRequest) -> dict[str, str]:
    """Process ``slot`` of a simulated launch: the contract of its rank in the real world, on a
    node holding the GPUs this launch sees (LOCAL_RANK indexes them); its files under ``slot``."""
    gpus = max(1, request.gpus)
    return {"RANK": str(request.simulated[slot]), "WORLD_SIZE": str(request.world_size),
            "LOCAL_RANK": str(slot % gpus), "LOCAL_WORLD_SIZE": str(min(gpus, request.nproc)),
            SLOT_ENV: str(slot), SIMULATE_ENV: f"{request.simulated[slot]}/{request.world_size}"}


class Launch(LaunchProcesses):
    """Runs one launch to the end; ``on_rank(rank, pid)`` is called as each rank announces itself.

    One subclass per launcher (``launching/launchers/``): this base starts one launcher process that
    starts the ranks; a subclass says how (``_command``), and what it does differently by the class
    attributes below, never by its name.
    """

    per_rank = False  # True: we start each rank ourselves (one process, one exit code a rank; forkable)
    picks_own_port = False  # the launcher picks and binds the rendezvous port (torchrun --standalone)

    def __init__(self, request: LaunchRequest, on_rank: Callable[[int, int], None]) -> None:
        self.request = request
        self.on_rank = on_rank
        super().__init__(uuid.uuid4().hex)
        # What the launch learns while it runs, its own state: LaunchResult is built from it once, at the end.
        self._results: dict[int, protocol.RankResult] = {}
        self._pids: dict[int, int] = {}
        self._ended_at: dict[int, float] = {}
        self._failed_at: dict[int, float] = {}

    def run(self) -> LaunchResult:
        req = self.request
        req.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = rank_environment(os.environ, req, self.launch_id)
        lease, note = self._lease_port()
        port = lease.port if lease is not None else free_port()
        command = self._command(port)
        started: tuple[str, str | None] = ("exec", None)
        ending = _Ending("done")
        start = time.monotonic()
        guard = SignalGuard()
        try:
            guard.arm()
            started = self._start_ranks(command, env, port)
            # the timeout is the ranks' own: a fake GPU's warm server loading (once a session, bounded
            # by the timeout too) is not charged to the first size's ranks; the duration counts it
            ending = self._supervise(time.monotonic())
        except FatalSignal as exc:
            guard.held.append(exc.signum)  # raised again once the launch's processes are gone
        finally:
            guard.hold()
            try:
                duration = time.monotonic() - start
                stopped = frozenset(self._running_ranks())  # what the cleanup ends
                leftovers = self._cleanup()
                exits = self._exit_codes(timed_out=ending.end == "timeout")
                self._read_results()
                result = LaunchResult(
                    nproc=req.nproc, command=command, pids=dict(self._pids),
                    returncodes=exits.returncodes, launcher_returncode=exits.launcher_returncode,
                    timed_out=ending.end == "timeout", duration_s=duration, stacks=ending.stacks,
                    leftovers=leftovers, nodes=exits.nodes, problems=list(exits.problems),
                    simulated=req.simulated, world_size=req.world_size, results=dict(self._results),
                    end=ending.end, ended_at=dict(self._ended_at), failed_at=dict(self._failed_at),
                    stopped=stopped, pythonpath=env.get("PYTHONPATH"), start=started[0],
                    start_refusal=started[1], port=port, port_note=note, port_lost=self._port_lost())
            finally:
                if lease is not None:
                    lease.release()  # held until every process of the launch is gone
                # A held SIGTERM/SIGHUP ends pytest right here: nobody will read the launch's folder.
                guard.release(before_dying=lambda: shutil.rmtree(req.workdir, ignore_errors=True))
        return result

    def _command(self, port: int) -> list[str]:
        """The command that starts the launcher (or, for a launcher of ``per_rank``, each rank)."""
        raise NotImplementedError(f"{type(self).__name__} says no command")

    def _start_ranks(self, command: list[str], env: Mapping[str, str], port: int) -> tuple[str, str | None]:
        """One launcher process, which starts the ranks; its output in ``launcher.log``. Returns how
        the ranks were started ("exec" or "fork") and, where a fork was asked for and refused, why."""
        self._spawn(command, env, self.request.workdir / "launcher.log")
        return "exec", None

    def _lease_port(self) -> tuple[PortLease | None, str | None]:
        """The launch's MASTER_PORT, leased for its life (``ports.py``); a launcher that picks its own
        leases none. Where none can be leased, a port chosen free (unleased), and why."""
        if self.picks_own_port:
            return None, None
        try:
            return lease_port(self.request.port_dir or default_port_dir()), None
        except (LeaseError, PortError) as exc:
            return None, f"rendezvous port not leased ({exc}); chosen free instead"

    def _port_lost(self) -> str | None:
        """The line saying the rendezvous port was taken, in a launch that failed before any rank's
        test body started (the ``body`` files); None otherwise. Body mode only: a script's own code
        runs from its first line."""
        req = self.request
        if req.rank_argv[:1] != ("pytest",) or self.picks_own_port:
            return None
        ranks = range(req.nproc)
        if all(r in self._results and self._results[r].outcome != "failed" for r in ranks):
            return None
        if any(protocol.body_started(req.workdir, r) for r in ranks):
            return None
        texts = [r.text for r in self._results.values()] + [protocol.read_tail(req.workdir, r, "log") for r in ranks]
        texts.append(_read(req.workdir / "launcher.log"))
        for text in texts:
            for line in text.splitlines():
                if _ADDRESS_IN_USE.search(line):
                    return line.strip()
        return None

    def _spawn(self, command: Sequence[str], env: Mapping[str, str], output: Path) -> None:
        """Start one process in a session of its own, its stdout and stderr appended to ``output``
        (created private: 0600)."""
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            proc = subprocess.Popen(list(command), env=dict(env), cwd=str(self.request.cwd),
                                    stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            os.close(fd)
        self._procs.append(proc)
        self._remember(proc.pid)

    def _fork(self, env: Mapping[str, str], log: Path) -> None:
        """Start one rank forked from pytest, in a session of its own (``forking``)."""
        with forking.signals_held():  # a Ctrl-C now arrives once the rank is ours to end
            proc = forking.fork_rank(self.request.rank_argv, env, self.request.cwd, log)
            self._procs.append(proc)
        self._remember(proc.pid)

    def _serve(self, env: Mapping[str, str], log: Path) -> str | None:
        """Start one rank forked by the fake GPU's warm server (``fork_server``); why not, where it would not."""
        proc = fork_server.SERVERS.fork(self.request.rank_argv, env, self.request.cwd, log, self.request.timeout)
        if isinstance(proc, str):
            return proc
        self._procs.append(proc)
        self._remember(proc.pid)
        return None

    def _supervise(self, start: float) -> _Ending:
        req = self.request
        deadline = start + req.timeout
        failed_at: float | None = None
        last_scan = 0.0
        while True:
            self._discover()
            now = time.monotonic()
            if now - last_scan > 0.25:
                self._track_descendants()
                last_scan = now
            codes = [p.poll() for p in self._procs]
            reported = self._rank_reported_failure()
            self._note_ends(codes, now - start)
            if all(code is not None for code in codes):
                return _Ending("done")
            if failed_at is None and (reported or (
                    self.per_rank and any(c not in (None, 0) for c in codes))):
                # Like torchrun: one failed rank ends the launch, after a grace for the others to
                # report. A rank that failed its test may still be blocked in the framework's
                # exit barrier, waiting for peers that wait for it.
                failed_at = now
            if failed_at is not None and now - failed_at >= req.fail_fast_grace:
                # where the ranks still running were: the report shows it
                return _Ending("fail-fast", self._dump_stacks())
            if now >= deadline:
                return _Ending("timeout", self._dump_stacks())
            time.sleep(_TICK_S)

    def _note_ends(self, codes: list[int | None], elapsed: float) -> None:
        """When each rank was first seen to end, and to report a failed test: the order of failures."""
        for rank, reported in self._results.items():  # read by _rank_reported_failure
            if reported.outcome == "failed":
                self._failed_at.setdefault(rank, elapsed)
        for rank in self._ended_ranks(codes):
            self._ended_at.setdefault(rank, elapsed)

    def _ended_ranks(self, codes: list[int | None]) -> set[int]:
        """The ranks whose process has ended (direct: the processes we started, one per rank;
        a launcher's ranks: the pids they announced)."""
        if self.per_rank:
            return {rank for rank, code in enumerate(codes) if code is not None}
        return {rank for rank, pid in self._pids.items()
                if pid not in self._seen or not self._alive([self._seen[pid]])}

    def _running_ranks(self) -> set[int]:
        codes = [p.poll() for p in self._procs]
        known = set(range(len(self._procs))) if self.per_rank else set(self._pids)
        return known - self._ended_ranks(codes)

    def _read_results(self) -> None:
        """Each rank's result, parsed once: it is written whole, once, when the rank's test ends."""
        for rank in range(self.request.nproc):
            if rank not in self._results:
                found = protocol.read_result(self.request.workdir, rank)
                if found is not None:
                    self._results[rank] = found

    def _rank_reported_failure(self) -> bool:
        self._read_results()
        return any(r.outcome == "failed" for r in self._results.values())

    def _discover(self) -> None:
        for rank in range(self.request.nproc):
            if rank in self._pids:
                continue
            pid = protocol.read_hello_pid(self.request.workdir, rank)
            if pid is None:
                continue
            self._pids[rank] = pid
            self._watch_rank(pid)
            self.on_rank(rank, pid)

    def _watch_rank(self, pid: int) -> None:
        """A rank's process is ours to clean up (its own host: the local launchers)."""
        self._remember(pid)

    def _dump_stacks(self) -> dict[int, str]:
        """Every live rank's Python stacks (faulthandler on SIGUSR1), asked for before it is killed."""
        asked = []
        for rank, pid in self._pids.items():
            try:
                os.kill(pid, signal.SIGUSR1)
                asked.append(rank)
            except OSError:
                pass
        end = time.monotonic() + STACK_DUMP_WAIT_S
        # faulthandler writes a thread at a time, the signalled (main) thread's frames among the last:
        # done when every dump has begun and none grew over the last tick (a busy host wrote the
        # main thread's header and not yet its frames by the time a fixed pause ended)
        sizes: list[int] = []
        while time.monotonic() < end:
            texts = [protocol.read_tail(self.request.workdir, rank, "stack") for rank in asked]
            if all(texts) and [len(t) for t in texts] == sizes:
                break
            sizes = [len(t) for t in texts]
            time.sleep(0.05)
        return read_stacks(self.request.workdir, self._pids)

    def _exit_codes(self, timed_out: bool) -> Exits:
        """How the processes ended: one exit code a rank (direct) or the launcher's."""
        codes = [p.returncode for p in self._procs]
        if self.per_rank:
            return Exits(returncodes={rank: code for rank, code in enumerate(codes) if code is not None})
        return Exits(launcher_returncode=codes[0] if codes else None)


@dataclass(frozen=True)
class _Ending:
    """How supervision ended ("done", "fail-fast" or "timeout") and the stacks dumped on the way out."""

    end: str
    stacks: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Exits:
    """What the processes' ends said: exit codes, and (srun) each rank's node and the launcher's problems."""

    returncodes: dict[int, int] = field(default_factory=dict)
    launcher_returncode: int | None = None
    nodes: dict[int, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()


def read_stacks(workdir: Path, ranks: Iterable[int]) -> dict[int, str]:
    """The user's frames of each rank's stack dump, where it wrote one."""
    found = {}
    for rank in ranks:
        text = protocol.read_tail(workdir, rank, "stack")
        if text.strip():
            found[rank] = _user_frames(text)
    return found


# Frames every rank has in common (pytest, pluggy, runpy; a forked rank's stack starts in the pytest
# that forked it) and the plugin's own, cut as pytest cuts its own: what is left is the user's.
_HARNESS_FRAMES = ("/_pytest/", "/pluggy/", "<frozen runpy>", "/pytest/__main__.py", "/runpy.py",
                   "/pytest_gpumem/")
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
_STDLIB = re.compile(r'File "[^"]*/lib/python3\.\d+/(?!(site|dist)-packages/)[^"]*"|File "<frozen ')


def _user_frames(stack: str) -> str:
    """A faulthandler dump without the harness's and the plugin's frames, and without the threads
    that had no frame but those and the standard library's (a sampler's; a rank that was only
    finishing the plugin's own work): what is left is where the user's job was."""
    blocks: list[list[str]] = [[]]  # the lines before the first thread, then one list per thread
    for line in stack.splitlines():
        if _THREAD.match(line.strip()):
            blocks.append([line])
        elif not (line.lstrip().startswith("File ") and any(frame in line for frame in _HARNESS_FRAMES)):
            blocks[-1].append(line)
    kept = list(blocks[0])
    for block in blocks[1:]:
        frames = [line for line in block[1:] if line.lstrip().startswith("File ")]
        if any(not _STDLIB.search(line) for line in frames):
            kept.extend(line for line in block if line.strip())
    return "\n".join(kept).strip("\n")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def describe_returncode(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        if -code == signal.SIGKILL:  # what the kernel's OOM killer sends: say so
            return f"killed by {name} (kill -9, or the kernel's OOM killer when memory ran out)"
        return f"killed by {name}"
    return f"exit code {code}"
