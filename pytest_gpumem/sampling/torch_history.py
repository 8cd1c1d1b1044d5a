"""torch's CUDA allocator history -> the blocks live at the allocator's peak, and its curve over time.

``torch.cuda.memory._snapshot()`` holds the blocks live now (``segments[].blocks``, each with the
stack that allocated it) and a window of the allocator's events (``device_traces``: ``alloc``,
``free_requested``, ... with sizes, times and stacks). The allocator's own ``allocated_bytes`` moves
at ``alloc`` and at ``free_requested`` (a free that still waits on another stream is no longer
allocated: replaying ``free_completed`` instead overshoots the allocator's peak). Walking the
window backwards from the blocks live now gives the live set before every event, so the largest of
them and the blocks in it. History is recorded with ``context="alloc"``: a free event then carries
the stack that allocated the block, which is what a block freed inside the window needs.

Plain data in, plain data out: tested on snapshot dicts shaped like torch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import MiB
from .sites import Frame

_ALLOC, _FREE = "alloc", "free_requested"


@dataclass(frozen=True)
class Replay:
    """One device's allocator history, replayed."""

    peak_bytes: int  # the largest sum of live blocks in the window (requested sizes)
    blocks: tuple[tuple[tuple[Frame, ...], int], ...]  # (stack, bytes) live at that moment
    peak_time_s: float | None  # seconds since the epoch, when known
    timeline: tuple[tuple[float, float], ...] = field(default=())  # (epoch seconds, MiB live)
    window_events: int = 0
    addresses: tuple[int, ...] = ()  # each block's address, in the order of ``blocks``


def frames_of(raw: Any) -> tuple[Frame, ...]:
    """torch's ``[{"filename", "line", "name"}, ...]`` (innermost first) as memray-style frames."""
    out = []
    for frame in raw or ():
        if isinstance(frame, Mapping) and frame.get("filename"):
            out.append((str(frame.get("name", "?")), str(frame["filename"]), int(frame.get("line") or 0)))
    return tuple(out)


def _block_frames(block: Mapping[str, Any]) -> tuple[Frame, ...]:
    if "frames" in block:
        return frames_of(block["frames"])
    history = block.get("history") or []  # torch < 2.1 kept a history per block
    return frames_of(history[-1].get("frames")) if history else ()


def live_blocks(snapshot: Mapping[str, Any], device: int) -> dict[int, tuple[int, tuple[Frame, ...]]]:
    """``{address: (requested bytes, stack)}`` of the blocks allocated now on ``device``."""
    live = {}
    for segment in snapshot.get("segments") or ():
        if segment.get("device", 0) != device:
            continue
        for block in segment.get("blocks") or ():
            if block.get("state") == "active_allocated":
                size = int(block.get("requested_size") or block.get("size") or 0)
                live[int(block["address"])] = (size, _block_frames(block))
    return live


def replay(snapshot: Mapping[str, Any], device: int = 0, until_s: float | None = None) -> Replay:
    """The largest live set in the history window of ``device`` up to ``until_s`` (seconds since the
    epoch; None: up to now). Later events are undone but never counted (a test's teardown)."""
    traces = snapshot.get("device_traces") or []
    events: Sequence[Mapping[str, Any]] = traces[device] if device < len(traces) else []
    events = [e for e in events if e.get("action") in (_ALLOC, _FREE)]
    live = live_blocks(snapshot, device)
    current = sum(size for size, _ in live.values())

    def counted(i: int) -> bool:  # the state before event i began at event i-1 (or before the window)
        if until_s is None or i == 0:
            return True
        seconds = _seconds(events[i - 1])
        return seconds is None or seconds <= until_s

    best, best_at = (current, len(events)) if counted(len(events)) else (-1, len(events))
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        size = int(event.get("size") or 0)
        if event["action"] == _ALLOC:
            live.pop(int(event["addr"]), None)
            current -= size
        else:
            live[int(event["addr"])] = (size, frames_of(event.get("frames")))
            current += size
        if current > best and counted(i):
            best, best_at = current, i
    start = current  # live before the window's first event
    blocks = dict(live)  # the window's start; now play forward to the peak
    timeline: list[tuple[float, float]] = []
    running = start
    for i, event in enumerate(events):
        if i == best_at:
            break
        size = int(event.get("size") or 0)
        if event["action"] == _ALLOC:
            blocks[int(event["addr"])] = (size, frames_of(event.get("frames")))
        else:
            blocks.pop(int(event["addr"]), None)
    for event in events:
        running += int(event.get("size") or 0) * (1 if event["action"] == _ALLOC else -1)
        seconds = _seconds(event)
        if seconds is not None and (until_s is None or seconds <= until_s):
            timeline.append((seconds, running / MiB))
    peak_time = _seconds(events[best_at - 1]) if 0 < best_at <= len(events) else None
    grouped = tuple((frames, size) for size, frames in blocks.values())
    return Replay(max(best, 0), grouped, peak_time, tuple(timeline), len(events), tuple(blocks))


def _seconds(event: Mapping[str, Any]) -> float | None:
    value = event.get("time_us")
    return None if value is None else float(value) / 1e6
