"""benchmarks/allocator_replay.py's ``--replay`` on a small history in its ``--record`` format: each job's
row is the caching allocator replayed over the job's events (``pytest_gpumem.sampling.caching_allocator``)
against the GPU figures the job carries, so the script the GPU's traces go through cannot rot."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "allocator_replay.py"
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom")  # the script's own order
MiB = 2**20


def _history() -> list[list[int]]:
    """A 20 MiB segment split by two 3 MiB blocks, a 15 MiB block in a 16 MiB segment of its own (the 14
    MiB left is too small), all freed, ``empty_cache``, then a small block: 36 MiB reserved at most, 22
    MiB allocated (the 1 MiB left of the 16 MiB segment is not split off)."""
    def event(action: str, addr: int, size: int, stream: int = 7) -> list[int]:
        return [ACTIONS.index(action), addr, size, stream]

    a, b, c = 1 << 30, 2 << 30, 3 << 30
    blocks = [(a, 3 * MiB), (a + 3 * MiB, 3 * MiB), (b, 15 * MiB)]
    return [event("segment_alloc", a, 20 * MiB), event("alloc", *blocks[0]), event("alloc", *blocks[1]),
            event("segment_alloc", b, 16 * MiB), event("alloc", *blocks[2]),
            *[event(action, addr, size) for addr, size in blocks for action in ("free_requested", "free_completed")],
            event("segment_free", a, 20 * MiB), event("segment_free", b, 16 * MiB),
            event("segment_alloc", c, 2 * MiB), event("alloc", c, 100)]


def test_replay_reads_each_job_and_compares_its_reserved_peak(tmp_path: Path):
    def job(reserved: int, conf: str = "", events: list[list[int]] | None = None) -> dict:
        return {"max_reserved": reserved, "max_allocated": 22 * MiB, "conf": conf, "torch": "2.11.0",
                "gpu": "NVIDIA H100", "events": _history() if events is None else events}

    expandable = [[ACTIONS.index("segment_map"), 1 << 30, 20 * MiB, 0], [0, 1 << 30, 9 * MiB, 0],
                  [0, (1 << 30) + 9 * MiB, 9 * MiB, 0]]  # two 9 MiB blocks in one 20 MiB page
    diverging = [event for event in _history() if event[1:3] != [2 << 30, 16 * MiB]]  # no segment for 15 MiB
    traces = {"plain": job(36 * MiB), "claims_more": job(45 * MiB), "diverging": job(36 * MiB, "", diverging),
              "expandable": job(20 * MiB, "expandable_segments:True", expandable),
              "cut": {"error": "timed out after 150 s"}}
    path = tmp_path / "traces.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(traces, handle)
    out = tmp_path / "table.txt"
    done = subprocess.run([sys.executable, str(SCRIPT), "--replay", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == ("$ python3 benchmarks/allocator_replay.py --record OUT --budget 220  # on the GPU "
                               "named below\n$ python benchmarks/allocator_replay.py --replay OUT/traces.json.gz "
                               "--out table.txt\n" + done.stdout)
    head, *rows = done.stdout.splitlines()
    assert head.startswith("torch 2.11.0 on NVIDIA H100") and "3 of 4 replayed jobs within 2%" in head
    table = {row.split()[0]: row.split() for row in rows[1:]}
    # job, alloc, reserved, traced, replay, err %, alloc-as-res %, frag %, events, settings
    assert table["plain"][1:10] == ["22.0", "36.0", "36.0", "36.0", "+0.00", "-38.89", "38.9", "15", "-"]
    assert table["claims_more"][4:6] == ["36.0", "-20.00"]
    assert "first divergence" not in done.stdout.split("\ndiverging")[0]
    assert table["diverging"][3:6] == ["20.0", "36.0", "+0.00"]  # the replay's segment, not in the history
    assert table["diverging"][10:] == ["(first", "divergence:", "allocation", "3", "of", "4", "(15728640",
                                       "bytes,", "stream", "7):", "the", "GPU", "had", "20971520", "bytes",
                                       "reserved,", "the", "replay", "37748736)"]
    assert table["expandable"][2:6] == ["20.0", "20.0", "20.0", "+0.00"]
    assert table["expandable"][9] == "expandable_segments:True"
    assert rows[-1].split(None, 1) == ["cut", "error: timed out after 150 s"]
