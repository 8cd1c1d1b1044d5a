"""The eager recorder costs nothing in a rank that never imports OneFlow: no import, no environment
change, no file (a fresh interpreter; OneFlow not needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_a_rank_without_oneflow_is_left_as_it_was(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from pytest_gpumem.oneflow import eager
        before = dict(os.environ)
        eager.install_eager_hook(Path({str(tmp_path / 'rank-0.eager')!r}), None, Path({str(tmp_path / 'glog')!r}))
        import json, email.message
        eager.write_records()
        print("oneflow" in sys.modules, dict(os.environ) == before)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith("GLOG_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    assert list(tmp_path.iterdir()) == []
