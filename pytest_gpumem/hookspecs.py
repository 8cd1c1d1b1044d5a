"""The hooks pytest-gpumem calls on other plugins and conftests (as pytest-xdist's ``newhooks``)."""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("pytest")


@hookspec
def pytest_gpumem_launchers() -> list[Any]:  # type: ignore[empty-body]  # a spec: never called
    """Launchers to register for this session: objects of the Launcher protocol
    (``pytest_gpumem.launching.launchers``), most simply a ``LocalLauncher`` subclass's instance whose
    ``start`` returns a ``Launch``. Each answers to its ``name`` in the marker and the options
    (``launcher="mpirun"``). Called once, at configure, in the session a user starts."""
