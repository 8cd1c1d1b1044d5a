"""What `make demo` and `make test` build on a fresh clone (issue 55: `make demo` spent most of its ten
minutes building DeepSpeed and the test frameworks, which its examples never import).

``make -n -B`` prints every command a fresh clone would run, running none.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def commands(target: str) -> str:
    done = subprocess.run(["make", "-n", "-B", target, "PY310=python3.10", "PY311=python3.11"], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout


def test_make_demo_installs_torch_and_the_plugin_and_no_test_framework():
    demo = commands("demo")
    assert '-m pip install -q "torch==2.13.0"' in demo and '-m pip install -q -e ".[torch' in demo
    assert "frameworks" not in demo and "deepspeed" not in demo.lower()


def test_make_test_installs_the_test_frameworks():
    test = commands("test")
    assert "--target .venv-torch/frameworks -r tests/frameworks.txt" in test and "deepspeed==" in test
