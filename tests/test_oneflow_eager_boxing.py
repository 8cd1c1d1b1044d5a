"""Which SBP conversion, on which line, how much: OneFlow twins under the plugin (2 CPU ranks).

One session launches three tests at nproc 1 and 2 (about a minute on 2 cores): the eager twins (an
activation broadcast the job wrote, a gather SBP inference inserted, a batch broadcast), the same
twins under nn.Graph, and a healthy data-parallel job whose failure (a cap it cannot meet) must list
no new conversion.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("oneflow")
pytestmark = [pytest.mark.oneflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TWINS = REPO / "tests" / "data" / "oneflow_twins.py"

TESTS = '''
import pytest
import oneflow_twins as twins


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.05, launcher="direct")
def test_eager_twins():
    assert twins.run(broadcast_activation=True) > 0
    assert twins.run(mix=True) > 0
    assert twins.run(broadcast_batch=True) > 0


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.05, launcher="direct")
def test_graph_twins():
    assert twins.run(graph=True, broadcast_activation=True) > 0
    assert twins.run(graph=True, mix=True) > 0
    assert twins.run(graph=True, broadcast_batch=True) > 0


@pytest.mark.gpumem(nproc=[1, 2], max_mib=1, launcher="direct")
def test_healthy_dp():
    """Fails on purpose (no job fits 1 MiB) so that its audit is printed."""
    assert twins.train_data_parallel() >= 0
'''


def _line(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def session(path: Path) -> tuple[str, dict[str, str], Path]:
    """The three tests run once, in a pytest of their own: its output, each failure's text, its folder."""
    (path / "oneflow_twins.py").write_text(TWINS.read_text())
    (path / "test_twins.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPUMEM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(path), "--gpumem-markdown", "summary.md", "test_twins.py"],
                          cwd=path, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout
    (path / "output.txt").write_text(text + proc.stderr)
    failures = {}
    for name in ("test_eager_twins", "test_graph_twins", "test_healthy_dp"):
        assert f"_ {name} _" in text, text[-5000:]
        start = text.index(f"_ {name} _")
        end = text.find("\n____", start + 1)
        failures[name] = text[start:end if end > 0 else None]
    return text, failures, path


SOURCE = TWINS.read_text()
TO_GLOBAL = f"oneflow_twins.py:{_line(SOURCE, 'h = h.to_global(sbp=flow.sbp.broadcast)')} forward"
MIX = f"oneflow_twins.py:{_line(SOURCE, 'SBP inference boxes here')} forward"
BATCH = f"oneflow_twins.py:{_line(SOURCE, 'x = x.to_global(sbp=flow.sbp.broadcast)')} run"


def test_oneflow_twins_name_the_conversion_its_line_and_its_size(tmp_path):
    """One session for every check (under xdist a module fixture may run once a worker)."""
    _, failures, path = session(tmp_path)
    eager_twins(failures["test_eager_twins"])
    graph_twins(failures["test_graph_twins"])
    healthy(failures["test_healthy_dp"])
    summary = (path / "summary.md").read_text()
    assert f"S(0)->B at {TO_GLOBAL}" in summary, summary  # the Markdown summary carries the lines


def eager_twins(text: str) -> None:
    section = text[text.index("eager boxing (SBP conversions) at nproc=2 against nproc=1:"):]
    lines = [line.strip() for line in section.splitlines()[1:5]]
    # first after the headline (and what changed): before the sites and the figures
    assert text.index("eager boxing") < text.index("per-rank peaks"), text
    by_line = {line.split(": ")[0]: line for line in lines}
    assert f"S(0)->B at {TO_GLOBAL}" in by_line, lines
    assert by_line[f"S(0)->B at {TO_GLOBAL}"].startswith(
        f"S(0)->B at {TO_GLOBAL}: +16.0 MiB at nproc=2 (none at nproc=1); to_global of (8192, 1024) float32, x2")
    assert by_line[f"S(0)->B at {BATCH}"].startswith(  # the batch, before the call
        f"S(0)->B at {BATCH}: +4.0 MiB at nproc=2 (none at nproc=1); to_global of (8192, 256) float32, x1")
    assert by_line[f"S(0)->B at {MIX}"].startswith(  # the gather SBP inference inserted
        f"S(0)->B at {MIX}: +128.0 KiB at nproc=2 (not at nproc=1); inferred of (256, 256) float32"), lines
    assert not any(line.startswith("P->") for line in lines), lines


def graph_twins(text: str) -> None:
    """The same twins under nn.Graph name the same lines."""
    assert re.search(rf"{re.escape(TO_GLOBAL)}: net-matmul-\d+/out_0 \(8192, 1024\) float32 into", text), text
    assert re.search(rf"{re.escape(MIX)}: net-add_n-\d+/out_0 \(256, 256\) float32 into net-matmul", text), text
    # the batch broadcast before the graph call is eager: named by the eager section
    assert f"S(0)->B at {BATCH}: +4.0 MiB at nproc=2 (none at nproc=1)" in text, text
    # and the graph's own input is named with what a rank holds of it
    assert re.search(r"graph input _Step_\d+_input\.0\.0 \(8192, 256\) float32: B, 8\.0 MiB a rank at nproc=2 "
                     r"\(B, 4\.0 MiB at nproc=1\)", text), text


def healthy(text: str) -> None:
    """A healthy data-parallel job lists no new conversion (its gradients' P->B is expected)."""
    assert "eager boxing (SBP conversions) at nproc=2 against nproc=1: no new conversions" in text, text
    assert "new: P->B" not in text, text
