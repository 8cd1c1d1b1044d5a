"""How a launch's ranks are started: the :class:`Launcher` protocol, and the registry of its
implementations. Each comes in one way, an entry point in the ``pytest_gpumem.launchers`` group:
the package's own (one module each in ``launching/launchers/``: direct, oneflow, torchrun, srun)
as an installed package's; the ``pytest_gpumem_launchers`` hook hands its launchers to the same :func:`add`.

The driver and the failure text ask a launcher what they need to know (where its GPUs come from,
where its launch folder lives, whether its ranks are on this host, what a rank's exit means); the
launch itself is the launcher's :class:`~..supervise.Launch` subclass. The marker's name is looked up
once, where a size starts (``SizeLaunch.plan``), and the object handed down; nothing compares a
launcher's name. A launcher of a team's own (``accelerate launch``, ``deepspeed``, ``mpirun``) comes
in without a fork of the plugin, from a conftest or plugin's hook or a package's entry point
(``gpumem measure`` reads those too); the marker and the options then accept its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from ...config.spec import launcher_entry_points
from ..supervise import describe_returncode

if TYPE_CHECKING:
    from ...config.spec import Spec
    from ..gpus import GpuPlan
    from ..supervise import Launch, LaunchRequest, LaunchResult


@dataclass(frozen=True)
class LauncherOptions:
    """The session's settings a launcher reads (today srun's only)."""

    shared_dir: Path | None = None     # --gpumem-slurm-dir; None: $SLURM_SUBMIT_DIR/.gpumem-slurm
    srun_args: tuple[str, ...] = ()    # --gpumem-srun-args, e.g. ("--gpus-per-task=1",)
    nnodes: int | None = None          # --gpumem-nnodes; the marker's nnodes wins


class Launcher(Protocol):
    """One way of starting a launch's ranks."""

    name: str
    per_rank: bool  # we start each rank ourselves: one exit code a rank, no launcher log
    remote: bool  # ranks may run on other hosts: their PIDs are not ours; each samples its own GPU

    def plan(self, spec: Spec, nproc: int) -> GpuPlan | None:
        """The launch's GPUs where the launcher gives them itself; None: leased here (``gpus.py``)."""
        ...

    def workdir(self, options: LauncherOptions) -> Path | None:
        """The launch folder where the ranks need one of the launcher's; None: a private local one."""
        ...

    def start(self, request: LaunchRequest, on_rank: Callable[[int, int], None],
              options: LauncherOptions) -> Launch:
        """The launch, ready to ``run()``."""
        ...

    def exit_text(self, launch: LaunchResult, rank: int) -> str:
        """How rank ``rank`` ended, as far as this launcher tells: ``exit code 1``, ``killed by SIGKILL``."""
        ...


class LocalLauncher:
    """What most launchers share: ranks on this host, started by one launcher process, GPUs leased
    here, a private local launch folder."""

    name: str  # each subclass's own
    per_rank = False
    remote = False
    framework: str | None = None  # the one framework its ranks run ("oneflow" for OneFlow's); None: any

    def plan(self, spec: Spec, nproc: int) -> GpuPlan | None:
        return None

    def workdir(self, options: LauncherOptions) -> Path | None:
        return None

    def exit_text(self, launch: LaunchResult, rank: int) -> str:
        return f"{self.name} launcher {describe_returncode(launch.launcher_returncode)}"


_REGISTRY: dict[str, Launcher] = {}
_BUILT_IN: set[str] = set()  # the package's own names, which no plugin may take over
_LOADED: list[bool] = []  # [True] once _load ran


def add(made: Launcher, source: str, name: str | None = None, built_in: bool = False) -> None:
    """Register a launcher (``source``: the entry point or plugin that gave it; ``name``: the entry
    point's, which must be the launcher's; ``built_in``: the package's own)."""
    _load()
    given = getattr(made, "name", None)
    if not isinstance(given, str) or not given:
        raise ValueError(f"{source}: a launcher must have a name (a str attribute); got {made!r}")
    if name is not None and given != name:
        raise ValueError(f"{source}: the entry point is named {name!r} but its launcher {given!r}; name them alike")
    name = given
    if name in _BUILT_IN:
        raise ValueError(f"{source}: launcher name {name!r} is pytest-gpumem's own; choose another name")
    missing = [a for a in ("per_rank", "remote", "plan", "workdir", "start", "exit_text") if not hasattr(made, a)]
    if missing:
        raise ValueError(f"{source}: launcher {name!r} lacks {', '.join(missing)}; subclass "
                         "pytest_gpumem.launching.launchers.LocalLauncher (or implement the Launcher protocol)")
    _REGISTRY[name] = made
    if built_in:
        _BUILT_IN.add(name)


def withdraw(name: str) -> None:
    """Forget a launcher :func:`add` registered (at the end of the session whose plugin gave it)."""
    if name not in _BUILT_IN:
        _REGISTRY.pop(name, None)


def _load() -> None:
    """The entry points of the group, the package's own first (once)."""
    if not _LOADED:
        _LOADED.append(True)
        points = launcher_entry_points()
        for point in sorted(points, key=lambda p: p.module.split(".")[0] != "pytest_gpumem"):
            given = point.load()
            add(given() if isinstance(given, type) else given, f"entry point {point.name} ({point.value})",
                point.name, built_in=point.module.split(".")[0] == "pytest_gpumem")


def launcher(name: str) -> Launcher:
    """The launcher registered as ``name``."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"launcher={name!r} is not registered: expected one of {', '.join(registered())}") \
            from None


def registered() -> list[str]:
    """The names of every launcher, sorted."""
    _load()
    return sorted(_REGISTRY)
