"""Private launch folders in the system temp dir, and the sweep of those whose pytest died.

A pytest killed with SIGKILL cannot remove its in-flight launch's folder. Like pytest with its
own temporary directories, we name each folder after its owner (pid and start time, so a reused
pid is not mistaken for the owner) and remove, at the next start, the folders whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

PREFIX = "gpumem-"
_NAME = re.compile(rf"{PREFIX}(\d+)-(\d+)-")


def _start_ticks(pid: int) -> int:
    """The process's start time in hundredths of a second: stable for its whole life."""
    return int(psutil.Process(pid).create_time() * 100)


def make_workdir(parent: Path | None = None) -> Path:
    """A new private folder (mode 0700) named after this process."""
    me = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{me}-{_start_ticks(me)}-", dir=parent))


def _owner_alive(pid: int, ticks: int) -> bool:
    try:
        return _start_ticks(pid) == ticks
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.Error:  # exists but unreadable: assume it is alive
        return True


def sweep_orphans(parent: Path | None = None) -> list[Path]:
    """Remove launch folders of ours whose owning process is gone; returns what was removed."""
    folder = Path(parent or tempfile.gettempdir())
    removed = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for path in folder.glob(f"{PREFIX}*"):
            match = _NAME.match(path.name)
            if match is None or _owner_alive(int(match.group(1)), int(match.group(2))):
                continue
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink() and path.stat().st_uid == uid:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed
