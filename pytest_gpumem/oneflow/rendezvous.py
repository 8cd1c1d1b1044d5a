"""Keep OneFlow's ranks out of its 10 s reconnect sleep.

OneFlow's ``RpcClient::LoadServer`` sleeps 10 s after a refused connection, so any rank > 0 that
dials rank 0 before rank 0 listens loses 10 s ("LoadServer ... Failed at 0 times"); it happened to
a third of 2-rank launches, through the raw launcher as well. Ranks > 0 therefore wait, right
before OneFlow's env init, until rank 0's port is listening. Imports still overlap; nothing else
changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from types import ModuleType
from typing import Any, Mapping, Sequence

_TARGET = "oneflow.framework.env_util"
WAIT_LIMIT_S = 60.0


def listening(port: int) -> bool:
    """Whether a local socket listens on ``port`` (state 0A in /proc/net/tcp*)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _wait_for_master() -> None:
    port, end = int(os.environ["MASTER_PORT"]), time.monotonic() + WAIT_LIMIT_S
    while not listening(port) and time.monotonic() < end:
        time.sleep(0.01)


class _Gate(importlib.abc.MetaPathFinder):
    """Wraps ``env_util.GetEnv`` as the module is loaded: the first call waits for rank 0."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:  # oneflow's env_util
            exec_module(module)
            get_env = module.GetEnv

            def GetEnv() -> Any:  # noqa: N802 - OneFlow's name
                _wait_for_master()
                return get_env()

            module.GetEnv = GetEnv

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def install_oneflow_gate(env: Mapping[str, str] = os.environ) -> bool:
    """In a rank > 0 of a local multi-rank launch, before anything imports oneflow."""
    local = env.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost")
    if env.get("RANK", "0") == "0" or int(env.get("WORLD_SIZE", "1")) < 2 or not local:
        return False
    if not sys.platform.startswith("linux") or "MASTER_PORT" not in env:
        return False
    sys.meta_path.insert(0, _Gate())
    return True
