"""Whole-GPU leases shared by every pytest process on the host (xdist workers, other sessions).

(Rendezvous ports are leased the same way, in the same folder: ``ports.py``.)

One ``flock`` per GPU in a lease folder: the kernel drops the lock when its holder dies, so a
crashed worker's lease is reclaimed without any liveness guessing; the owner file next to it
only says who holds it. Every acquire and release is appended to ``lease.log``, which is how we
show that two tests never shared a GPU.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from filelock import FileLock, Timeout

from ..sampling.nvml import GpuDevice

RETRY_S = 0.1


class LeaseError(RuntimeError):
    """No lease: the GPUs stayed busy, or the lease folder cannot be trusted."""


class LeaseTimeout(LeaseError):
    """The GPUs stayed busy longer than the configured wait."""


def default_lease_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"pytest-gpumem-leases-{os.getuid()}"


@dataclass
class Lease:
    devices: list[GpuDevice]
    _locks: list[FileLock] = field(default_factory=list)
    _log: Path | None = None
    owner: str = ""

    def release(self) -> None:
        if self._log is not None and self._locks:  # logged while still held: the log never overlaps
            _log(self._log, "release", self.owner, self.devices)
        for lock in self._locks:
            lock.release()
        self._locks = []


class GpuLeases:
    def __init__(self, folder: Path, gpus: Sequence[GpuDevice], wait_s: float) -> None:
        self.folder = folder
        self.gpus = list(gpus)
        self.wait_s = wait_s

    def _check_folder(self) -> None:
        check_lease_folder(self.folder)

    def acquire(self, count: int, owner: str) -> Lease:
        """Take ``count`` whole GPUs, all or none (no hold-and-wait), waiting at most ``wait_s``."""
        self._check_folder()
        deadline = time.monotonic() + self.wait_s
        while True:
            held: list[tuple[GpuDevice, FileLock]] = []
            for gpu in self.gpus:
                lock = FileLock(str(self.folder / f"{gpu.uuid}.lock"), mode=0o600)
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                held.append((gpu, lock))
                if len(held) == count:
                    break
            if len(held) == count:
                devices = [gpu for gpu, _ in held]
                for gpu in devices:
                    (self.folder / f"{gpu.uuid}.owner").write_text(
                        json.dumps({"pid": os.getpid(), "owner": owner, "since": time.time()}))
                _log(self.folder / "lease.log", "acquire", owner, devices)
                return Lease(devices, [lock for _, lock in held], self.folder / "lease.log", owner)
            for _, lock in held:
                lock.release()
            if time.monotonic() >= deadline:
                raise LeaseTimeout(
                    f"{count} GPU(s) were not free within {self.wait_s:g} s "
                    f"(lease folder {self.folder}); holders: {self.holders()}")
            time.sleep(RETRY_S)

    def holders(self) -> dict[str, str]:
        out = {}
        for gpu in self.gpus:
            try:
                out[gpu.uuid] = json.loads((self.folder / f"{gpu.uuid}.owner").read_text())["owner"]
            except (OSError, ValueError, KeyError):
                continue
        return out


def check_lease_folder(folder: Path) -> None:
    """Made at the first lease, ours alone: a shared temp dir must not let others fake a lease
    (of a GPU, or of a rendezvous port: ``ports.py``)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = folder.stat()
    except OSError as exc:
        raise LeaseError(f"gpumem_lease_dir {str(folder)!r} cannot be used "
                         f"({exc.strerror or exc}); expected a folder this user can create") from None
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise LeaseError(f"gpumem_lease_dir {str(folder)!r} belongs to another user or is "
                         "writable by others; expected a folder of this user's alone")


def _log(path: Path, event: str, owner: str, devices: Sequence[GpuDevice]) -> None:
    line = json.dumps({"t": round(time.time(), 4), "event": event, "pid": os.getpid(), "owner": owner,
                       "gpus": [d.uuid for d in devices]})
    with open(path, "a") as f:  # O_APPEND: lines from concurrent writers do not interleave
        f.write(line + "\n")
