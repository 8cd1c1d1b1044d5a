"""One durable, atomic file write: a private temp file beside the target, fsync, one rename.

Readers take no lock and see the old file or the new one; a writer killed mid-write leaves the
old file whole and a temp file named ``.<name>.*.tmp`` (the baseline store sweeps stale ones).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's file mode mask, read without changing it where /proc says it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)  # no /proc: the only portable way to read it
    os.umask(old)
    return old


def write_atomic(file: Path, data: bytes) -> None:
    """Private temp file beside the target, fsync, one rename: readers see old or new, never half."""
    try:
        mode = stat.S_IMODE(file.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~umask()
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")  # 0o600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)  # widened once complete: the published file is a normal one
            os.fsync(fh.fileno())
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(file.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
