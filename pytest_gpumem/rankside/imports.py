"""Run code right after a module is imported, without importing it first (ranks arm their watches on
torch this way: nothing is paid by a job that never imports it)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once ``name`` is imported: now if it is, else right after its ``__init__``."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    sys.meta_path.insert(0, _Watch(name, then))


class _Watch(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_original, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            exec_original(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
