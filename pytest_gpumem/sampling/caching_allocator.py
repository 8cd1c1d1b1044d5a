"""torch's CUDA caching allocator, replayed: what a job's allocations and frees reserve.

A GPU runs out of memory on what the allocator reserves, not on what the job holds: segments are
taken from the driver in 2 MiB (small pool, requests up to 1 MiB), 20 MiB (requests of 1-10 MiB) or
the request rounded up to 2 MiB, split into blocks and cached when freed, on the stream that
allocated them. This module follows ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.4 to 2.13, whose
policy is the same) over a trace of allocations and frees: best fit per pool and stream, 512-byte
rounding or ``roundup_power2_divisions``, splitting (``max_split_size_mb``, the oversize rounding),
``expandable_segments`` (pages of 2 MiB / 20 MiB mapped into one segment per stream), blocks freed
while another stream used them (``record_stream``) held until their event completes, ``empty_cache``,
the garbage collection under a memory fraction, and the free-and-retry path before an out-of-memory
error. Addresses are the replay's own; torch breaks ties between equal sizes by address, so a replay
can pick another block of the same size than the GPU did.

Plain data in, plain data out: no torch, no GPU.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from .alloc_conf import UNLIMITED, AllocConf

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 2**20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: the small pool's segment (and its expandable page)
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc: requests below it (over 1 MiB) take a 20 MiB segment
ROUND_LARGE = 2 * 2**20  # kRoundLarge


class AllocatorOutOfMemory(MemoryError):
    """The replayed allocator could not reserve a segment even after freeing its cache."""


def round_size(size: int, conf: AllocConf) -> int:
    """The block a request of ``size`` bytes takes (torch's ``round_size``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = conf.divisions(size)
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int, conf: AllocConf) -> int:
    """The segment a rounded request takes from the driver when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return conf.large_segment_size
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    addr: int
    size: int
    stream: int
    small: bool
    prev: int | None = None  # the neighbours' ids within the segment
    next: int | None = None
    allocated: bool = False
    requested: int = 0
    uses: set[int] = field(default_factory=set)  # other streams recorded on it (record_stream)
    pending: bool = False  # freed, its streams' events outstanding
    mapped: bool = True
    segment: int | None = None  # the expandable segment, if any
    gc_base: int = 0

    def free_to_merge(self) -> bool:
        return not self.allocated and not self.pending and not self.uses


@dataclass(frozen=True)
class AllocatorFigures:
    """What a replay reserved and allocated, in bytes."""

    allocated_peak: int
    reserved_peak: int
    reserved_at_allocated_peak: int
    requested_peak: int
    segments_peak: int
    num_alloc_retries: int
    num_ooms: int

    @property
    def fragmentation(self) -> float:
        """The share of the reserved peak the job's blocks never filled at their own peak."""
        return 1.0 - self.allocated_peak / self.reserved_peak if self.reserved_peak else 0.0


class _Heap:
    """The blocks, the segments and the free lists: what the policy (``CachingAllocator``) moves."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: dict[int, _Block] = {}
        self.free: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}  # (small, stream) -> (size, addr, id)
        self.unmapped: dict[tuple[bool, int], list[tuple[int, int]]] = {}  # (small, stream) -> (addr, id)
        self.segments: dict[int, tuple[int, int]] = {}  # expandable segment -> (base address, page)
        self.reserved = 0
        self.count = 0  # segments (expandable: mapped pages count as reserved, not as segments)
        self.calls: dict[bool, int] = {True: 0, False: 0}  # get_free_block calls per pool (the GC's clock)
        self._next_id = 0
        self._next_addr = 1 << 20
        self.placed: int | None = None  # the GPU's address for the next cudaMalloc'd segment, when known

    def new(self, addr: int, size: int, stream: int, small: bool, segment: int | None = None) -> int:
        self._next_id += 1
        self.blocks[self._next_id] = _Block(addr, size, stream, small, segment=segment)
        return self._next_id

    def address_space(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-size // SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER
        return addr

    def insert(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.mapped:
            block.gc_base = self.calls[block.small]
            insort(self.free.setdefault((block.small, block.stream), []), (block.size, block.addr, bid))
        else:
            insort(self.unmapped.setdefault((block.small, block.stream), []), (block.addr, bid))

    def remove(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.mapped:
            entries = self.free[(block.small, block.stream)]
            entries.pop(bisect_left(entries, (block.size, block.addr, bid)))
        else:
            unmapped = self.unmapped[(block.small, block.stream)]
            unmapped.pop(bisect_left(unmapped, (block.addr, bid)))

    def merge(self, dst: int, src: int | None) -> int:
        """``src`` (a free neighbour of ``dst``) joined to ``dst``; the bytes it added (0: none)."""
        into = self.blocks[dst]
        if src is None or not self.blocks[src].free_to_merge() or self.blocks[src].mapped != into.mapped:
            return 0
        gone = self.blocks[src]
        self.remove(src)
        if into.prev == src:
            into.addr, into.prev = gone.addr, gone.prev
            if gone.prev is not None:
                self.blocks[gone.prev].next = dst
        else:
            into.next = gone.next
            if gone.next is not None:
                self.blocks[gone.next].prev = dst
        into.size += gone.size
        del self.blocks[src]
        return gone.size

    def split(self, bid: int, size: int) -> int:
        """The first ``size`` bytes of free block ``bid`` as a new block; ``bid`` keeps the rest, cached."""
        rest = self.blocks[bid]
        head = self.new(rest.addr, size, rest.stream, rest.small, rest.segment)
        block = self.blocks[head]
        block.prev, block.next = rest.prev, bid
        if rest.prev is not None:
            self.blocks[rest.prev].next = head
        rest.prev, rest.addr, rest.size = head, rest.addr + size, rest.size - size
        self.insert(bid)
        return head

    def segment(self, size: int, stream: int, small: bool) -> int | None:
        """A new cudaMalloc'd segment (None: over the capacity), at the GPU's address where it is known."""
        if self.reserved + size > self.capacity:
            return None
        self.reserved += size
        self.count += 1
        addr = self.address_space(size) if self.placed is None else self.placed
        self.placed = None
        return self.new(addr, size, stream, small)

    def release(self, bid: int) -> None:
        """cudaFree of a whole cached segment."""
        self.remove(bid)
        self.reserved -= self.blocks.pop(bid).size
        self.count -= 1

    # -- expandable segments ----------------------------------------------------------------------

    def expandable(self, stream: int, small: bool, size: int, page: int) -> int:
        """The lowest free-and-unmapped run of ``size`` bytes on the stream's segments, or a new segment."""
        def allocatable(bid: int | None) -> bool:
            return bid is not None and self.blocks[bid].free_to_merge()

        for _, bid in self.unmapped.get((small, stream), []):
            start = self.blocks[bid].prev if allocatable(self.blocks[bid].prev) else bid
            run, at = 0, start
            while run < size and allocatable(at):
                assert at is not None
                run, at = run + self.blocks[at].size, self.blocks[at].next
            if run >= size and start is not None:
                return start
        span = -(-(self.capacity + self.capacity // 8) // page) * page
        base = self.address_space(span)
        seg = len(self.segments) + 1
        self.segments[seg] = (base, page)
        bid = self.new(base, span, stream, small, seg)
        self.blocks[bid].mapped = False
        self.insert(bid)
        return bid

    def map(self, bid: int, size: int) -> bool:
        """Pages mapped under the first ``size`` bytes of unmapped block ``bid``; joined to free neighbours."""
        block = self.blocks[bid]
        assert block.segment is not None
        base, page = self.segments[block.segment]
        mapped = (-(-(block.addr + size - base) // page) - (block.addr - base) // page) * page
        if self.reserved + mapped > self.capacity:
            return False
        self.remove(bid)
        block.mapped = True
        if mapped < block.size:
            rest = self.new(block.addr + mapped, block.size - mapped, block.stream, block.small, block.segment)
            self.blocks[rest].mapped, self.blocks[rest].prev, self.blocks[rest].next = False, bid, block.next
            if block.next is not None:
                self.blocks[block.next].prev = rest
            block.next, block.size = rest, mapped
            self.insert(rest)
        self.merge(bid, block.prev)
        self.merge(bid, block.next)
        self.insert(bid)
        self.reserved += mapped
        return True

    def unmap(self, bid: int) -> None:
        """The whole pages inside free block ``bid`` given back to the driver."""
        block = self.blocks[bid]
        assert block.segment is not None
        base, page = self.segments[block.segment]
        begin = base + -(-(block.addr - base) // page) * page
        end = base + (block.addr + block.size - base) // page * page
        if end <= begin:
            return
        self.remove(bid)
        for start, stop, before in ((block.addr, begin, True), (end, block.addr + block.size, False)):
            if stop > start:
                piece = self.new(start, stop - start, block.stream, block.small, block.segment)
                near = block.prev if before else block.next
                self.blocks[piece].prev, self.blocks[piece].next = (near, bid) if before else (bid, near)
                if near is not None:
                    setattr(self.blocks[near], "next" if before else "prev", piece)
                if before:
                    block.prev = piece
                else:
                    block.next = piece
                self.insert(piece)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.merge(bid, block.prev)
        self.merge(bid, block.next)
        self.insert(bid)
        self.reserved -= end - begin


class CachingAllocator:
    """One device's caching allocator, driven by a job's ``malloc``/``free`` (ids in, ids out)."""

    def __init__(self, conf: AllocConf | None = None, capacity: int = 1 << 60,
                 memory_fraction: float | None = None, settle_at_malloc: bool = True) -> None:
        self.conf = conf or AllocConf()
        self.heap = _Heap(capacity)
        self.allowed = int(capacity * memory_fraction) if memory_fraction is not None else None
        self.settle_at_malloc = settle_at_malloc  # a freed block's other-stream work is done by the next malloc
        self.allocated = self.requested = 0
        self.peaks = {"allocated": 0, "reserved": 0, "reserved_at_allocated": 0, "requested": 0, "segments": 0}
        self.retries = self.ooms = 0
        self._pending: list[int] = []

    # -- the job's calls --------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """The id of the block a request of ``size`` bytes gets on ``stream``."""
        if self.settle_at_malloc:
            self.settle()
        rounded = round_size(size, self.conf)
        small = rounded <= SMALL_SIZE
        bid = self._cached(rounded, stream, small)
        if bid is None:
            if self.allowed is not None and self.conf.garbage_collection_threshold > 0.0:
                self._collect()
            bid = self._reserve(rounded, stream, small)
            if bid is None and self._release_oversize(rounded, stream, small):
                bid = self._reserve(rounded, stream, small)
            if bid is None:
                self.empty_cache()
                self.retries += 1
                bid = self._reserve(rounded, stream, small)
            if bid is None:
                self.ooms += 1
                raise AllocatorOutOfMemory(f"tried to allocate {rounded} bytes with {self.allocated} allocated "
                                           f"and {self.heap.reserved} reserved of {self.heap.capacity}")
        block = self.heap.blocks[bid]
        remaining = block.size - rounded
        if block.small or self.conf.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = rounded < self.conf.max_split_size and remaining > SMALL_SIZE
        if split:
            bid = self.heap.split(bid, rounded)
        return self._hand_out(bid, size)

    def free(self, bid: int) -> None:
        """The job frees block ``bid``: cached now, or once the streams recorded on it are done."""
        block = self.heap.blocks[bid]
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        if block.uses:
            block.uses, block.pending = set(), True
            self._pending.append(bid)
        else:
            self._cache(bid)

    def record_stream(self, bid: int, stream: int) -> None:
        """``Tensor.record_stream``: the block is used on ``stream`` too (its own stream needs nothing)."""
        block = self.heap.blocks[bid]
        if stream != block.stream:
            block.uses.add(stream)

    def complete(self, bid: int) -> None:
        """The events of a block freed with other streams' uses have completed: it is cached."""
        if bid in self._pending:
            self._pending.remove(bid)
            self.heap.blocks[bid].pending = False
            self._cache(bid)

    def settle(self) -> None:
        """Every outstanding event completed (``process_events`` on an idle GPU, or a synchronize)."""
        for bid in list(self._pending):
            self.complete(bid)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: events synchronized, every unsplit cached segment freed (and
        the whole free pages of expandable segments unmapped)."""
        self.settle()
        for entries in list(self.heap.free.values()):
            for _, _, bid in list(entries):
                block = self.heap.blocks.get(bid)
                if block is None or not block.mapped:
                    continue
                if block.segment is not None:
                    self.heap.unmap(bid)
                elif block.prev is None and block.next is None:
                    self.heap.release(bid)

    def place_next_segment(self, addr: int | None) -> None:
        """The GPU's address of the segment the next allocation takes: torch breaks ties between cached
        blocks of one size by address (``BlockComparatorSize``), so a replay that knows the GPU's
        addresses picks the block the GPU picked."""
        self.heap.placed = addr

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``."""
        self.peaks = {"allocated": self.allocated, "reserved": self.heap.reserved,
                      "reserved_at_allocated": self.heap.reserved, "requested": self.requested,
                      "segments": self.heap.count}

    def figures(self) -> AllocatorFigures:
        peaks = self.peaks
        return AllocatorFigures(peaks["allocated"], peaks["reserved"], peaks["reserved_at_allocated"],
                                peaks["requested"], peaks["segments"], self.retries, self.ooms)

    # -- inside -----------------------------------------------------------------------------------

    def _cached(self, size: int, stream: int, small: bool) -> int | None:
        """``get_free_block``: the smallest cached block that fits, within the oversize rules."""
        heap, conf = self.heap, self.conf
        heap.calls[small] += 1
        entries = heap.free.get((small, stream), [])
        at = bisect_left(entries, (size, 0, 0))
        if at == len(entries):
            return None
        bid = entries[at][2]
        if heap.blocks[bid].segment is not None:
            if not conf.expandable_segments:
                at = next((i for i in range(at, len(entries)) if heap.blocks[entries[i][2]].segment is None),
                          len(entries))
                if at == len(entries):
                    return None
            else:
                while at + 1 < len(entries) and heap.blocks[entries[at][2]].segment is not None \
                        and self._room(entries[at + 1][2]) < self._room(entries[at][2]):
                    at += 1
            bid = entries[at][2]
        found = heap.blocks[bid].size
        if size < conf.max_split_size <= found:
            return None  # an oversize block is not split for a smaller request
        if size >= conf.max_split_size and found >= size + conf.max_non_split_rounding:
            return None
        heap.remove(bid)
        return bid

    def _room(self, bid: int) -> int:
        """A block's size with the unmapped space right after it (expandable best fit)."""
        block = self.heap.blocks[bid]
        after = self.heap.blocks[block.next] if block.next is not None else None
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _reserve(self, size: int, stream: int, small: bool) -> int | None:
        """``alloc_block``: a new segment (or pages of an expandable one); None where the device is full."""
        heap, wanted = self.heap, segment_size(size, self.conf)
        if self.allowed is not None and heap.reserved + wanted > self.allowed:
            return None  # the memory fraction: checked on the segment size, expandable or not
        if self.conf.expandable_segments:
            page = SMALL_BUFFER if small else self.conf.large_segment_size
            bid = heap.expandable(stream, small, size, page)
            if not heap.blocks[bid].mapped and not heap.map(bid, min(heap.blocks[bid].size, size)):
                return None
            while heap.blocks[bid].size < size:
                after = heap.blocks[bid].next
                assert after is not None
                if not heap.map(after, min(size - heap.blocks[bid].size, heap.blocks[after].size)):
                    return None
                bid = after
            heap.remove(bid)
        else:
            found = heap.segment(wanted, stream, small)
            if found is None:
                return None
            bid = found
        self._peak()
        return bid

    def _release_oversize(self, size: int, stream: int, small: bool) -> bool:
        """``release_available_cached_blocks``: free cached oversize segments, enough for ``size``."""
        limit = self.conf.max_split_size
        if limit == UNLIMITED:
            return False
        entries = self.heap.free.get((small, stream), [])
        key = max(size, limit)
        at = bisect_left(entries, (key, 0, 0))
        if at < len(entries):
            self._release_unsplit(entries[at][2])
            return True
        released = 0
        for block_size, _, bid in reversed(list(entries)):
            if released >= key or block_size < limit:
                break
            released += block_size
            self._release_unsplit(bid)
        return released >= key

    def _release_unsplit(self, bid: int) -> None:
        block = self.heap.blocks[bid]
        if block.segment is None and block.prev is None and block.next is None:
            self.heap.release(bid)

    def _collect(self) -> None:
        """``garbage_collect_cached_blocks``: past the threshold of the allowed memory, free the cached
        unsplit large segments idle for longer than their average, until enough is back."""
        assert self.allowed is not None
        heap = self.heap
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if heap.reserved <= threshold:
            return
        target, reclaimed = heap.reserved - threshold, 0
        ages = {bid: heap.calls[False] - heap.blocks[bid].gc_base for entries in
                [v for k, v in heap.free.items() if not k[0]] for _, _, bid in entries
                if heap.blocks[bid].prev is None and heap.blocks[bid].next is None
                and heap.blocks[bid].segment is None}
        while reclaimed < target and ages:
            average = sum(ages.values()) / len(ages)
            old = [bid for bid, age in ages.items() if age >= average]
            if not old:
                break
            for bid in old:
                reclaimed += heap.blocks[bid].size
                del ages[bid]
                heap.release(bid)

    def _hand_out(self, bid: int, size: int) -> int:
        block = self.heap.blocks[bid]
        block.allocated, block.requested = True, size
        self.allocated += block.size
        self.requested += size
        self._peak()
        return bid

    def _cache(self, bid: int) -> None:
        """``free_block``: joined to its free neighbours and cached."""
        block = self.heap.blocks[bid]
        self.heap.merge(bid, block.prev)
        self.heap.merge(bid, block.next)
        self.heap.insert(bid)

    def _peak(self) -> None:
        peaks = self.peaks
        if self.allocated > peaks["allocated"]:
            peaks["allocated"], peaks["reserved_at_allocated"] = self.allocated, self.heap.reserved
        peaks["reserved"] = max(peaks["reserved"], self.heap.reserved)
        peaks["requested"] = max(peaks["requested"], self.requested)
        peaks["segments"] = max(peaks["segments"], self.heap.count)


# (action, handle, size, stream); action: alloc, free, record_stream, complete, empty_cache, reset_peak,
# segment_at (the GPU's address of the next segment, in the size field)
Event = Sequence


def replay_allocator(events: Iterable[Event], conf: AllocConf | None = None, capacity: int = 1 << 60,
                     settle_at_malloc: bool = False) -> AllocatorFigures:
    """The allocator's figures over ``events``. A handle names one allocation from its ``alloc`` to its
    ``free`` (and ``complete``, for a block freed while another stream used it); where no ``complete``
    comes, ``settle_at_malloc`` completes such a block's events at the next allocation."""
    allocator = CachingAllocator(conf, capacity, settle_at_malloc=settle_at_malloc)
    for _ in _replayed(allocator, events):
        pass
    return allocator.figures()


def _replayed(allocator: CachingAllocator, events: Iterable[Event]) -> Iterator[str]:
    """Drives ``allocator`` through ``events``, yielding each event's action once it is done."""
    ids: dict[int, int] = {}
    waiting: dict[int, int] = {}
    for action, handle, size, stream in events:
        if action == "alloc":
            ids[handle] = allocator.malloc(size, stream)
            allocator.place_next_segment(None)  # a replay that took no segment here places no later one
        elif action == "segment_at":
            allocator.place_next_segment(size)
        elif action == "free":
            bid = ids.pop(handle)
            allocator.free(bid)
            if allocator.heap.blocks[bid].pending:
                waiting[handle] = bid
        elif action == "record_stream":
            allocator.record_stream(ids[handle], stream)
        elif action == "complete" and handle in waiting:
            allocator.complete(waiting.pop(handle))
        elif action == "empty_cache":
            allocator.empty_cache()
        elif action == "reset_peak":
            allocator.reset_peak()
        yield action


def first_divergence(snapshot: dict, conf: AllocConf | None = None, device: int = 0) -> str | None:
    """Where a replay of a ``torch.cuda.memory._snapshot()`` history first reserves otherwise than the GPU
    did (its own segment events say what it reserved by each allocation); None where never. Where the
    replay is off, this names the allocation to look at."""
    traced, reserved = [], 0
    requests: list[tuple[int, int]] = []
    for event in (snapshot.get("device_traces") or [[]])[device]:
        action = event.get("action")
        if action in ("segment_alloc", "segment_map"):
            reserved += int(event["size"])
        elif action in ("segment_free", "segment_unmap"):
            reserved -= int(event["size"])
        elif action == "alloc":
            traced.append(reserved)
            requests.append((int(event["size"]), int(event.get("stream") or 0)))
    allocator = CachingAllocator(conf, settle_at_malloc=False)
    done = 0
    for action in _replayed(allocator, trace_events(snapshot, device)):
        if action != "alloc":
            continue
        if allocator.heap.reserved != traced[done]:
            size, stream = requests[done]
            return (f"allocation {done + 1} of {len(traced)} ({size} bytes, stream {stream}): the GPU had "
                    f"{traced[done]} bytes reserved, the replay {allocator.heap.reserved}")
        done += 1
    return None


def trace_events(snapshot: dict, device: int = 0) -> list[tuple[str, int, int, int]]:
    """The events of a ``torch.cuda.memory._snapshot()`` history (recorded from the job's start), for
    ``replay_allocator``. A free whose ``free_completed`` does not follow at once waited on another
    stream's event (``record_stream``): it completes where the trace says. A segment allocated is
    ``segment_at`` its address (the ``size`` field), for the replay's ties. A run of segments freed
    is replayed as ``empty_cache`` (the retry path before an OOM frees the same cached segments,
    unless ``max_split_size_mb`` or a garbage-collection threshold is set)."""
    trace = (snapshot.get("device_traces") or [[]])[device]
    out: list[tuple[str, int, int, int]] = []
    live: dict[int, int] = {}
    waiting: dict[int, int] = {}
    streams: dict[int, int] = {}
    released = False
    for i, event in enumerate(trace):
        action, addr = event.get("action"), int(event.get("addr") or 0)
        if action in ("segment_free", "segment_unmap"):
            if not released:
                out.append(("empty_cache", 0, 0, 0))
            released = True
            continue
        released = released and action == "free_completed"
        if action == "segment_alloc":
            out.append(("segment_at", 0, addr, 0))
        elif action == "alloc":
            live[addr] = handle = len(out) + 1  # unique: one event is added per handle
            stream = streams.setdefault(int(event.get("stream") or 0), len(streams))
            out.append(("alloc", handle, int(event["size"]), stream))
        elif action == "free_requested" and addr in live:
            handle = live.pop(addr)
            after = trace[i + 1] if i + 1 < len(trace) else {}
            if after.get("action") != "free_completed" or int(after.get("addr") or 0) != addr:
                out.append(("record_stream", handle, 0, -1))
                waiting[addr] = handle
            out.append(("free", handle, 0, 0))
        elif action == "free_completed" and addr in waiting:
            out.append(("complete", waiting.pop(addr), 0, 0))
    return out


def traced_reserved_peak(snapshot: dict, device: int = 0) -> int:
    """The reserved peak the history itself shows: segments allocated or mapped, less those freed."""
    reserved = peak = 0
    for event in (snapshot.get("device_traces") or [[]])[device]:
        action = event.get("action")
        if action in ("segment_alloc", "segment_map"):
            reserved += int(event["size"])
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= int(event["size"])
    return peak
