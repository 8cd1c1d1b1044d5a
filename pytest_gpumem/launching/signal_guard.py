"""Ctrl-C, SIGTERM and SIGHUP while child processes run: clean up first, then end as asked.

One guard for the two places that start processes in sessions of their own, which a signal sent to
our process group never reaches: a launch (its ranks) and ``gpumem bisect`` (its measuring step).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable


class FatalSignal(BaseException):
    """SIGTERM or SIGHUP arrived while the guard was armed (SIGINT arrives as KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """We must not die, nor be cut short by a second Ctrl-C, before our child processes are gone.

    The children run in sessions of their own, so what is sent to our process group (a terminal's
    Ctrl-C, the SIGTERM of a CI runner or of ``timeout``) never reaches them. While armed, SIGTERM
    and SIGHUP whose action is still the default (die on the spot, no cleanup) raise
    :class:`FatalSignal` instead, like SIGINT raises KeyboardInterrupt; from the first such signal
    until the cleanup is done these signals are held. Then ``release()`` puts the old handlers back
    and raises each held signal again (we end as we would have, without orphans), or ``restore()``
    puts them back and returns the held signals, for a command that ends by its own exit status.
    Python only lets the main thread set handlers; elsewhere the guard does nothing.
    """

    _SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        self._saved: dict[int, Any] = {}  # signal number -> the handler found
        self._holding = False
        self.held: list[int] = []

    def _set(self, sig: int, handler: Any) -> None:
        if sig not in self._saved and signal.getsignal(sig) is None:
            return  # a handler installed from C: Python could not put it back, leave it alone
        old = signal.signal(sig, handler)
        self._saved.setdefault(sig, old)

    def arm(self) -> None:
        if not self._main:
            return
        for sig in self._SIGNALS:
            now = signal.getsignal(sig)
            if now is (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL):
                self._set(sig, self._interrupt)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.hold()  # a second signal must not cut the cleanup short
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise FatalSignal(signum)

    def hold(self) -> None:
        if self._main and not self._holding:
            self._holding = True
            for sig in self._SIGNALS:
                self._set(sig, lambda signum, frame: self.held.append(signum))

    def restore(self) -> list[int]:
        """The old handlers back; the signals held meanwhile, each once, in the order they came."""
        if not self._main:
            return []
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
        return list(dict.fromkeys(self.held))

    def release(self, before_dying: Callable[[], None] = lambda: None) -> None:
        """The old handlers back, then each held signal raised again (``before_dying`` first where
        one of them will end the process)."""
        held = self.restore()
        if any(signal.getsignal(sig) == signal.SIG_DFL for sig in held):
            before_dying()
        for sig in held:
            signal.raise_signal(sig)  # SIG_DFL: pytest ends by that signal; SIGINT: KeyboardInterrupt
