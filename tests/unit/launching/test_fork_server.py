"""The fake GPU's warm server (launching.fork_server): what it imports once, and when a new one starts."""

from __future__ import annotations

import types
from pathlib import Path

from pytest_gpumem.config.env_names import ROOTDIR_ENV
from pytest_gpumem.launching.fork_server import WARM, server_key, warm_imports


def _module(path: Path) -> types.ModuleType:
    module = types.ModuleType(path.stem)
    module.__file__ = str(path)
    return module


def test_the_server_imports_the_frameworks_pytest_has_but_not_the_projects_own_modules(tmp_path):
    """The project's modules are imported afresh in each rank (as a fork from pytest does); an installed
    package under the project (a venv inside it) is a framework; OneFlow never (no fake GPU for it)."""
    project = tmp_path / "project"
    modules = {"transformers": _module(tmp_path / "site-packages" / "transformers" / "__init__.py"),
               "test_job": _module(project / "test_job.py"),
               "vendored": _module(project / ".venv" / "site-packages" / "vendored.py"),
               "oneflow.nn": _module(tmp_path / "site-packages" / "oneflow" / "nn.py"),
               "builtin_like": types.ModuleType("builtin_like")}
    names = warm_imports(str(project), modules)
    assert names[:len(WARM)] == list(WARM)
    assert {"transformers", "vendored"} <= set(names)
    assert not {"test_job", "oneflow.nn", "builtin_like"} & set(names)


def test_a_new_server_starts_where_what_it_loaded_with_differs_not_for_a_rank_s_own_variables(tmp_path):
    env = {ROOTDIR_ENV: str(tmp_path), "PYTHONPATH": "a", "OMP_NUM_THREADS": "1", "RANK": "0", "MASTER_PORT": "1"}
    same = server_key(env, tmp_path)
    assert server_key({**env, "RANK": "1", "MASTER_PORT": "2", "FAULT": "x"}, tmp_path) == same
    assert server_key({**env, "PYTHONPATH": "b"}, tmp_path) != same  # read as the interpreter starts
    assert server_key(env, tmp_path / "elsewhere") != same
