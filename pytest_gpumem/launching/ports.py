"""Rendezvous ports leased across every pytest process on the host (xdist workers, other sessions).

A port chosen free and released is bound by rank 0 a moment later; in between, another launch could
choose it too, or the kernel could hand it to any socket as its ephemeral port (a connecting
client, a gloo pair). So a launch's ``MASTER_PORT`` is leased the way GPUs are (``leases.py``): one
``flock`` per port in the lease folder, held for the launch's life, dropped by the kernel when its
holder dies; and it is taken outside the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel never hands out on its own. A port
that some other program listens on is skipped; one that another program binds after the lease is
found by the launch (``Launch.port_lost``) and relaunched on a new port while no rank's test body
has started.
"""

from __future__ import annotations

import errno
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from .leases import check_lease_folder

# Where leased ports are looked for: below the kernel's usual ephemeral range (32768-60999), above
# the registered services most machines run (and torch's habitual 29500, which users set by hand).
LOW, HIGH = 30000, 32767
_TRIES = 500
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def default_port_dir() -> Path:
    """One folder per user and machine, whatever TMPDIR a session has (sessions with different
    TMPDIRs must see each other's leases): ``$XDG_RUNTIME_DIR`` (machine-local, this user's), else
    the machine's ``/tmp``. Not the GPU lease folder, which is used only where there are GPUs."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "pytest-gpumem-ports"
    return Path("/tmp") / f"pytest-gpumem-ports-{os.getuid()}"


class PortError(RuntimeError):
    """No port could be leased (every candidate held or in use)."""


@dataclass
class PortLease:
    port: int
    _lock: FileLock | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def ephemeral_range(path: Path = _EPHEMERAL) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def candidates(low: int = LOW, high: int = HIGH, ephemeral: tuple[int, int] | None = None) -> list[int]:
    """Ports in [low, high] outside the ephemeral range; where a machine's range covers them all,
    the ports above it (up to 65535)."""
    first, last = ephemeral or ephemeral_range()
    ports = [p for p in range(low, high + 1) if not first <= p <= last]
    return ports or [p for p in range(last + 1, 65536)]


def bindable(port: int) -> bool:
    """Whether a listening socket could take ``port`` now, on every address (as torch's TCPStore and
    OneFlow's control server do). No SO_REUSEADDR: a port still in TIME_WAIT counts as taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def lease_port(folder: Path, *, avoid: frozenset[int] = frozenset(),
               rng: random.Random | None = None, ports: list[int] | None = None) -> PortLease:
    """A port no other lease holds and no program uses now, held until ``release()``.

    Candidates are tried in random order, so that sessions starting together do not queue up on the
    same first port.
    """
    check_lease_folder(folder)
    pool = [p for p in (ports if ports is not None else candidates()) if p not in avoid]
    (rng or random.SystemRandom()).shuffle(pool)
    for port in pool[:_TRIES]:
        lock = FileLock(str(folder / f"port-{port}.lock"), mode=0o600)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # another launch of this plugin holds it
        if bindable(port):
            return PortLease(port, lock)
        lock.release()
    raise PortError(f"no rendezvous port free among the {min(len(pool), _TRIES)} tried (lease folder {folder}): "
                    "each one leased by another launch or in use by another program")
