"""Host memory of each rank, from the parent: resident memory, kept as information and fallback.

The gated host figure is the peak of live allocations, which each rank tracks itself and reports
at exit (``sampling.allocations``). From outside, the parent samples the resident set for the
timeline and reads the kernel's high-water mark (``VmHWM``, exact however rarely we look) so
that RSS stays visible, and so that a rank that died before reporting still has a figure, named
as what it is.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from . import MiB, Peak

DEFAULT_INTERVAL_S = 0.05


def read_status_kib(pid: int) -> tuple[float, float] | None:
    """(VmRSS, VmHWM) in KiB from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = hwm = None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            rss = float(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = float(line.split()[1])
    if rss is None or hwm is None:  # a zombie has no memory lines
        return None
    return rss, hwm


class HostSampler:
    """Samples every rank's resident set and keeps its high-water mark."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._peak_kib: dict[int, float] = {}
        self._reported_hwm_kib: dict[int, float] = {}
        self._reported_alloc: dict[int, tuple[float, str]] = {}
        self._timeline: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._proc = sys.platform.startswith("linux")

    def start(self) -> None:
        self._t0 = self._clock()
        self._thread = threading.Thread(target=self._run, name="gpumem-host-sampler", daemon=True)
        self._thread.start()

    def add_process(self, rank: int, pid: int) -> None:
        with self._lock:
            self._pids[pid] = rank
        self._sample_one(pid, rank)

    def report_exit(self, rank: int, hwm_kib: float | None, alloc_mib: float | None, method: str) -> None:
        """What the rank said of itself at exit: its allocation peak and its own ``VmHWM``."""
        if hwm_kib is not None:
            self._reported_hwm_kib[rank] = hwm_kib
        if alloc_mib is not None:
            self._reported_alloc[rank] = (alloc_mib, method)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._tick()

    def peaks(self) -> dict[int, Peak]:
        """The gated host figure: each rank's allocation peak; resident memory only where it has none."""
        peaks: dict[int, Peak] = {}
        for rank in self._ranks():
            if rank in self._reported_alloc:
                mib, method = self._reported_alloc[rank]
                peaks[rank] = Peak(mib, method)
                continue
            rss = self.rss_peaks().get(rank)
            kind = "high-water mark" if self._proc else "rss sampled"
            peaks[rank] = (Peak(rss, f"{kind} (no allocation peak reported)") if rss is not None
                           else Peak(None, "not available"))
        return peaks

    def rss_peaks(self) -> dict[int, float]:
        """Each rank's resident high-water mark in MiB (information: it follows the page cache)."""
        out: dict[int, float] = {}
        for rank in self._ranks():
            kib = max(self._reported_hwm_kib.get(rank, 0.0), self._peak_kib.get(rank, 0.0))
            if kib > 0:
                out[rank] = kib * 1024 / MiB
        return out

    def _ranks(self) -> set[int]:
        return set(self._pids.values()) | set(self._reported_hwm_kib) | set(self._reported_alloc)

    def timeline(self) -> list[tuple[float, dict[int, float]]]:
        return list(self._timeline)

    def _run(self) -> None:
        start = self._clock()
        k = 0
        while not self._stop.is_set():
            self._tick()
            k += 1
            # Drift-free: aim at start + k * interval; skip slots we are already late for.
            now = self._clock()
            k = max(k, int((now - start) / self.interval_s) + 1)
            self._stop.wait(max(0.0, start + k * self.interval_s - now))

    def _tick(self) -> None:
        with self._lock:
            pids = list(self._pids.items())
        point: dict[int, float] = {}
        for pid, rank in pids:
            rss = self._sample_one(pid, rank)
            if rss is not None:
                point[rank] = rss * 1024 / MiB
        if point:
            self._timeline.append((self._clock() - self._t0, point))

    def _sample_one(self, pid: int, rank: int) -> float | None:
        if self._proc:
            status = read_status_kib(pid)
            if status is None:
                return None
            rss, hwm = status
        else:
            try:
                rss = psutil.Process(pid).memory_info().rss / 1024
            except psutil.Error:
                return None
            hwm = rss
        if hwm > self._peak_kib.get(rank, 0.0):
            self._peak_kib[rank] = hwm
        return rss
