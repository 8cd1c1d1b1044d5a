"""OneFlow's eager SBP conversions as data: the record a rank writes (:class:`Conversion`), OneFlow's
eager boxing logger's lines read back, and what a failure lists against a smaller size or a baseline.

Plain Python over plain data, so the parent reads and compares without the recorder
(``oneflow/eager.py``, which runs in a rank) and the rules are tested on recorded lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .boxing import _DTYPE_BYTES, TINY_BYTES, _ranges, expected_in_data_parallel, format_bytes


@dataclass(frozen=True)
class Conversion:
    """One eager SBP conversion, summed over the times one line ran it."""

    src: str  # "S(0)", "B", "P"; "(S(0), B)" for a 2-D hierarchy
    dst: str
    line: str  # "examples/model.py:25 forward": the user's line that issued the op
    shape: tuple[int, ...]  # logical shape
    dtype: str = ""  # "float32"; "" when not known
    placement: str = ""  # "cpu:0-1", or "cpu:0 -> cpu:0-1" when it changes
    world: int = 1  # ranks in the (output) placement
    how: str = "inferred"  # "to_global" (written by the job) or "inferred" (inside an op)
    count: int = 1

    @property
    def kind(self) -> str:
        """``S(0)->B``; ``B->B [cpu:0 -> cpu:0-1]`` for a move between placements."""
        base = f"{self.src}->{self.dst}"
        return f"{base} [{self.placement}]" if "->" in self.placement else base

    @property
    def key(self) -> tuple[str, str, str]:
        """What a comparison matches on: the kind and the line (shapes grow with the world size)."""
        return (self.kind, self.line, self.how)

    @property
    def logical_bytes(self) -> int | None:
        if self.dtype not in _DTYPE_BYTES:
            return None
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _DTYPE_BYTES[self.dtype]

    def added_bytes(self) -> int | None:
        """Bytes each rank holds more after the conversion than before it (0 for P->B; negative
        for B->S): S(0)->B of a 128 MiB tensor on 2 ranks adds 64 MiB a rank, on 1 rank nothing."""
        total = self.logical_bytes
        if total is None:
            return None
        src_world, dst_world = _worlds(self.placement, self.world)
        return _local(total, self.dst, dst_world) - _local(total, self.src, src_world)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Conversion":
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        fields["shape"] = tuple(int(d) for d in raw.get("shape", ()))
        return cls(**fields)

    def describe(self) -> str:
        """``to_global of (2048, 16384) float32, x3``."""
        dims = ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "")
        what = f"({dims}) {self.dtype}".rstrip()
        return f"{self.how} of {what}, x{self.count}"


def _worlds(placement: str, world: int) -> tuple[int, int]:
    """Ranks before and after: ``cpu:0 -> cpu:0-1`` is (1, 2)."""
    if "->" not in placement:
        return world, world
    before, after = (p.strip() for p in placement.split("->", 1))
    return _count(before) or world, _count(after) or world


def _count(placement: str) -> int:
    """Ranks in ``cpu:0-1,4`` (3); 0 when the text is not of that form."""
    ranks = placement.partition(":")[2]
    total = 0
    for part in filter(None, ranks.split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit():
            return 0
        total += int(last or first) - int(first) + 1
    return total


def _local(total: int, sbp: str, world: int) -> int:
    """Bytes one rank holds of a tensor of ``total`` logical bytes (1-D SBP; a 2-D one is split once)."""
    return total // world if "S(" in sbp and world > 0 else total


# --------------------------------------------------------------------------- OneFlow's log lines

_LOG = re.compile(r"eager_boxing_logger\.cpp:\d+\] (?P<what>Boxing route|Logical shape|Altered state of sbp|"
                  r"Altered state of placement): (?P<value>.*)$")
_PLACEMENT = re.compile(r'oneflow\.placement\(type="(?P<type>\w+)", ranks=\[(?P<ranks>[\d,\s\[\]]*)\]'
                        r'(?:, hierarchy=\((?P<dims>[\d,\s]*)\))?\)')


def placement_str(text: str) -> str:
    """``oneflow.placement(type="cpu", ranks=[0, 1])`` -> ``cpu:0-1``; unknown text as it is."""
    m = _PLACEMENT.search(text)
    if not m:
        return text.strip()
    ranks = [int(r) for r in re.findall(r"\d+", m.group("ranks"))]
    return f"{m.group('type')}:{_ranges(ranks)}"


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", text))


def parse_log(text: str) -> list[tuple[str, str, tuple[int, ...], str, str]]:
    """The boxings in glog lines of OneFlow's eager boxing logger, in order:
    ``(src, dst, logical shape, placement before, placement after)``; a boxing that changes neither
    SBP nor placement (a rank of one) is left out."""
    found = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        m = _LOG.search(line)
        if not m:
            continue
        what, value = m.group("what"), m.group("value").strip()
        if what == "Boxing route":
            current = {}
        current[what] = value
        if what != "Altered state of placement" or "Altered state of sbp" not in current:
            continue
        sbps = [s.strip() for s in current["Altered state of sbp"].split(" -> ")]
        places = [placement_str(p) for p in value.split(" -> ")]
        src, dst = _sbp(sbps[0]), _sbp(sbps[-1])
        if src != dst or places[0] != places[-1]:
            found.append((src, dst, _shape(current.get("Logical shape", "")), places[0], places[-1]))
        current = {}
    return found


def _sbp(text: str) -> str:
    """``(S(0))`` -> ``S(0)``, ``(S(0), B)`` kept as it is."""
    inner = text.strip()
    if inner.startswith("(") and inner.endswith(")") and inner.count("(") == inner.count(")") and "," not in inner:
        inner = inner[1:-1]
    return inner.replace(" ", "").replace(",", ", ") if "," in inner else inner


# --------------------------------------------------------------------------- reading and comparing

def read(path: Path) -> tuple[list[Conversion], str]:
    """A rank's conversions and the reason some are not seen ("" when all are); none when absent."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return [], ""
    return [Conversion.from_dict(c) for c in data.get("conversions", [])], str(data.get("problem", ""))


PROVENANCE_PREFIX = "eager_boxing."  # a baseline's provenance keys of the eager audit
_PROVENANCE_KEY = re.compile(r"^(?P<kind>.+) \((?P<how>to_global|inferred)\)$")


def eager_provenance(path: Path) -> dict[str, str]:
    """A rank's eager conversions counted by kind, as flat provenance for the baseline:
    ``{"eager_boxing.S(0)->B (to_global)": "3"}`` (no lines: a line that moves is no news); empty
    when the rank recorded none."""
    found, _ = read(path)
    counts: dict[str, int] = {}
    for c in found:
        key = f"{PROVENANCE_PREFIX}{c.kind} ({c.how})"
        counts[key] = counts.get(key, 0) + c.count
    return {key: str(n) for key, n in sorted(counts.items())}


def stored_counts(provenance: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """``{(kind, how): count}`` as ``eager_provenance`` stored it; empty for a baseline without it."""
    out = {}
    for key, value in provenance.items():
        m = _PROVENANCE_KEY.match(key[len(PROVENANCE_PREFIX):]) if key.startswith(PROVENANCE_PREFIX) else None
        if m and value.isdigit():
            out[(m["kind"], m["how"])] = int(value)
    return out


def by_key(conversions: Iterable[Conversion]) -> dict[tuple[str, str, str], Conversion]:
    """One conversion per key (kind, line, how), counts summed, the largest shape kept."""
    out: dict[tuple[str, str, str], Conversion] = {}
    for c in conversions:
        old = out.get(c.key)
        if old is None:
            out[c.key] = c
            continue
        big = c if (c.added_bytes() or 0) > (old.added_bytes() or 0) else old
        out[c.key] = replace(big, count=old.count + c.count)
    return out


def _tiny(c: Conversion) -> bool:
    """Under :data:`TINY_BYTES` whatever its dtype (8 bytes an element where unknown): a learning rate
    sent to every rank, a loss made partial. Never what inflated a rank."""
    count = 1
    for dim in c.shape:
        count *= dim
    return (c.logical_bytes if c.logical_bytes is not None else 8 * count) < TINY_BYTES


def _figure(c: Conversion | None, size: int) -> str:
    if c is None:
        return f"not at nproc={size}"
    added = c.added_bytes()
    if added is None:
        return f"size n/a at nproc={size}"
    return f"none at nproc={size}" if added <= 0 else f"+{format_bytes(added)} at nproc={size}"


def compare(found: Sequence[Conversion], size: int, reference: Sequence[Conversion], ref_size: int) -> list[str]:
    """The conversions at ``size`` that are news against another size's, the most memory a rank
    gains first::

        S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (none at nproc=1); to_global of (2048, 16384) float32, x3

    Listed: a conversion (kind and line) the reference lacks, or one that gains a rank more memory
    than it did there. Not listed against a smaller size: data parallelism's P->B and P->S. Nor
    conversions of tiny tensors (a learning rate sent from rank 0 to every rank).
    """
    before = by_key(reference)
    listed: list[tuple[int, str]] = []
    for key, c in by_key(found).items():
        old = before.get(key)
        added = c.added_bytes()
        if ref_size < size and expected_in_data_parallel(c.kind):
            continue
        if (old is not None and (added or 0) <= (old.added_bytes() or 0)) or _tiny(c):
            continue
        listed.append((added if added is not None else -1,
                       f"{c.kind} at {c.line}: {_figure(c, size)} ({_figure(old, ref_size)}); {c.describe()}"))
    return [line for _, line in sorted(listed, key=lambda item: -item[0])]


def against_baseline(found: Sequence[Conversion], size: int, stored: Mapping[tuple[str, str], int]) -> list[str]:
    """The conversions of a kind the baseline's audit did not have, or had fewer of, largest first:
    ``S(0)->B at model.py:25 forward: +64.0 MiB at nproc=2 (S(0)->B x0 in the baseline); ...``."""
    counts: dict[tuple[str, str], int] = {}
    for c in found:
        counts[(c.kind, c.how)] = counts.get((c.kind, c.how), 0) + c.count
    grown = {key for key, n in counts.items() if n > stored.get(key, 0)}
    listed = [c for c in by_key(found).values() if (c.kind, c.how) in grown and not _tiny(c)]
    listed.sort(key=lambda c: -(c.added_bytes() or -1))
    return [f"{c.kind} at {c.line}: {_figure(c, size)} ({c.kind} {c.how} x{stored.get((c.kind, c.how), 0)} in the "
            f"baseline, x{counts[(c.kind, c.how)]} now); {c.describe()}" for c in listed]


def news(size: int, found: Sequence[Conversion], smaller: Sequence[tuple[int, Sequence[Conversion]]],
         baseline: Mapping[str, str] | None = None) -> tuple[str, list[str]] | None:
    """What ``size``'s conversions are compared with (the baseline's audit where it stored one, else
    the smallest launched size's) and the news against it; None when there is nothing to compare."""
    stored = stored_counts(baseline) if baseline is not None else {}
    if stored:
        return "the baseline", against_baseline(found, size, stored)
    if not smaller:
        return None
    ref_size, reference = min(smaller, key=lambda pair: pair[0])
    return f"nproc={ref_size}", compare(found, size, reference, ref_size)


def scaling_lines(size: int, found: Sequence[Conversion], smaller: Sequence[tuple[int, Sequence[Conversion]]],
                  problem: str = "", baseline: Mapping[str, str] | None = None) -> list[str]:
    """A failure's eager section for ``size``: its news against the baseline's audit, else against
    the smallest launched size."""
    compared = news(size, found, smaller, baseline)
    if compared is None:
        return []
    against, lines = compared
    head = f"  eager boxing (SBP conversions) at nproc={size} against {against}"
    lines = [f"{head}:", *(f"    {line}" for line in lines)] if lines else [
        f"{head}: no new conversions, none that holds more memory a rank"]
    if problem:
        lines.append(f"    ({problem})")
    return lines
