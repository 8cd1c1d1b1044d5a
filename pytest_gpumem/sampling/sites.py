"""Peak sites: where the memory live at a rank's peak was allocated, folded to the user's code.

A red test says how much grew; a site says which line holds it. Both captures the plugin already
has can answer: memray's (the host tracker's high-water-mark records, each with its Python stack)
and torch's CUDA allocator history (every block with the Python stack that allocated it). Each
stack is folded to its innermost frame in the user's code, with the framework call it made under
it (``examples/test_torch_ddp.py:57 _train (all_gather)``); stacks with no user frame are the
framework's internals, and a stack with no Python frame at all (a framework's worker thread) is
named as native. Sites of one rank are grouped by that key and summed.

The line that allocates is often not the line that keeps the memory alive: ``return
self.head(x)`` in a model allocates the logits, the caller that appends them to a list keeps them.
So each site also carries the user frames above it (``called from``, innermost first, up to
:data:`CALLERS`): the chain that holds most of the site's bytes, and how many chains it merges.
The chain is shown, never part of a site's identity (its key): a site compares the same whether or
not its callers were captured, and a baseline stores no chain.

Plain functions over plain data (frames are ``(function, filename, line)``, innermost first), so
the folding is tested without either capture.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from . import MiB

Frame = tuple[str, str, int]  # (function, filename, line), as memray gives them
NATIVE = "native"  # ``where`` of a site whose allocations had no Python frame at all
INTERNALS = "(framework internals)"  # ``where`` of the sum of the sites with no user frame
SMALL = "(small allocations)"  # ``where`` of the records under SMALL_RECORD bytes, summed unresolved
SMALL_RECORD = 4096  # a capture's records below this are not resolved to a stack: 90% of them, ~5% of the bytes
TOP_SITES = 12  # kept per rank in a report; a baseline keeps fewer (judging.sites.STORED)
MIN_SITE_MIB = 0.5  # smaller sites are summed into the rest: below run-to-run noise
CALLERS = 3  # user frames kept above a site's line: the caller that keeps the memory is usually the first

# Wrappers every framework call goes through: the detail names the call behind them.
_GENERIC = frozenset({"wrapper", "_wrapped_call_impl", "_call_impl", "inner", "decorate_context", "__call__",
                      "<lambda>", "_fn", "wrapped", "decorator", "<module>", "<listcomp>", "<genexpr>",
                      # a mode that intercepts the call (the simulated world's, DTensor's), not the call
                      "__torch_function__", "__torch_dispatch__"})
_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"})


@dataclass(frozen=True)
class Site:
    """Memory live at the peak that one place in the code allocated (all its allocations summed)."""

    where: str  # "examples/test_torch_ddp.py:57", "torch/nn/functional.py:2510", or NATIVE
    function: str  # the function at ``where``
    detail: str = ""  # the framework call made there ("all_gather"); for NATIVE, the thread
    mib: float = 0.0
    count: int = 1
    internal: bool = False  # no user frame: the framework's own (summarised, not listed)
    # Shown, never compared: the user frames above ``where``, innermost first ("train.py:25 train_step"),
    # of the chain that holds most of the site's bytes, and how many distinct chains were summed into it.
    callers: tuple[str, ...] = field(default=(), compare=False)
    chains: int = field(default=1, compare=False)
    # Shown, never compared: what keeps the site's bytes alive at the peak (``holders``), largest first:
    # ("train.py:63 (list 'kept', append)", MiB, storages).
    held_by: tuple[tuple[str, float, int], ...] = field(default=(), compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        """The site's identity: where it was allocated (its callers are shown, not compared)."""
        return (self.where, self.function, self.detail)

    def label(self) -> str:
        """``examples/test_torch_ddp.py:57 _train (all_gather)``."""
        text = f"{self.where} {self.function}".strip()
        return f"{text} ({self.detail})" if self.detail else text

    def called_from(self) -> list[str]:
        """``called from train.py:25 train_step`` lines, innermost first, and the chains left out."""
        lines = [f"called from {caller}" for caller in self.callers]
        if lines and self.chains > 1:
            others = self.chains - 1
            lines[-1] += f" (and {others} other call chain{'s' if others > 1 else ''})"
        return lines

    def as_dict(self) -> dict[str, Any]:
        """The site as a rank's exit report and a JSON report keep it (``called_from`` where known)."""
        out: dict[str, Any] = {"where": self.where, "function": self.function, "detail": self.detail,
                               "mib": round(self.mib, 3), "count": self.count, "internal": self.internal}
        if self.callers:
            out["called_from"] = list(self.callers)
            out["chains"] = self.chains
        if self.held_by:
            out["held_by"] = [{"by": by, "mib": round(mib, 3), "count": n} for by, mib, n in self.held_by]
        return out

    def kept_alive_by(self) -> str:
        """``train.py:63 (list 'kept', append; 4 tensors)``: the largest holder of the site's bytes, or ``""``."""
        if not self.held_by:
            return ""
        by, _, count = self.held_by[0]
        many = f"{count} tensor{'s' if count != 1 else ''}"
        return f"{by[:-1]}; {many})" if by.endswith(")") else f"{by} ({many})"


@lru_cache(maxsize=1)
def _plugin_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root + os.sep)


@lru_cache(maxsize=4096)
def _is_plugin(filename: str) -> bool:
    return _under(os.path.realpath(filename), _plugin_root())


@lru_cache(maxsize=1)
def _internal_roots() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages, this plugin."""
    roots = {_plugin_root()}  # pytest_gpumem itself
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path))
    return tuple(sorted(roots))


@lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """Code that is not the user's: the interpreter's, an installed package's, or this plugin's."""
    if not filename or filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    if "/site-packages/" in filename or "/dist-packages/" in filename:
        return True
    real = os.path.realpath(filename)
    return any(_under(real, root) for root in _internal_roots())


@lru_cache(maxsize=4096)
def short_path(filename: str, root: Path | None = None) -> str:
    """Relative to ``root`` (the rootdir) when under it; a package file from its package down."""
    if root is not None:
        try:
            return Path(os.path.realpath(filename)).relative_to(os.path.realpath(root)).as_posix()
        except ValueError:
            pass
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


def fold(stack: Sequence[Frame], root: Path | None = None, thread: str = "") -> Site:
    """The site of one stack (innermost frame first): its innermost user frame, with the framework
    call it made; the innermost frame when no frame is the user's; NATIVE when there is none."""
    if not stack:
        return Site(NATIVE, "(no Python stack)", thread, internal=True)
    for i, (function, filename, line) in enumerate(stack):
        if is_internal(filename):
            continue
        # outermost first; the plugin's own frames (its stand-ins' modes) are not the call the user made
        called = [f for f, file, _ in reversed(stack[:i]) if f not in _GENERIC and not _is_plugin(file)]
        above = i + 1
        if function in _COMPREHENSIONS and i + 1 < len(stack) and stack[i + 1][1] == filename:
            function = stack[i + 1][0]  # Python < 3.12 gives a comprehension its own frame
            above = i + 2
        return Site(f"{short_path(filename, root)}:{line}", function, called[0] if called else "",
                    callers=callers(stack[above:], root))
    function, filename, line = stack[0]
    return Site(f"{short_path(filename, root)}:{line}", function, internal=True)


def callers(stack: Sequence[Frame], root: Path | None = None) -> tuple[str, ...]:
    """The user frames of ``stack`` (innermost first), up to :data:`CALLERS`, as ``file:line function``
    (a comprehension's own frame is folded into its function's, as in :func:`fold`)."""
    out: list[str] = []
    for j, (function, filename, line) in enumerate(stack):
        if is_internal(filename):
            continue
        if function in _COMPREHENSIONS and j + 1 < len(stack) and stack[j + 1][1] == filename:
            continue  # the enclosing function's frame comes next, at the line that runs the comprehension
        where = short_path(filename, root)
        if root is not None and os.path.isabs(where):
            break  # above the project (a harness that runs pytest in-process): not the user's chain
        out.append(f"{where}:{line} {function}")
        if len(out) == CALLERS:
            break
    return tuple(out)


def group(allocations: Iterable[tuple[Sequence[Frame] | None, int, int, str]], root: Path | None = None,
          top: int = TOP_SITES) -> list[Site]:
    """``(stack, bytes, count, thread)`` per allocation record -> sites, largest first (a stack of
    None: a record not resolved, summed into the small allocations).

    The ``top`` largest user sites are kept, and the framework's internals and native allocations
    each summed into one site; sites under :data:`MIN_SITE_MIB` are dropped (their sum is the
    difference between the peak and the sites' total).
    """
    sites: dict[tuple[str, str, str], Site] = {}
    chains: dict[tuple[str, str, str], dict[tuple[str, ...], int]] = {}  # site -> caller chain -> bytes
    for stack, nbytes, count, thread in allocations:
        site = fold(stack, root, thread) if stack is not None else Site(SMALL, "", "", internal=True)
        if site.internal and site.where != SMALL:  # one line for all of the framework's own, one for native code
            site = Site(NATIVE if site.where == NATIVE else INTERNALS, "", "", internal=True)
        old = sites.get(site.key)
        mib, n = nbytes / MiB, count
        if old is not None:
            mib, n = mib + old.mib, n + old.count
        sites[site.key] = Site(site.where, site.function, site.detail, mib, n, site.internal)
        if site.callers:
            by_chain = chains.setdefault(site.key, {})
            by_chain[site.callers] = by_chain.get(site.callers, 0) + nbytes
    for key, by_chain in chains.items():  # the chain that holds most of the site's bytes is shown
        largest = min(by_chain, key=lambda chain: (-by_chain[chain], chain))
        sites[key] = replace(sites[key], callers=largest, chains=len(by_chain))
    ranked = sorted((s for s in sites.values() if s.mib >= MIN_SITE_MIB), key=lambda s: (-s.mib, s.key))
    users = [s for s in ranked if not s.internal][:top]
    return users + [s for s in ranked if s.internal]


def with_holders(sites: Sequence[Site], blocks: Iterable[tuple[Sequence[Frame], int, str]],
                 root: Path | None = None) -> list[Site]:
    """``sites`` with what keeps their bytes alive: ``(stack, bytes, holder)`` per block live at the
    peak whose holder is known (``holders.Holder.label``), summed per site and holder."""
    held: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for stack, nbytes, holder in blocks:
        site = fold(stack, root)
        key = (NATIVE if site.where == NATIVE else INTERNALS, "", "") if site.internal else site.key  # as group()
        tally = held.setdefault(key, {}).setdefault(holder, [0.0, 0])
        tally[0] += nbytes / MiB
        tally[1] += 1
    out = []
    for site in sites:
        by_holder = held.get(site.key)
        if by_holder:
            ranked = sorted(by_holder.items(), key=lambda item: (-item[1][0], item[0]))[:3]
            site = replace(site, held_by=tuple((by, mib, int(n)) for by, (mib, n) in ranked))
        out.append(site)
    return out


def from_dicts(raw: Iterable[Mapping[str, Any]]) -> list[Site]:
    """Sites back from JSON (a rank's exit report, a record, a baseline); bad items are skipped."""
    out = []
    for item in raw:
        try:
            chain = item.get("called_from") or ()
            out.append(Site(str(item["where"]), str(item.get("function", "")), str(item.get("detail", "")),
                            float(item["mib"]), int(item.get("count", 1)), bool(item.get("internal", False)),
                            tuple(str(c) for c in chain) if isinstance(chain, (list, tuple)) else (),
                            int(item.get("chains", 1)),
                            tuple((str(h["by"]), float(h["mib"]), int(h.get("count", 1)))
                                  for h in item.get("held_by") or () if isinstance(h, Mapping))))
        except (KeyError, TypeError, ValueError):
            continue
    return out


# ---------------------------------------------------------------------------------------- captures


def memray_sites(path: Path, root: Path | None = None) -> list[Site]:
    """The sites live at the high-water mark of a memray capture (aggregated format)."""
    import memray

    reader = memray.FileReader(path)
    records: list[tuple[Sequence[Frame] | None, int, int, str]] = []
    for record in reader.get_high_watermark_allocation_records(merge_threads=True):
        stack: list[Frame] | None = None
        if record.size >= SMALL_RECORD:  # resolving a stack is what costs: only where the bytes are
            try:
                stack = [(str(f), str(n), int(line)) for f, n, line in record.stack_trace()]
            except Exception:  # noqa: BLE001 - a record whose stack cannot be resolved: native
                stack = []
        records.append((stack, int(record.size), int(record.n_allocations), ""))
    return group(records, root)


def memray_heap_timeline(path: Path, limit: int = 2000) -> list[tuple[float, float]]:
    """(seconds since the epoch, MiB of live allocations) from the capture's periodic snapshots,
    thinned to at most ``limit`` points keeping each stretch's highest."""
    import memray

    points = [(snap.time / 1000.0, snap.heap / MiB) for snap in memray.FileReader(path).get_memory_snapshots()]
    return thin(points, limit)


def thin(points: Sequence[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most ``limit`` points: each bucket keeps its highest (a peak is never thinned away)."""
    if len(points) <= limit:
        return list(points)
    size = -(-len(points) // limit)
    return [max(points[i:i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]
