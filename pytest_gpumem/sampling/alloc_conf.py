"""``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``, which torch reads first): the caching
allocator's settings that decide how much it reserves, parsed as torch parses them.

Replaying the allocator (``caching_allocator``) needs the settings the job ran with: ``max_split_size_mb``,
``max_non_split_rounding_mb``, ``roundup_power2_divisions`` (a number, or the bracket form
``[256:4,512:2,>:1]`` whose keys are MiB powers of two), ``expandable_segments``,
``garbage_collection_threshold`` and ``large_segment_size_mb``. Keys that move no reserved byte
(``release_lock_on_cudamalloc``, the ``pinned_*`` ones) are accepted and ignored, as torch skips keys
it does not know; ``backend:cudaMallocAsync`` hands memory to the driver's own pool, which this
replay does not model, so it is refused. A bad value is an error that names the variable, the key
and what is accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

MiB = 2**20
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the 20 MiB segment of a 1-10 MiB request, the oversize rounding
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: large_segment_size_mb must exceed it
UNLIMITED = 2**64 - 1  # max_split_size unset: every block may be split
INTERVALS = 16  # roundup_power2_divisions: one entry per power of two from 1 MiB to 64 GiB
VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads the first one set
IGNORED = {"release_lock_on_cudamalloc", "release_lock_on_device_malloc", "pinned_use_cuda_host_register",
           "pinned_use_device_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
           "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
           "per_process_memory_fraction"}


class AllocConfError(ValueError):
    """A setting the replay cannot read; the message names the variable, the key and what is accepted."""


@dataclass(frozen=True)
class AllocConf:
    """The caching allocator's settings (torch's defaults unless set)."""

    max_split_size: int = UNLIMITED
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * INTERVALS)
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    large_segment_size: int = LARGE_BUFFER

    def divisions(self, size: int) -> int:
        """The divisions of the power-of-two interval ``size`` falls in (torch's
        ``roundup_power2_divisions(size)``: sizes under 2 MiB share the first entry)."""
        index = min(max(size.bit_length() - 1 - 20, 0), INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def alloc_conf_from_env(env: Mapping[str, str]) -> AllocConf:
    """The settings a job started with ``env`` runs with."""
    for name in VARIABLES:
        if env.get(name) is not None:
            return parse_alloc_conf(env[name], name)
    return AllocConf()


def parse_alloc_conf(text: str, variable: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocConf:
    """``text`` as torch's tokenizer reads it: ``key:value`` pairs separated by commas."""
    tokens = re.findall(r"[\[\]:,]|[^\[\]:,\s]+", text)
    values: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocConfError(f"{variable}: expected 'key:value' at {key!r} in {text!r}")
        if tokens[i + 2] == "[":
            end = tokens.index("]", i + 2) if "]" in tokens[i + 2:] else -1
            if end < 0:
                raise AllocConfError(f"{variable}: {key}: expected a closing ']' in {text!r}")
            raw: object = tokens[i + 3:end]
            i = end + 1
        else:
            raw = tokens[i + 2]
            i += 3
        name, value = _value(variable, key, raw)
        if name:
            values[name] = value
        if i < len(tokens):
            if tokens[i] != ",":
                raise AllocConfError(f"{variable}: expected ',' after {key} in {text!r}")
            i += 1
    return AllocConf(**_sized_by_the_large_segment(variable, values))  # type: ignore[arg-type]


def _sized_by_the_large_segment(variable: str, values: dict[str, object]) -> dict[str, object]:
    """torch (``AcceleratorAllocatorConfig::parseArgs``, 2.9+) reads ``large_segment_size_mb`` first:
    ``max_split_size_mb`` and ``max_non_split_rounding_mb`` may not be smaller, and the rounding is that
    size unless set (20 MiB, kLargeBuffer, by default)."""
    sizes = {name: value for name, value in values.items() if isinstance(value, int)}
    large = sizes.get("large_segment_size", LARGE_BUFFER)
    for name, key in (("max_split_size", "max_split_size_mb"), ("max_non_split_rounding", "max_non_split_rounding_mb")):
        if sizes.get(name, large) < large:
            raise AllocConfError(f"{variable}: {key} must be >= {large // MiB} (MiB, the large segment size), "
                                 f"got {sizes[name] // MiB}")
    return {"max_non_split_rounding": large, **values}


def _value(variable: str, key: str, raw: object) -> tuple[str, object]:
    """(the field of ``AllocConf``, its value), or ('', None) for a key that moves no reserved byte."""
    where = f"{variable}: {key}"
    if key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
        large = key == "large_segment_size_mb"  # over kMinLargeAlloc (10 MiB); the others checked after
        mib = _whole(where, raw, "a whole number of MiB " + ("> 10" if large else ">= large_segment_size_mb"))
        if large and mib <= MIN_LARGE_ALLOC // MiB:
            raise AllocConfError(f"{where} must be > 10 (MiB), got {mib}")
        return {"max_split_size_mb": "max_split_size", "max_non_split_rounding_mb": "max_non_split_rounding",
                "large_segment_size_mb": "large_segment_size"}[key], min(mib * MiB, UNLIMITED)
    if key == "roundup_power2_divisions":
        return "roundup_power2_divisions", _divisions(where, raw)
    if key == "expandable_segments":
        if raw not in ("True", "False"):
            raise AllocConfError(f"{where} accepts True or False, got {raw!r}")
        return "expandable_segments", raw == "True"
    if key == "garbage_collection_threshold":
        try:
            threshold = float(str(raw))
        except ValueError:
            threshold = -1.0
        if not 0.0 < threshold < 1.0:
            raise AllocConfError(f"{where} accepts a fraction in (0.0, 1.0), got {raw!r}")
        return "garbage_collection_threshold", threshold
    if key == "backend":
        if raw != "native":
            raise AllocConfError(f"{where}: only the native caching allocator is replayed (backend:native), "
                                 f"got {raw!r}")
        return "", None
    if key in IGNORED:
        return "", None
    raise AllocConfError(f"{where} is not a caching-allocator setting torch knows; accepted: max_split_size_mb, "
                         "max_non_split_rounding_mb, roundup_power2_divisions, expandable_segments, "
                         "garbage_collection_threshold, large_segment_size_mb, backend, "
                         + ", ".join(sorted(IGNORED)))


def _whole(where: str, raw: object, accepted: str) -> int:
    if not isinstance(raw, str) or not raw.isdigit():
        raise AllocConfError(f"{where} accepts {accepted}, got {raw!r}")
    return int(raw)


def _divisions(where: str, raw: object) -> tuple[int, ...]:
    """A number for every interval, or ``[MiB:divisions, ..., >:divisions]`` as torch fills its table."""
    if isinstance(raw, str):
        value = _power_of_two(where, raw, zero=False)
        return (value,) * INTERVALS
    table = [0] * INTERVALS
    parts = [p for p in "".join(raw).split(",") if p] if isinstance(raw, list) else []
    first, last = True, 0
    for part in parts:
        bound, _, value_text = part.partition(":")
        value = _power_of_two(where, value_text, zero=True)
        if bound == ">":
            table[last + 1:] = [value] * (INTERVALS - last - 1)
            continue
        mib = _whole(where, bound, "[MiB:divisions, ..., >:divisions] with MiB a power of two")
        if mib & (mib - 1) or mib == 0:
            raise AllocConfError(f"{where}: the interval {bound!r} must be a power of two (MiB)")
        index = min(mib.bit_length() - 1, INTERVALS - 1)
        if first:
            table[:index] = [value] * index
            first = False
        table[index], last = value, index
    return tuple(table)


def _power_of_two(where: str, text: str, zero: bool) -> int:
    value = _whole(where, text, "a power of two" + (" or 0" if zero else ""))
    if (value == 0 and not zero) or value & (value - 1):
        raise AllocConfError(f"{where} accepts a power of two{' or 0' if zero else ''}, got {value}")
    return value
