"""How a rank ends: fast (no interpreter teardown) unless it imported OneFlow, whose teardown waits for
its peers' (issue 64: a peer gone while rank 0 still ran its exit handlers got rank 0 aborted by
OneFlow's control client before its exit report). Real subprocesses: the fast path calls os._exit."""

from __future__ import annotations

import subprocess
import sys

ENDS = '''
import sys, types
if sys.argv[1] == "oneflow":
    sys.modules["oneflow"] = types.ModuleType("oneflow")  # what the rank's job imported
from pytest_gpumem.rankside import rank
try:
    rank._exit_fast(3)
except SystemExit as exc:
    print("teardown", exc.code)  # reached only through the interpreter's own exit
    raise
'''


def _end(imported: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", ENDS, imported], capture_output=True, text=True, timeout=60)


def test_a_rank_that_imported_oneflow_ends_through_the_teardown():
    done = _end("oneflow")
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "teardown 3", (done.stdout, done.stderr)


def test_a_rank_without_oneflow_ends_fast():
    done = _end("torch")
    assert done.returncode == 3, done.stderr
    assert "teardown" not in done.stdout, done.stdout
