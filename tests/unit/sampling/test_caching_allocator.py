"""torch's caching allocator replayed: each rule of ``CUDACachingAllocator.cpp`` on a hand-built trace
whose reserved figure follows from that rule alone; ``PYTORCH_CUDA_ALLOC_CONF`` parsed as torch does.
(The replay against a GPU's own figures: benchmarks/allocator_replay.py.)"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable

import pytest

from pytest_gpumem.sampling.alloc_conf import AllocConf, AllocConfError, alloc_conf_from_env, parse_alloc_conf
from pytest_gpumem.sampling.caching_allocator import (
    AllocatorOutOfMemory,
    CachingAllocator,
    first_divergence,
    replay_allocator,
    round_size,
    trace_events,
    traced_reserved_peak,
)

KiB, MiB = 2**10, 2**20
# Settings torch's parser and ours both read; sizes across its 16 power-of-two intervals and past them.
SETTINGS = ["roundup_power2_divisions:4", "roundup_power2_divisions:[256:4,>:1]",
            "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", "roundup_power2_divisions:[1:2,4096:0,>:4]",
            "max_split_size_mb:64,roundup_power2_divisions:[64:8,>:2],expandable_segments:True"]
SIZES = [1, 511, 512 * KiB, MiB, 3 * MiB // 2, 2 * MiB, 100 * MiB, 255 * MiB, 300 * MiB, 600 * MiB, 2**35,
         2**36, 2**40]


def test_requests_round_to_512_bytes_and_small_ones_share_a_2_mib_segment():
    """torch's ``round_size`` (multiples of kMinBlockSize, 512) and ``get_allocation_size`` (a request up
    to kSmallSize, 1 MiB, takes a kSmallBuffer, 2 MiB, segment of the small pool)."""
    allocator = CachingAllocator()
    first, _ = allocator.malloc(1), allocator.malloc(1000)
    assert allocator.allocated == 512 + 1024
    assert allocator.heap.reserved == 2 * MiB
    allocator.free(first)
    allocator.malloc(300)  # the freed 512 bytes again, no new segment
    assert (allocator.heap.reserved, allocator.heap.count) == (2 * MiB, 1)


def test_a_request_over_1_mib_never_takes_the_small_pool():
    """``get_pool``: ``size <= kSmallSize`` picks the small pool, anything larger the large one."""
    allocator = CachingAllocator()
    allocator.malloc(1 * MiB)  # the largest small request: a 2 MiB segment
    allocator.malloc(1 * MiB + 512)  # one byte-block more: the large pool's 20 MiB segment
    assert allocator.heap.reserved == 22 * MiB


def test_requests_of_1_to_10_mib_split_one_20_mib_segment():
    """``get_allocation_size``: under kMinLargeAlloc (10 MiB) a large request takes kLargeBuffer (20 MiB,
    ``large_segment_size()`` in torch 2.9+); ``should_split`` splits it while more than 1 MiB remains."""
    allocator = CachingAllocator()
    for _ in range(6):
        allocator.malloc(3 * MiB)  # 6 x 3 MiB = 18 MiB in one segment, 2 MiB left over
    assert allocator.heap.reserved == 20 * MiB
    allocator.malloc(3 * MiB)  # the 2 MiB remainder does not fit: a second segment
    assert allocator.heap.reserved == 40 * MiB


def test_a_large_request_takes_its_size_rounded_up_to_2_mib():
    """``get_allocation_size``: from kMinLargeAlloc on, the request rounded up to kRoundLarge (2 MiB)."""
    allocator = CachingAllocator()
    allocator.malloc(10 * MiB + 1)
    assert allocator.heap.reserved == 12 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    """``should_split`` on the large pool: ``remaining > kSmallSize``; below it the whole block is handed out
    (``alloc_found_block``) and counts as allocated."""
    allocator = CachingAllocator()
    big = allocator.malloc(12 * MiB)
    allocator.free(big)
    allocator.malloc(11 * MiB + 512)  # fits the cached 12 MiB, leaving under 1 MiB: the whole block
    assert allocator.allocated == 12 * MiB
    allocator.free(allocator.malloc(2 * MiB))  # so nothing is left to serve this: a new segment
    assert allocator.heap.reserved == 32 * MiB


def test_freed_neighbours_merge_back_into_one_block():
    """``free_block`` calls ``try_merge_blocks`` on both neighbours: a freed segment is one block again."""
    allocator = CachingAllocator()
    parts = [allocator.malloc(5 * MiB) for _ in range(4)]  # one 20 MiB segment, split in four
    for part in parts:
        allocator.free(part)
    allocator.malloc(19 * MiB)  # only a merged 20 MiB block serves it
    assert allocator.heap.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    """``get_free_block``: ``pool.blocks.lower_bound`` on (stream, size): the smallest block that fits."""
    allocator = CachingAllocator()
    small, large = allocator.malloc(12 * MiB), allocator.malloc(40 * MiB)
    allocator.free(small)
    allocator.free(large)
    allocator.malloc(12 * MiB)
    allocator.malloc(40 * MiB)  # still cached: the 12 MiB request did not split it
    assert allocator.heap.reserved == 52 * MiB


def test_ties_between_equal_sizes_break_at_the_lower_address_the_gpu_gave():
    """``BlockComparatorSize``: stream, size, then address; a replay told the GPU's segment addresses
    (``segment_at``, from the history's ``segment_alloc``) hands out the block the GPU did."""
    allocator = CachingAllocator()
    allocator.place_next_segment(5 << 30)
    first = allocator.malloc(12 * MiB)
    allocator.place_next_segment(1 << 30)
    second = allocator.malloc(12 * MiB)
    allocator.free(first)
    allocator.free(second)
    assert allocator.malloc(12 * MiB) == second  # at the lower address, though allocated later
    unplaced = CachingAllocator()
    blocks = [unplaced.malloc(12 * MiB) for _ in range(2)]
    for block in blocks:
        unplaced.free(block)
    assert unplaced.malloc(12 * MiB) == blocks[0]  # the replay's own addresses grow with each segment


def test_each_stream_has_its_own_cached_blocks():
    """``BlockComparatorSize`` orders by stream first and ``get_free_block`` refuses a block of another
    stream: a block freed on one stream is never reused on another."""
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(12 * MiB, stream=0))
    allocator.malloc(12 * MiB, stream=1)  # the block cached on stream 0 is not reused on stream 1
    assert allocator.heap.reserved == 24 * MiB
    allocator.malloc(12 * MiB, stream=0)
    assert allocator.heap.reserved == 24 * MiB


def test_a_block_used_on_another_stream_is_cached_only_once_its_event_completes():
    """``recordStream`` adds the stream to ``stream_uses``; ``free`` then calls ``insert_events`` instead of
    ``free_block``, and the block is cached when ``process_events`` sees its event complete."""
    allocator = CachingAllocator(settle_at_malloc=False)
    block = allocator.malloc(12 * MiB)
    allocator.record_stream(block, 1)
    allocator.free(block)
    allocator.malloc(12 * MiB)  # the event is outstanding: a new segment
    assert allocator.heap.reserved == 24 * MiB
    allocator.complete(block)
    allocator.malloc(12 * MiB)
    assert allocator.heap.reserved == 24 * MiB


def test_a_use_on_the_allocating_stream_needs_no_event():
    """``recordStream`` ignores the block's own stream ('ignore uses on the allocation stream')."""
    allocator = CachingAllocator(settle_at_malloc=False)
    block = allocator.malloc(12 * MiB)
    allocator.record_stream(block, 0)
    allocator.free(block)
    allocator.malloc(12 * MiB)
    assert allocator.heap.reserved == 12 * MiB


def test_empty_cache_frees_whole_cached_segments_and_keeps_split_ones():
    """``emptyCache`` -> ``release_cached_blocks`` -> ``release_blocks``: only blocks with neither ``prev`` nor
    ``next`` (a whole segment) are ``release_block``'d (cudaFree)."""
    allocator = CachingAllocator()
    whole, part = allocator.malloc(12 * MiB), allocator.malloc(3 * MiB)
    allocator.free(whole)
    allocator.empty_cache()
    assert allocator.heap.reserved == 20 * MiB  # the 20 MiB segment holding the live 3 MiB stays
    allocator.free(part)
    allocator.empty_cache()
    assert allocator.heap.reserved == 0
    assert allocator.figures().reserved_peak == 32 * MiB


def test_max_split_size_keeps_oversize_blocks_whole_and_rounds_within_the_limit():
    """``get_free_block``: 'Do not return an oversized block for a large request' (request under
    ``max_split_size``, block at or over it); ``should_split`` never splits for a request at or over it."""
    conf = parse_alloc_conf("max_split_size_mb:20")
    allocator = CachingAllocator(conf)
    allocator.free(allocator.malloc(64 * MiB))
    allocator.malloc(12 * MiB)  # under max_split_size: an oversize block is not handed out
    assert allocator.heap.reserved == 76 * MiB
    allocator.malloc(50 * MiB)  # oversize, and 64 < 50 + 20: the cached 64 MiB serves it, whole
    assert (allocator.heap.reserved, allocator.allocated) == (76 * MiB, 76 * MiB)
    unlimited = CachingAllocator()
    unlimited.free(unlimited.malloc(64 * MiB))
    unlimited.malloc(12 * MiB)  # without the setting the 64 MiB block is split
    assert unlimited.heap.reserved == 64 * MiB


def test_oversize_rounding_refuses_a_block_20_mib_larger_than_the_request():
    """``get_free_block``: an oversize block serves a request only while ``block < request +
    max_non_split_rounding_size()`` (kLargeBuffer, 20 MiB, by default)."""
    allocator = CachingAllocator(parse_alloc_conf("max_split_size_mb:20"))
    allocator.free(allocator.malloc(64 * MiB))
    allocator.malloc(44 * MiB)  # 64 >= 44 + 20: not served by the cached block
    assert allocator.heap.reserved == 108 * MiB


def test_roundup_power2_divisions_rounds_to_the_next_division():
    """``round_size`` -> ``roundup_power2_next_division`` (torch's own example: 1200 in 4 divisions is 1280);
    the bracket form as ``AllocatorConfig::parseRoundUpPower2Divisions`` fills its 16 intervals."""
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * KiB, conf) == 1280 * KiB  # between 1024 and 2048 KiB in steps of 256
    assert round_size(1024 * KiB, conf) == 1024 * KiB  # a power of two stays
    assert round_size(1200 * KiB, AllocConf()) == 1200 * KiB
    bracket = parse_alloc_conf("roundup_power2_divisions:[256:4,>:1]")
    assert round_size(300 * MiB, bracket) == 320 * MiB  # the interval from 256 MiB: 4 divisions of 64 MiB
    assert round_size(200 * MiB, bracket) == 224 * MiB  # 128-256 MiB: the first key fills those below it
    assert round_size(600 * MiB, bracket) == 600 * MiB  # from 512 MiB on ('>'): 1, 512-byte rounding


def test_expandable_segments_map_20_mib_pages_into_one_segment_per_stream():
    """``alloc_block`` with expandable segments -> ``try_allocate_expandable_block`` -> ``map_block``: pages of
    kLargeBuffer (20 MiB) for the large pool; no cudaMalloc'd segment; ``release_blocks`` unmaps
    (``unmap_block``) the whole free pages."""
    allocator = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    blocks = [allocator.malloc(12 * MiB) for _ in range(3)]  # 36 MiB in pages of 20 MiB
    assert (allocator.heap.reserved, allocator.heap.count) == (40 * MiB, 0)
    plain = CachingAllocator()
    for _ in range(3):
        plain.malloc(12 * MiB)
    assert plain.heap.reserved == 36 * MiB
    for block in blocks:
        allocator.free(block)
    allocator.empty_cache()  # every page free again: unmapped
    assert allocator.heap.reserved == 0


def test_expandable_segments_reuse_a_freed_run_before_mapping_more():
    """``find_expandable_block`` returns the lowest address with enough free-and-unmapped room; the freed run
    at the start of the segment is mapped memory already and ``get_free_block`` finds it first."""
    allocator = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    first = allocator.malloc(30 * MiB)
    allocator.malloc(8 * MiB)
    allocator.free(first)
    allocator.malloc(30 * MiB)  # the freed 30 MiB at the start of the segment
    assert allocator.heap.reserved == 40 * MiB


def test_an_allocation_over_the_capacity_frees_the_cache_and_retries():
    """``malloc``: ``alloc_block`` fails -> ``release_cached_blocks`` -> ``alloc_block(isRetry=true)``, which
    counts ``num_alloc_retries``; failing again is the OutOfMemoryError (``num_ooms``)."""
    allocator = CachingAllocator(capacity=40 * MiB)
    allocator.free(allocator.malloc(24 * MiB))
    allocator.malloc(30 * MiB)  # 24 + 30 > 40: the cached 24 MiB segment is released, then it fits
    figures = allocator.figures()
    assert (allocator.heap.reserved, figures.num_alloc_retries, figures.reserved_peak) == (30 * MiB, 1, 30 * MiB)
    with pytest.raises(AllocatorOutOfMemory, match="tried to allocate"):
        allocator.malloc(12 * MiB)
    assert allocator.figures().num_ooms == 1


def test_garbage_collection_frees_idle_segments_past_the_threshold():
    """``garbage_collect_cached_blocks``, called by ``malloc`` on a cache miss only while a memory fraction is
    set (``set_fraction``): past ``threshold * allowed_memory_maximum`` it releases the unsplit large
    blocks whose ``gc_count`` is at least the average, until the excess is back."""
    conf = parse_alloc_conf("garbage_collection_threshold:0.5")  # of the allowed 200 MiB: 100 MiB
    allocator = CachingAllocator(conf, capacity=200 * MiB, memory_fraction=1.0)
    allocator.free(allocator.malloc(60 * MiB))
    allocator.malloc(70 * MiB)  # a cache miss with 60 MiB reserved, under 100 MiB: no collection
    assert allocator.heap.reserved == 130 * MiB
    allocator.malloc(64 * MiB)  # a miss at 130 MiB: the idle 60 MiB segment goes before a new one
    assert allocator.heap.reserved == 134 * MiB
    for plain in (CachingAllocator(capacity=200 * MiB, memory_fraction=1.0),  # no threshold
                  CachingAllocator(conf, capacity=200 * MiB)):  # a threshold, no memory fraction
        plain.free(plain.malloc(60 * MiB))
        plain.malloc(70 * MiB)
        plain.malloc(64 * MiB)
        assert plain.heap.reserved == 194 * MiB


def test_a_small_block_splits_down_to_a_remainder_of_512_bytes():
    """``should_split`` on the small pool: ``remaining >= kMinBlockSize``, where the large pool needs more
    than 1 MiB left."""
    allocator = CachingAllocator()
    allocator.malloc(1 * MiB)
    allocator.malloc(1 * MiB - 512)  # leaves 512 bytes of the 2 MiB segment: split off and cached
    allocator.malloc(100)  # served by those 512 bytes
    assert (allocator.heap.reserved, allocator.heap.count, allocator.allocated) == (2 * MiB, 1, 2 * MiB)


def test_cached_oversize_segments_are_released_before_the_whole_cache():
    """``malloc``'s first fallback, ``release_available_cached_blocks``: with ``max_split_size`` set, the
    smallest cached oversize block of at least max(request, max_split_size) is cudaFree'd and the
    allocation tried again, without counting a retry and without freeing the other cached segments."""
    allocator = CachingAllocator(parse_alloc_conf("max_split_size_mb:20"), capacity=100 * MiB)
    allocator.free(allocator.malloc(64 * MiB))  # oversize
    allocator.free(allocator.malloc(12 * MiB))  # under max_split_size: not released by this path
    allocator.malloc(40 * MiB)  # 64 >= 40 + 20: no cached block serves it; 76 + 40 > 100
    assert (allocator.heap.reserved, allocator.figures().num_alloc_retries) == (52 * MiB, 0)


def test_a_freed_blocks_event_is_processed_at_the_next_malloc():
    """``malloc`` begins with ``process_events``: a block freed while another stream used it is cached
    once its event has completed (here: at once, as on an idle GPU)."""
    allocator = CachingAllocator()
    block = allocator.malloc(12 * MiB)
    allocator.record_stream(block, 1)
    allocator.free(block)
    allocator.malloc(12 * MiB)
    assert allocator.heap.reserved == 12 * MiB


def test_empty_cache_waits_for_outstanding_events_first():
    """``release_cached_blocks`` begins with ``synchronize_and_free_events``: a block whose other-stream
    event is outstanding is cached, then released with the rest."""
    allocator = CachingAllocator(settle_at_malloc=False)
    block = allocator.malloc(12 * MiB)
    allocator.record_stream(block, 1)
    allocator.free(block)
    allocator.empty_cache()
    assert allocator.heap.reserved == 0


def test_each_stream_grows_an_expandable_segment_of_its_own():
    """``find_expandable_block`` looks only at the unmapped blocks of the request's stream and otherwise
    makes a new ``ExpandableSegment`` for that stream; the small pool maps pages of kSmallBuffer (2 MiB)."""
    shared = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    shared.malloc(5 * MiB)
    shared.malloc(5 * MiB)
    assert shared.heap.reserved == 20 * MiB  # one 20 MiB page holds both
    apart = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    apart.malloc(5 * MiB, stream=0)
    apart.malloc(5 * MiB, stream=1)
    assert apart.heap.reserved == 40 * MiB
    apart.malloc(512, stream=0)
    assert apart.heap.reserved == 42 * MiB


def test_torchs_own_gpu_test_of_the_rounding():
    """The figures torch's ``test_allocator_settings`` (test/test_cuda.py) asserts on a GPU: 21 Mi floats
    take 84 MiB, 96 MiB under ``roundup_power2_divisions:4``, 88 MiB under the bracket form's 8
    divisions from 64 MiB; 100 Mi floats under its 2 divisions from 256 MiB take 512 MiB."""
    nbytes, nbytes_big = 84 * MiB, 400 * MiB
    bracket = parse_alloc_conf("garbage_collection_threshold:0.5,"
                               "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
    assert round_size(nbytes, AllocConf()) == nbytes
    assert round_size(nbytes, parse_alloc_conf("roundup_power2_divisions:4")) == 96 * MiB
    assert round_size(nbytes, bracket) == 88 * MiB
    assert round_size(nbytes_big, bracket) == 512 * MiB


def test_fragmentation_is_the_reserved_peak_the_live_blocks_never_filled():
    """Not one of torch's stats: 1 - allocated peak / reserved peak, both as ``memory_stats`` counts them
    (``allocated_bytes`` in whole blocks, ``reserved_bytes`` in segments)."""
    allocator = CachingAllocator()
    parts = [allocator.malloc(5 * MiB) for _ in range(4)]
    allocator.free(parts[0])
    allocator.malloc(12 * MiB)  # the freed 5 MiB does not fit: a new segment
    figures = allocator.figures()
    assert (figures.allocated_peak, figures.reserved_peak) == (27 * MiB, 32 * MiB)
    assert figures.fragmentation == pytest.approx(5 / 32)


def test_a_torch_history_replays_to_its_own_segments():
    """A history as ``torch.cuda.memory._snapshot()`` holds it: a block freed while another stream used
    it completes later (its ``free_completed`` is not next), and a run of freed segments is an
    ``empty_cache``."""
    def event(action: str, addr: int, size: int, stream: int = 0) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    history = [event("segment_alloc", 1000, 12 * MiB), event("alloc", 1000, 12 * MiB),
               event("free_requested", 1000, 12 * MiB),  # recorded on another stream
               event("segment_alloc", 9000, 12 * MiB), event("alloc", 9000, 12 * MiB),
               event("free_completed", 1000, 12 * MiB),
               event("free_requested", 9000, 12 * MiB), event("free_completed", 9000, 12 * MiB),
               event("segment_free", 1000, 12 * MiB), event("segment_free", 9000, 12 * MiB),
               event("segment_alloc", 1000, 2 * MiB), event("alloc", 1000, 100)]
    snapshot = {"device_traces": [history]}
    actions = [e[0] for e in trace_events(snapshot)]
    assert actions == ["segment_at", "alloc", "record_stream", "free", "segment_at", "alloc", "complete", "free",
                       "empty_cache", "segment_at", "alloc"]
    figures = replay_allocator(trace_events(snapshot))
    assert figures.reserved_peak == traced_reserved_peak(snapshot) == 24 * MiB
    assert figures.allocated_peak == 12 * MiB
    assert first_divergence(snapshot) is None


def test_the_first_allocation_a_replay_reserves_otherwise_is_named():
    """A history where the GPU gave a 12 MiB request a segment of its own though 14 MiB were left of a
    20 MiB segment: torch's ``get_free_block`` would have split those, so the replay diverges there."""
    def event(action: str, addr: int, size: int) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    history = [event("segment_alloc", 0, 20 * MiB), event("alloc", 0, 3 * MiB), event("alloc", 3 * MiB, 3 * MiB),
               event("segment_alloc", 1 << 30, 12 * MiB), event("alloc", 1 << 30, 12 * MiB)]
    assert first_divergence({"device_traces": [history]}) == (
        f"allocation 3 of 3 ({12 * MiB} bytes, stream 0): the GPU had {32 * MiB} bytes reserved, "
        f"the replay {20 * MiB}")


def test_the_settings_parse_as_torch_parses_them():
    """``AllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp): comma-separated ``key:value``
    tokens, spaces dropped; ``PYTORCH_ALLOC_CONF`` read before ``PYTORCH_CUDA_ALLOC_CONF``."""
    conf = parse_alloc_conf("max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6,"
                            "roundup_power2_divisions:[64:8,256:2,>:1],release_lock_on_cudamalloc:True")
    assert (conf.max_split_size, conf.expandable_segments, conf.garbage_collection_threshold) == \
        (128 * MiB, True, 0.6)
    assert conf.roundup_power2_divisions[:10] == (8,) * 7 + (0, 2, 1)
    assert alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}).expandable_segments
    assert alloc_conf_from_env({}) == AllocConf()


@pytest.mark.parametrize(("text", "message"), [
    ("max_split_size_mb:10", "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb must be >= 20"),
    ("max_split_size_mb:big", "max_split_size_mb accepts a whole number of MiB"),
    ("expandable_segments:true", "expandable_segments accepts True or False, got 'true'"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions accepts a power of two, got 3"),
    ("roundup_power2_divisions:[100:2]", "the interval '100' must be a power of two"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold accepts a fraction in (0.0, 1.0)"),
    ("backend:cudaMallocAsync", "only the native caching allocator is replayed"),
    ("max_split_sise_mb:64", "max_split_sise_mb is not a caching-allocator setting torch knows; accepted:"),
    ("expandable_segments", "expected 'key:value'"),
])
def test_a_bad_setting_names_the_variable_the_key_and_what_is_accepted(text: str, message: str):
    """The values torch's ``parseMaxSplitSize``, ``parseRoundUpPower2Divisions``,
    ``parseGarbageCollectionThreshold`` and ``consumeToken`` refuse, refused with what is accepted."""
    with pytest.raises(AllocConfError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_alloc_conf(text)


def _torchs_divisions() -> tuple[Callable[[str], None], Callable[[int], int]]:
    """torch's own parser and ``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``, from the c10
    library of the torch installed here: a CPU build has them (torch 2.9+), not the allocator itself."""
    torch: Any = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # noqa: SLF001
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        divisions = library._ZN3c1016CachingAllocator26AcceleratorAllocatorConfig24roundup_power2_divisionsEm
    except (OSError, AttributeError):
        divisions = None
    if setter is None or divisions is None:
        pytest.skip(f"torch {torch.__version__} exports no AcceleratorAllocatorConfig")
    divisions.restype, divisions.argtypes = ctypes.c_size_t, [ctypes.c_size_t]
    return setter, divisions


@pytest.mark.torch
@pytest.mark.parametrize("text", SETTINGS)
def test_the_divisions_of_each_size_are_torchs_own(text: str):
    """Our table of divisions against torch's, size by size (its ``parseRoundUpPower2Divisions`` fills
    the table, its ``roundup_power2_divisions(size)`` picks the interval; a '>' entry starts after the
    last key's interval, sizes under 1 MiB share the first)."""
    setter, divisions = _torchs_divisions()
    setter(text)
    try:
        torchs = [divisions(size) for size in SIZES]
    finally:
        setter("")
    assert [parse_alloc_conf(text).divisions(size) for size in SIZES] == torchs


@pytest.mark.torch
@pytest.mark.parametrize("text", ["max_split_size_mb:10", "expandable_segments:true", "roundup_power2_divisions:3",
                                  "roundup_power2_divisions:[100:2]", "garbage_collection_threshold:1.5",
                                  "garbage_collection_threshold:0", "large_segment_size_mb:10",
                                  "max_non_split_rounding_mb:19", "max_split_size_mb:30,large_segment_size_mb:50"])
def test_a_setting_torch_refuses_is_refused(text: str):
    """What torch's parser refuses we refuse (we refuse more: an unknown key, which torch 2.13 skips, and
    ``backend:cudaMallocAsync``, whose pool the replay does not model)."""
    setter, _ = _torchs_divisions()
    try:
        with pytest.raises((ValueError, RuntimeError)):
            setter(text)
    finally:
        setter("")
    with pytest.raises(AllocConfError, match=text.split(":")[0]):
        parse_alloc_conf(text)


def test_the_large_segment_size_bounds_the_split_settings_and_sets_the_rounding():
    """torch's ``AcceleratorAllocatorConfig::parseArgs`` reads ``large_segment_size_mb`` first, sets
    ``max_non_split_rounding_size_`` to it, and refuses a ``max_split_size_mb`` or
    ``max_non_split_rounding_mb`` below it (``parseMaxSplitSize``: 'must be >= large_segment_size_')."""
    assert parse_alloc_conf("max_split_size_mb:64,large_segment_size_mb:32").max_non_split_rounding == 32 * MiB
    assert parse_alloc_conf("large_segment_size_mb:32,max_non_split_rounding_mb:40").max_non_split_rounding == \
        40 * MiB
    assert AllocConf().max_non_split_rounding == parse_alloc_conf("max_split_size_mb:20").max_non_split_rounding \
        == 20 * MiB
    with pytest.raises(AllocConfError, match="max_non_split_rounding_mb must be >= 32 .MiB, the large segment"):
        parse_alloc_conf("max_non_split_rounding_mb:24,large_segment_size_mb:32")
