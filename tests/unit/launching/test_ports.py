"""Rendezvous port leases (launching/ports.py): two reservations never hand out the same port, in
one process or in two, and a port some program listens on is never handed out."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

from pytest_gpumem.launching.ports import bindable, candidates, lease_port

HOLD_IN_ANOTHER_PROCESS = '''
import sys
from pathlib import Path
from pytest_gpumem.launching.ports import lease_port
pool = list(range(int(sys.argv[2]), int(sys.argv[3])))
leases = [lease_port(Path(sys.argv[1]), ports=pool) for _ in range(int(sys.argv[4]))]
print(" ".join(str(lease.port) for lease in leases), flush=True)
sys.stdin.readline()  # held until the test says so
'''


def test_candidates_stay_outside_the_kernels_ephemeral_range():
    assert candidates(30000, 32767, ephemeral=(32768, 60999)) == list(range(30000, 32768))
    assert candidates(30000, 32767, ephemeral=(1024, 65000)) == list(range(65001, 65536))
    assert not set(candidates(20000, 40000, ephemeral=(32768, 60999))) & set(range(32768, 61000))


def test_reservations_held_at_once_never_share_a_port(tmp_path: Path):
    """Twelve ports of a pool of 16: six leased by another process (an xdist worker, another session),
    six here, all held at once: twelve different ports; the thirteenth to sixteenth are what is left."""
    pool = list(range(31000, 31016))
    other = subprocess.Popen([sys.executable, "-c", HOLD_IN_ANOTHER_PROCESS, str(tmp_path), "31000", "31016", "6"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdin is not None
        theirs = [int(word) for word in other.stdout.readline().split()]
        ours = [lease_port(tmp_path, ports=pool, rng=random.Random(seed)) for seed in range(6)]
        held = theirs + [lease.port for lease in ours]
        assert len(held) == len(set(held)) == 12, held
        left = sorted(p for p in pool if p not in held and bindable(p))
        rest = [lease_port(tmp_path, ports=pool) for _ in left]
        assert sorted(lease.port for lease in rest) == left, "only the ports nobody holds"
        ours[0].release()
        assert lease_port(tmp_path, ports=[ours[0].port]).port == ours[0].port, "a released port is leased again"
    finally:
        if other.stdin is not None:
            other.stdin.close()
        other.wait(timeout=30)


def test_a_port_another_program_listens_on_is_skipped(tmp_path: Path):
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        free = next(p for p in range(31100, 31200) if bindable(p))
        assert not bindable(taken)
        assert lease_port(tmp_path, ports=[taken, free]).port == free
