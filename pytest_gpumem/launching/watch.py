"""What a user sees while a test's sizes run: a line as each launch starts and ends (``-v``), a
running line on a terminal otherwise, and rank 0's own output as it is written (``-s``).

Plain Python: ``plugin.py`` hands in where the lines go (pytest's terminal); a session without them
pays nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Say = Callable[[str], None]
FOLLOW_INTERVAL_S = 0.2  # how often rank 0's output is read while it runs


@dataclass(frozen=True)
class Watch:
    """Where the lines go: ``progress`` a line per launch, ``running`` the size running now on the
    line being written (an empty text: none), ``echo`` rank 0's output (None: not shown)."""

    progress: Say | None = None
    running: Say | None = None
    echo: Say | None = None


class RunningLine:
    """The size running now, written after what the terminal's line already holds (pytest's dots)
    and erased in place when it ends, as pytest-xdist shows its workers while they start."""

    def __init__(self, write: Say) -> None:
        self.write = write
        self._shown = 0

    def __call__(self, text: str) -> None:
        shown, self._shown = self._shown, len(text) + 3 if text else 0
        erase = "\b" * shown + " " * shown + "\b" * shown
        self.write(erase + (f" [{text}]" if text else ""))


def what(world: int, simulated: tuple[int, ...], fake_gpu: str | None) -> str:
    """``nproc=8 (simulated: rank 0 alone)``, ``nproc=2 (fake NVIDIA H200)``, ``nproc=4``."""
    if fake_gpu:
        return f"nproc={world} (fake {fake_gpu})"
    if simulated:
        ranks = ", ".join(map(str, simulated))
        return f"nproc={world} (simulated: rank{'s' if len(simulated) > 1 else ''} {ranks})"
    return f"nproc={world}"


class Follower:
    """Says each new line of a file while a launch runs, and the rest when it stops."""

    def __init__(self, path: Path, say: Say, prefix: str) -> None:
        self.path, self.say, self.prefix = path, say, prefix
        self._offset = 0
        self._partial = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpumem-follow", daemon=True)

    def __enter__(self) -> Follower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read(final=True)

    def _run(self) -> None:
        while not self._stop.wait(FOLLOW_INTERVAL_S):
            self._read()

    def _read(self, final: bool = False) -> None:
        try:
            with open(self.path, errors="replace") as handle:
                handle.seek(self._offset)
                text = handle.read()
                self._offset = handle.tell()
        except OSError:  # not written yet, or gone
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # a line not ended yet
        if final and self._partial:
            lines.append(self._partial)
            self._partial = ""
        for line in lines:
            self.say(f"{self.prefix}{line}")
