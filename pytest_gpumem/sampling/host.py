"""Host memory of each rank: the kernel's high-water mark of resident memory.

Linux keeps ``VmHWM`` per process, so the peak is exact however rarely we look; the sampler
only has to read it before the process is gone. The rank reports ``ru_maxrss`` itself when it
exits normally (exact to the last page); the sampled value covers ranks that crash.
Elsewhere we fall back to sampling the resident set with psutil.
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
        self._self_reported_kib: dict[int, float] = {}
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

    def report_exit_peak(self, rank: int, kib: float) -> None:
        """The rank's own ``ru_maxrss`` at exit: exact, including growth after the last sample."""
        self._self_reported_kib[rank] = kib

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._tick()

    def peaks(self) -> dict[int, Peak]:
        peaks: dict[int, Peak] = {}
        ranks = set(self._pids.values()) | set(self._self_reported_kib)
        for rank in ranks:
            sampled = self._peak_kib.get(rank)
            reported = self._self_reported_kib.get(rank)
            if reported is not None:
                kib, method = max(reported, sampled or 0.0), "high-water mark"
            elif sampled is not None:
                method = "high-water mark (sampled)" if self._proc else "rss sampled"
                kib = sampled
            else:
                peaks[rank] = Peak(None, "not available")
                continue
            peaks[rank] = Peak(kib * 1024 / MiB, method)
        return peaks

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
