"""In a rank on a GPU: the framework allocator's own peak of live tensors, and where they came from.

NVML's figure is what the device holds (the CUDA context, the communicator's buffers, and the
caching allocator's cache, which moves by hundreds of MiB between identical runs). torch's
allocator counts what its tensors hold: ``max_memory_allocated`` read 7765.06 MiB in every one of 4
launches of an FSDP job whose NVML figure moved by 388 MiB. So each rank reports both, and with
sites on, torch's allocator history (the Python stack of every block) from the moment CUDA starts.

Nothing here starts CUDA: a rank that never touches the GPU stays off it (``device="auto"``
decides on that). The history is armed with ``torch.cuda._lazy_call``, which runs right after the
job's own first CUDA call; the peaks are reset where a test body starts, so a body's figure is its
own (script mode: the whole program). A job's own resets of the peaks do not reset the rank's figure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ..sampling import MiB
from ..sampling.holders import PeakWatch
from ..sampling.sites import Site, group, thin, with_holders
from ..sampling.torch_history import replay
from .imports import after_import

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

HISTORY_ENTRIES = 200_000  # events kept (a ring): enough for the peak of a few training steps
HOLDER_MIN_BYTES = 1 << 20  # storages smaller than this are not walked to: a site's noise (sites.MIN_SITE_MIB)


class TorchAllocator:
    """Reads torch's CUDA allocator in this rank; ``report()`` is what the exit report carries."""

    def __init__(self, history: bool, root: Path | None = None) -> None:
        self.history = history
        self.root = root
        self.recording = False
        self.problems: list[str] = []
        self._held: dict[int, tuple[int, int]] = {}  # device -> (allocated, reserved) peaks before a job's reset
        self._figures: dict[str, Any] | None = None  # read where the body ended (body mode)
        self._until_s: float | None = None  # when it ended: later history is not the body's
        self.watch: PeakWatch | None = None  # what keeps the peak's storages alive (a fake GPU's)

    # -- arming -------------------------------------------------------------------------------------

    def install(self) -> None:
        """Watch for torch: arm the history when it is imported (now, if it already is)."""
        after_import("torch", self._on_torch)

    def _on_torch(self, torch: ModuleType) -> None:
        self._hold_peaks_across_resets(torch)
        if not self.history:
            return
        try:
            torch.cuda._lazy_call(self._start_history)  # noqa: SLF001 - runs right after CUDA's init
        except Exception as exc:  # noqa: BLE001 - an unexpected torch: no sites, the figures stand
            self.problems.append(f"torch allocator history not armed ({exc!r})")

    def _hold_peaks_across_resets(self, torch: ModuleType) -> None:
        """A job may reset the allocator's peaks itself (torchtitan's memory monitor does at every log
        step): it still reads its own peaks as on a GPU, but each peak is held here before it goes, so
        the rank's figure is the peak of the whole body, whatever the job resets."""
        original = _reset_call(torch)
        if original is None or getattr(original, "_gpumem_holds", False):
            return  # a torch without it (the tests' stand-in at the torch boundary): resets reach the figure

        def reset(device: Any) -> Any:
            try:
                index = int(device) if device is not None else torch.cuda.current_device()
                stats = torch.cuda.memory_stats(index)
                held = self._held.get(index, (0, 0))
                self._held[index] = (max(held[0], stats.get("allocated_bytes.all.peak", 0)),
                                     max(held[1], stats.get("reserved_bytes.all.peak", 0)))
            except Exception as exc:  # noqa: BLE001 - the figure stands as the allocator gives it
                self.problems.append(f"a peak before the job's reset was not held ({exc!r})")
            return original(device)

        reset._gpumem_holds = True  # type: ignore[attr-defined]
        reset._gpumem_original = original  # type: ignore[attr-defined]
        torch._C._cuda_resetPeakMemoryStats = reset  # noqa: SLF001

    def _start_history(self) -> None:
        torch = sys.modules["torch"]
        try:
            torch.cuda.memory._record_memory_history(  # noqa: SLF001
                enabled="all", context="alloc", stacks="python", max_entries=HISTORY_ENTRIES)
            self.recording = True
        except Exception as exc:  # noqa: BLE001
            self.problems.append(f"torch allocator history did not start ({exc!r})")
            return
        self._watch_holders(torch)

    def _watch_holders(self, torch: ModuleType) -> None:
        """On a fake GPU, whose allocator tells each new peak: walk to what keeps the storages alive
        (``sampling.holders``), so that a site names the variable that holds it."""
        from .fakegpu import active

        allocator = active.get("allocator")
        if allocator is None:
            return

        def key_of(value: Any) -> int | None:  # the fake allocator's key of a CUDA tensor's storage
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                return int(value.untyped_storage()._cdata)  # noqa: SLF001
            return None

        self.watch = PeakWatch(HOLDER_MIN_BYTES, allocator.live, key_of, self.root)
        allocator.on_peak = self.watch.grew

    # -- the body -----------------------------------------------------------------------------------

    def body_started(self) -> None:
        """The figure of a test body is its own: peaks reset where it starts."""
        torch = sys.modules.get("torch")
        if torch is None or not _cuda_ready(torch):
            return
        reset = _reset_call(torch)
        reset = getattr(reset, "_gpumem_original", reset) or torch.cuda.reset_peak_memory_stats  # holds nothing
        self._held.clear()
        for device in _devices(torch):
            try:
                reset(device)
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"torch peak reset failed on cuda:{device} ({exc!r})")

    def body_ended(self, snapshot_file: Path | None = None) -> None:
        """Read the figures where the body ends (and dump the history when asked); the sites are
        read at exit, from the history up to this moment, so that their reading is not tracked."""
        torch = sys.modules.get("torch")
        if torch is not None and snapshot_file is not None and self.recording:
            try:
                torch.cuda.memory._dump_snapshot(str(snapshot_file))  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"torch snapshot not written ({exc!r})")
        self._figures = self._read_figures()
        self._until_s = time.time()

    # -- reading ------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """``{}`` when torch never used CUDA in this rank; else the figures, sites and curve."""
        figures = self._figures if self._figures is not None else self._read_figures()
        if not figures:
            return {}
        out = dict(figures)
        torch = sys.modules["torch"]
        if self.recording:
            out.update(self._sites(torch, out["devices"], out["allocated_mib"]))
        if self.problems:
            out["problems"] = list(self.problems)
        return out

    def _read_figures(self) -> dict[str, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not _cuda_ready(torch):
            return {}
        devices = _devices(torch)
        if not devices:
            return {}
        allocated = reserved = 0.0
        for device in devices:
            stats = torch.cuda.memory_stats(device)
            held = self._held.get(device, (0, 0))
            allocated += max(held[0], stats.get("allocated_bytes.all.peak", 0)) / MiB
            reserved += max(held[1], stats.get("reserved_bytes.all.peak", 0)) / MiB
        return {"framework": "torch", "allocated_mib": allocated, "reserved_mib": reserved, "devices": devices}

    def _sites(self, torch: ModuleType, devices: list[int], allocated_mib: float) -> dict[str, Any]:
        try:
            snapshot = torch.cuda.memory._snapshot()  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            return {"sites_problem": f"torch allocator snapshot failed ({exc!r})"}
        blocks: list[tuple[Any, int, int, str]] = []
        held: list[tuple[Any, int, str]] = []
        holders = self.watch.holders if self.watch is not None else {}
        timeline: list[tuple[float, float]] = []
        peak_mib = 0.0
        until = self._until_s if _epoch_times(snapshot) else None  # else no clock to cut at the body's end
        for device in devices:
            found = replay(snapshot, device, until_s=until)
            peak_mib += found.peak_bytes / MiB
            blocks.extend((stack, size, 1, "") for stack, size in found.blocks)
            held.extend((stack, size, holders[address].label())
                        for (stack, size), address in zip(found.blocks, found.addresses) if address in holders)
            timeline.extend(found.timeline)
        sites: list[Site] = with_holders(group(blocks, self.root), held, self.root)
        out: dict[str, Any] = {"sites": [s.as_dict() for s in sites], "timeline": thin(sorted(timeline), 2000)}
        # The history's window is a ring: when it no longer reaches back to the peak, say so.
        if peak_mib < allocated_mib * 0.98 - 1.0:
            out["sites_problem"] = (f"the allocator history reached back to {peak_mib:.1f} MiB, not the peak "
                                    f"{allocated_mib:.1f} MiB (its window holds {HISTORY_ENTRIES} events): "
                                    "sites are those of the largest moment it saw")
        return out


def _reset_call(torch: ModuleType) -> Any:
    """What every reset of the allocator's peaks calls (``torch.cuda.reset_peak_memory_stats`` and
    ``reset_max_memory_allocated``, real or fake GPU), or None where torch has none."""
    return getattr(getattr(torch, "_C", None), "_cuda_resetPeakMemoryStats", None)


def _epoch_times(snapshot: Any) -> bool:
    """Whether the history's ``time_us`` are microseconds since the epoch (within a day of now)."""
    now = time.time()
    for trace in snapshot.get("device_traces") or ():
        for event in trace[-1:]:
            stamp = event.get("time_us")
            return stamp is not None and abs(stamp / 1e6 - now) < 86400
    return False


def _cuda_ready(torch: ModuleType) -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a CPU build, a broken driver: no GPU figure
        return False


def _devices(torch: ModuleType) -> list[int]:
    """The devices this rank's allocator used (reading stats starts no CUDA context)."""
    found = []
    for device in range(torch.cuda.device_count()):
        try:
            if torch.cuda.memory_stats(device).get("reserved_bytes.all.peak", 0) > 0:
                found.append(device)
        except Exception:  # noqa: BLE001
            continue
    return found
