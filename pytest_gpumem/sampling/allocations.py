"""Host memory that a rank allocated: the peak of its live allocations, tracked inside the rank.

Why not RSS: a rank's resident set carries the frameworks' file-backed library pages, which
follow the page cache (the same job read 467 and 529 MiB through two copies of the same torch),
and freed memory the allocator has not returned yet (a GPT-2 DDP job: 1034-1197 MiB over 11
runs). The peak of live allocations depends on the code only: memray sees every
malloc/calloc/realloc/posix_memalign/mmap (and their frees) of every thread of the process,
so a spike of any length counts, and the same job reads the same figure on any install.

Python's own objects are counted one by one (memray's ``trace_python_allocators``): each
PyObject/PyMem allocation at the size asked for. Untraced, CPython's small-object allocator
(pymalloc) shows up only as the 1 MiB arenas it maps, and whether one more arena is live at the
peak depends on how full the arenas were when tracking started and on their fragmentation, not on
the code: the same torch DDP job read 188.677 MiB in 22 of 24 reruns, 187.677 in one (the same
bytes of every other allocator at the peak, one arena fewer) and 188.025 in another
(benchmarks/results/travel_spread.txt). Counted one by one, the figure is the bytes live at the
peak, the same in every rerun (the arenas' unused space, ~7 MiB in that job, is not counted).

What it does not see: pages reserved but never allocated through those calls (the interpreter's
own start-up before the tracker starts, the executable's and libraries' mapped files), whether
allocated pages were touched, and forked children (not followed).

What it costs: memray keeps each thread's Python stack through a profile hook and records every
allocation against it, so Python-heavy work (a framework's import, pytest's start-up) runs 2-4x
slower tracked. A pytest rank's start-up is the same bytes at every launch, so it is tracked once
(``launching.startups``: a probe whose ranks stop at the test's setup, ``end_startup``) and handed
to later ranks, which track from their setup only (``startup``): their figure is
``max(start-up peak, start-up live + the job's peak)``. The job's capture does not see the
start-up's blocks, so what the job frees of them is not subtracted: the same excess at every
launch (docs/host.md). ``memory_interval_ms`` stays at memray's default: its thread's own
allocations are in the peak. The tracker runs only where its figure is gated (``gpumem_track_host``,
decided by the driver).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from . import MiB

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

METHOD = "live allocations (memray)"


def is_allocation_method(method: str) -> bool:
    return method.startswith("live allocations")


class AllocationTracker:
    """Starts memray's tracker in this process; ``stop()`` returns the peak in MiB (None if unavailable).

    The aggregated file format keeps the capture small (kilobytes, whatever the allocation count):
    only the high-water mark is read back.
    """

    def __init__(self, path: Path, sites: bool = False, root: Path | None = None, objects: bool = True) -> None:
        self.path = path
        self.objects = objects  # count Python's objects one by one (exact); False: by their 1 MiB arenas
        self.problem: str | None = None
        self.sites_wanted = sites  # also read the sites live at the peak and the live heap over time
        self.root = root  # sites are named relative to it (the rootdir)
        self.sites: list[dict[str, Any]] = []
        self.sites_problem: str | None = None
        self.timeline: list[tuple[float, float]] = []
        # (MiB live, MiB peak) of the rank's start-up, up to its test's setup: measured here by
        # ``end_startup`` (a probe), or handed in (the job's capture); None: one capture, the whole process.
        self.startup: tuple[float, float] | None = None
        self._tracker: Any = None

    def start(self) -> None:
        try:
            import memray
        except ImportError as exc:  # a dependency, but say so rather than crash the rank
            self.problem = f"memray is not importable ({exc})"
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        try:
            tracker = memray.Tracker(self.path, native_traces=False, follow_fork=False,
                                     trace_python_allocators=self.objects,
                                     file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
            tracker.__enter__()
        except Exception as exc:  # e.g. another tracker is active in this process
            self.problem = f"memray tracker did not start ({exc})"
            return
        self._tracker = tracker

    def end_startup(self) -> None:
        """End the capture here (a start-up probe, at its test's setup): what the start-up holds
        live and its peak go into ``startup``, in MiB."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None and self._close(tracker):
            self.startup = self._read(self.path, live=True)

    def stop(self) -> float | None:
        """The rank's figure: the peak of its live allocations, in MiB.

        Where the capture began at the test's setup, the start-up's figures handed in, it is
        ``max(start-up peak, start-up live + the job's peak)``: the job's capture counts what the
        job allocated and still holds, not what it freed of the start-up's.
        """
        if self._tracker is None:
            return None
        tracker, self._tracker = self._tracker, None
        if not self._close(tracker):
            return None
        job = self._read(self.path, sites=self.sites_wanted)
        if job is None:
            return None
        if self.startup is None:
            return job[1]
        live, startup_peak = self.startup
        self.timeline = [(t, live + mib) for t, mib in self.timeline]
        if startup_peak > live + job[1]:  # the peak was in the start-up, whose sites are not read
            self.sites = []
            return startup_peak
        return live + job[1]  # the sites are the job's own (the start-up's live bytes are not sites)

    def _close(self, tracker: Any) -> bool:
        try:
            tracker.__exit__(None, None, None)
        except Exception as exc:
            self.problem = f"memray capture not written ({exc})"
            return False
        return True

    def _read(self, path: Path, live: bool = False, sites: bool = False) -> tuple[float, float] | None:
        """(MiB live at the capture's end if ``live``, else 0; its peak MiB); the file is removed."""
        try:
            import memray

            try:  # only the header is needed: loading no RSS snapshots halves the read (~15 ms a rank)
                reader = memray.FileReader(path, report_progress=False, max_memory_records=1)
            except TypeError:  # memray 1.10 (the floor) has no max_memory_records
                reader = memray.FileReader(path)
            peak = float(reader.metadata.peak_memory) / MiB
            left = 0.0
            if live:
                left = sum(r.size for r in reader.get_leaked_allocation_records(merge_threads=True)) / MiB
            if sites:
                self._read_sites(path)
        except Exception as exc:
            self.problem = f"memray capture unreadable ({exc})"
            return None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        return left, peak

    def _read_sites(self, path: Path) -> None:
        """What was live at the high-water mark, by site, and the live heap over time (for plots)."""
        from .sites import memray_heap_timeline, memray_sites

        try:
            self.sites = [site.as_dict() for site in memray_sites(path, self.root)]
            self.timeline = memray_heap_timeline(path)
        except Exception as exc:  # noqa: BLE001 - an older memray: the peak stands without its sites
            self.sites_problem = f"memray sites unreadable ({exc})"
