"""The one atomic write's file mode: what the process's mask says, read without changing it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_gpumem.storage import atomic


def test_umask_is_read_from_proc_and_without_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """/proc/self/status where there is one; elsewhere (or when it says nothing usable) os.umask."""
    status = tmp_path / "status"
    real_path = atomic.Path
    monkeypatch.setattr(atomic, "Path", lambda p: status if p == "/proc/self/status" else real_path(p))
    old = os.umask(0o022)
    try:
        status.write_text("Name:\tpython\nUmask:\t0027\nState:\tR (running)\n")
        assert atomic.umask() == 0o027  # what the file says, not the process
        for text in (None, "Name:\tpython\n", "Umask:\n", "Umask:\tzz\n"):
            if text is None:
                status.unlink()
            else:
                status.write_text(text)
            assert atomic.umask() == 0o022
            assert os.umask(0o022) == 0o022  # and the mask is left as it was
    finally:
        os.umask(old)
