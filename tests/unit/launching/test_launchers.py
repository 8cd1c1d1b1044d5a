"""Launchers are chosen by asking a registered Launcher, never by comparing a name: one module per
launcher in launching/launchers/, and the names the marker accepts are exactly the registered ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpumem.config.spec import LAUNCHERS
from pytest_gpumem.launching.launchers import launcher, registered

PACKAGE = Path(__file__).resolve().parents[3] / "pytest_gpumem"


def test_the_marker_accepts_exactly_the_registered_launchers():
    assert registered() == sorted(LAUNCHERS)
    for name in LAUNCHERS:
        assert launcher(name).name == name


def test_an_unknown_launcher_says_which_are_registered():
    with pytest.raises(ValueError, match=r"launcher='mpirun' is not registered: expected one of direct, oneflow"):
        launcher("mpirun")


def test_only_the_srun_launcher_has_remote_ranks_and_only_direct_starts_each_rank():
    assert [name for name in registered() if launcher(name).remote] == ["srun"]
    assert [name for name in registered() if launcher(name).per_rank] == ["direct"]


def test_no_module_compares_a_launcher_s_name():
    """config/ is the exception: it validates the marker a layer below the launchers (nnodes is srun's)."""
    compare = re.compile(r"launcher\s*(==|!=|in|not in)\s*[(\"']")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py") if path.parent.name != "config"
             for n, line in enumerate(path.read_text().splitlines(), 1) if compare.search(line)]
    assert found == [], "ask the Launcher (launching/launchers/__init__.py) instead of comparing its name"


def test_a_checkout_on_the_path_not_installed_finds_the_launchers_its_pyproject_declares(monkeypatch):
    """The GPU machine runs the plugin from a checkout (PYTHONPATH=$PWD): no metadata, no entry points."""
    import importlib.metadata

    from pytest_gpumem.config.spec import LAUNCHER_ENTRY_POINTS, launcher_entry_points
    from pytest_gpumem.launching import launchers as module

    installed = {p.name: p.value for p in importlib.metadata.entry_points(group=LAUNCHER_ENTRY_POINTS)
                 if p.module.startswith("pytest_gpumem.")}
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert {p.name: p.value for p in launcher_entry_points()} == installed  # one declaration, read two ways
    monkeypatch.setattr(module, "_LOADED", [])
    monkeypatch.setattr(module, "_REGISTRY", {})
    monkeypatch.setattr(module, "_BUILT_IN", set())
    assert module.registered() == sorted(LAUNCHERS)
