"""Fake-GPU ranks forked from a warm process: the imports paid once a session, not once a rank.

A fake GPU's CUDA shim must be in a process before torch is (``rankside.fakegpu.shim``), so a rank
cannot be forked from a pytest that imported torch: exec'd, each rank paid an interpreter, torch,
the test's frameworks (``transformers``: ~5 s on 2 cores) and the fake GPU's set-up, at every size.
The server is one interpreter started with the ranks' environment: it loads the fake GPU (shim,
``torch.cuda``, the fake dispatch), imports what pytest has imported from outside the project
(torch, the test modules' frameworks, pytest and its plugins) and the modules a fake-GPU rank
uses, then forks each rank on request. A rank forked from it starts as one forked from pytest does
(``forking``: its own session, log, environment, the project's modules imported afresh).

The server answers on its stdout, one JSON line each: ``ready``, then ``pid`` (or ``refused``, with
``forking.refusal``'s reason) per request, and ``exit`` with the status of each rank it reaped: it is
the ranks' parent, and :class:`ServedRank` reads their ends from it. It dies with pytest.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config.env_names import LAUNCH_ID_ENV, ROOTDIR_ENV, WORKDIR_ENV
from ..rankside import fakegpu
from ..rankside.simulate import SIMULATE_ENV
from . import forking

# What a fake-GPU rank imports whatever its job: loaded in the server, once.
WARM = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.nn.parallel",
        "torch.testing._internal.distributed.fake_pg", "torch._subclasses.fake_tensor",
        "pytest", "pytest_gpumem.plugin", "pytest_gpumem.rankside.rank", "pytest_gpumem.rankside.rank_plugin",
        "pytest_gpumem.rankside.simulate", "pytest_gpumem.rankside.gpu_allocator",
        "pytest_gpumem.sampling.allocations", "pytest_gpumem.sampling.identity")
_NEVER = ("oneflow", "__main__", "__mp_main__")  # no fake GPU for OneFlow; the scripts that ran pytest
# A launch's own: not the server's (a launch's cleanup ends every process that carries its id)
_PER_RANK = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", SIMULATE_ENV, LAUNCH_ID_ENV,
             WORKDIR_ENV)
_SERVER_ENV = (ROOTDIR_ENV, fakegpu.FAKE_GPU_ENV, fakegpu.CALIBRATION_ENV)  # read by the server as it loads


def warm_imports(rootdir: str | None, modules: Mapping[str, Any] | None = None) -> list[str]:
    """What the server imports: the warm set and every module pytest has from outside the project."""
    modules = sys.modules if modules is None else modules
    root = os.path.join(os.path.realpath(rootdir), "") if rootdir else None
    names = []
    for name, module in list(modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name.split(".")[0] in _NEVER:
            continue
        real = os.path.realpath(path)
        if root and real.startswith(root) and not forking.installed(real):
            continue
        names.append(name)
    return list(dict.fromkeys([*WARM, *sorted(names)]))


def server_key(env: Mapping[str, str], cwd: Path) -> tuple[tuple[str, str], ...]:
    """What a server is started with that its ranks cannot change: its folder, what it reads as it
    loads, and the start-up variables (``forking.startup_env_changes``)."""
    kept = [(k, v) for k, v in env.items() if k in _SERVER_ENV or forking.read_at_startup(k)]
    return (("cwd", str(cwd)),) + tuple(sorted(kept))


class ServedRank(forking.ForkedRank):
    """A rank forked by the server, supervised like a :class:`subprocess.Popen` (poll, wait, kill): the
    server, its parent, reaps it and reports its exit."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        super().__init__(pid)
        self.server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_of(self.pid)
        return self.returncode


class ForkServer:
    """The parent's side: one warm server process, its requests and the exits it reports."""

    def __init__(self, env: Mapping[str, str], cwd: Path, imports: Sequence[str]) -> None:
        fd, self.log = tempfile.mkstemp(prefix="gpumem-fork-server-", suffix=".log")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "pytest_gpumem.launching.fork_server"],
                                         env={k: v for k, v in env.items() if k not in _PER_RANK}, cwd=str(cwd),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd,
                                         start_new_session=True)
        finally:
            os.close(fd)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"imports": list(imports)}) + "\n").encode())
        self.proc.stdin.flush()
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self.ready: dict[str, Any] | None = None

    def exit_of(self, pid: int) -> int | None:
        self._read(0.0)
        if pid in self._exits:
            return self._exits.pop(pid)
        if self.proc.poll() is not None:  # the server is gone, and its ranks with it (their death signal)
            return 255
        return None

    def fork(self, rank_argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
             timeout: float) -> ServedRank | str:
        """Ask for a rank; its :class:`ServedRank`, or why the server would not (or did not) fork it."""
        assert self.proc.stdin is not None
        request = {"argv": list(rank_argv), "env": dict(env), "cwd": str(cwd), "log": str(log)}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            return f"the fork server is gone ({exc}){self.tail()}"
        answer = self._answer(time.monotonic() + timeout)
        if answer is None:
            return f"the fork server did not answer within {timeout:g} s{self.tail()}"
        if "pid" in answer:
            return ServedRank(int(answer["pid"]), self)
        return str(answer.get("refused"))

    def _answer(self, deadline: float) -> dict[str, Any] | None:
        while time.monotonic() < deadline:
            for line in self._read(min(0.5, max(0.0, deadline - time.monotonic()))):
                if "ready" in line:
                    self.ready = line
                elif "pid" in line or "refused" in line:
                    return line
            if self.proc.poll() is not None:
                return None
        return None

    def _read(self, wait: float) -> list[dict[str, Any]]:
        """The server's lines read now (after waiting up to ``wait`` for the first); exits kept."""
        if wait > 0:
            select.select([self._out], [], [], wait)
        try:
            while chunk := os.read(self._out, 65536):
                self._buffer += chunk
        except (BlockingIOError, OSError):
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        answers = []
        for raw in lines:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if "exit" in line:
                self._exits[int(line["exit"])] = int(line["code"])
            else:
                answers.append(line)
        return answers

    def tail(self) -> str:
        try:
            text = Path(self.log).read_text(errors="replace").strip()
        except OSError:
            return ""
        return f": {text.splitlines()[-1]}" if text else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        Path(self.log).unlink(missing_ok=True)


class ForkServers:
    """This session's server: one at a time, started again where the ranks' start-up environment changed."""

    def __init__(self) -> None:
        self._key: tuple[tuple[str, str], ...] | None = None
        self._server: ForkServer | None = None
        atexit.register(self.close)

    def fork(self, rank_argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
             timeout: float) -> ServedRank | str:
        key = server_key(env, cwd)
        if self._server is None or self._key != key or self._server.proc.poll() is not None:
            self.close()
            self._server, self._key = ForkServer(env, cwd, warm_imports(env.get(ROOTDIR_ENV))), key
        return self._server.fork(rank_argv, env, cwd, log, timeout)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server, self._key = None, None


SERVERS = ForkServers()  # pytest's one: ranks of every launch of the session are forked from it


# ------------------------------------------------------------------------------- the server itself


def _serve() -> None:
    """Load the fake GPU and the imports, then fork a rank per request until pytest closes stdin."""
    from ..rankside.rank import _die_with_parent

    _die_with_parent()
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # what imports print goes to the server's log
    os.close(null)
    reader = os.fdopen(requests, "rb", buffering=0)
    started = time.perf_counter()
    imports = json.loads(reader.readline() or b"{}").get("imports", [])
    name = fakegpu.requested()
    if name is not None:
        fakegpu.install(name, os.environ.get(fakegpu.CALIBRATION_ENV))
    loaded = 0
    for module in imports:
        try:
            importlib.import_module(module)
            loaded += 1
        except BaseException:  # noqa: BLE001 - a module that cannot load here is the rank's to import
            continue
    gc.collect()
    gc.freeze()  # the children's collectors leave the imports' objects (and their pages) alone
    _say(replies, {"ready": True, "imported": loaded, "seconds": round(time.perf_counter() - started, 3)})
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        _reap(replies)
        if not readable:
            continue
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                _say(replies, _fork_one(json.loads(line), (requests, replies)))


def _fork_one(request: dict[str, Any], own: tuple[int, int]) -> dict[str, Any]:
    env = request["env"]
    refused = forking.refusal(env)
    if refused is not None:
        return {"refused": refused}
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    pid = os.fork()
    if pid == 0:
        for kept in own:
            os.close(kept)
        forking.become_rank(request["argv"], env, Path(request["cwd"]), fd)  # never returns
    os.close(fd)
    return {"pid": pid}


def _reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(replies, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _say(replies: int, line: dict[str, Any]) -> None:
    os.write(replies, (json.dumps(line) + "\n").encode())


if __name__ == "__main__":
    from . import fork_server as _server  # as the package's module: forking's rank code is imported once

    _server._serve()  # noqa: SLF001
