"""pytest-gpumem: run a test as a real multi-process launch and gate each rank's peak memory."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package (e.g. inside a rank or the CLI) does not import pytest.
    if name == "gpumem":
        from .plugin import gpumem

        return gpumem
    raise AttributeError(name)
