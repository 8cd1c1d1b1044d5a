"""Every process of one launch, and their end: the processes we started, the ranks they announced,
their descendants, and strays that left the tree (found by the launch's id in their environment).
Ended by SIGTERM to each group and process, then SIGKILL to what is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

import psutil

from ..config.env_names import LAUNCH_ID_ENV
from . import forking
from .fork_server import ServedRank

_TERM_GRACE_S = 3.0


class LaunchProcesses:
    """The processes of the launch ``launch_id`` (a base of :class:`~.supervise.Launch`)."""

    def __init__(self, launch_id: str) -> None:
        self.launch_id = launch_id
        self._procs: list[subprocess.Popen | forking.ForkedRank | ServedRank] = []  # what we started, reaped by us
        self._seen: dict[int, psutil.Process] = {}  # every process of the launch seen so far

    def _remember(self, pid: int) -> None:
        if pid not in self._seen:
            try:
                self._seen[pid] = psutil.Process(pid)
            except psutil.Error:
                pass

    def _track_descendants(self) -> None:
        for proc in list(self._seen.values()):
            try:
                for child in proc.children(recursive=True):
                    self._seen.setdefault(child.pid, child)
            except psutil.Error:
                continue

    def _cleanup(self) -> list[int]:
        """SIGTERM every group and known process, then SIGKILL what is left; return survivors.

        Our own children are reaped through Popen (psutil would steal their exit status).
        """
        self._track_descendants()
        own = {proc.pid for proc in self._procs}
        for proc in self._procs:
            _signal_group(proc.pid, signal.SIGTERM)
        others = [p for p in self._alive(self._seen.values()) + self._strays() if p.pid not in own]
        if not others and all(proc.poll() is not None for proc in self._procs):
            # The usual end: every process of the launch had exited. Nothing is left to wait for or
            # find again (each look for strays reads every process's environment); a member of a
            # group that carries neither our env nor a known pid goes as it always did, by SIGKILL.
            for proc in self._procs:
                _signal_group(proc.pid, signal.SIGKILL)
            return []
        for other in others:
            _signal(other, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(others, timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            _signal_group(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
        alive = alive + [p for p in self._strays() if p.pid not in own]
        for stray in alive:
            _signal(stray, signal.SIGKILL)
        for proc in self._procs:
            try:
                proc.wait(timeout=_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(alive, timeout=_TERM_GRACE_S)
        survivors = self._alive(alive) + self._strays()
        survivors += [psutil.Process(p.pid) for p in self._procs if p.poll() is None]
        return sorted({p.pid for p in survivors})

    def _strays(self) -> list[psutil.Process]:
        """Processes of this launch that escaped the tree (setsid, double fork): found by env."""
        marker = f"{LAUNCH_ID_ENV}={self.launch_id}".encode()
        me = os.getpid()
        strays = []
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            try:
                data = Path(f"/proc/{proc.pid}/environ").read_bytes()
            except OSError:
                continue
            if marker in data.split(b"\0") and proc.status() != psutil.STATUS_ZOMBIE:
                strays.append(proc)
        return strays

    @staticmethod
    def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
        alive = []
        for proc in procs:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        return alive


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass
