"""Session settings: command line > environment > ini file > default, resolved once.

Every option is declared once in :data:`OPTIONS`; ``plugin.py`` turns the table into pytest
options and ini keys, ``cli.py`` reads the same table. A bad value names where it came from:
``Invalid gpumem_timeout 'soon' from the ini file: expected a number of seconds > 0``.
The rank-side switches (``GPUMEM_FAST_EXIT``, ``GPUMEM_BOXING``) are in the table too: resolved in
the user's session like every other setting and handed to the ranks in their environment.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from .env_names import BOXING_ENV, FAST_EXIT_ENV, PYTHON_ALLOCATIONS_ENV, SITES_ENV, TRACK_ENV
from .spec import (
    DEFAULT_ALLOCATED_TOLERANCE,
    DEFAULT_TOLERANCE,
    DEVICES,
    FAKE_GPU,
    LAUNCHERS,
    SIMULATE,
    TOLERANCE_ACCEPTED,
    Defaults,
    SpecError,
    Tolerance,
    parse_tolerance,
)

# gpumem_fail_fast_grace's default: the other ranks' time to report their own failure once one failed
DEFAULT_FAIL_FAST_GRACE_S = 2.0


class SettingsError(ValueError):
    """A setting that cannot be used; the message names its source and what is accepted."""


def _positive_float(text: str) -> float:
    value = float(text)
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError("not a finite number > 0")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError("not a finite number >= 0")
    return value


def _ratio(text: str) -> float | None:
    if text.strip().lower() in ("", "none", "off"):
        return None
    return _positive_float(text)


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def _launcher_name(text: str) -> str:
    """A launcher's name; whether one is registered under it is known once plugins have loaded."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", text):
        raise ValueError(text)
    return text


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text)
    except SpecError as exc:
        raise ValueError(str(exc)) from exc


def _max_nproc(text: str) -> int | None:
    if text.strip().lower() in ("", "0", "none", "gpus"):
        return None  # the GPUs present decide
    value = int(text)
    if value < 1:
        raise ValueError("not an int >= 1")
    return value


def _shell_words(text: str) -> tuple[str, ...]:
    import shlex

    return tuple(shlex.split(text))


def _positive_int_or_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("negative")
    return value


def _auto_on_off(text: str) -> str:
    """auto, on or off; 1/0, true/false and yes/no (as environment variables are often set) mean on/off."""
    lowered = text.strip().lower()
    if lowered == "auto":
        return "auto"
    return "on" if _bool(lowered) else "off"


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class Option:
    """One setting, declared once for the command line, the environment and the ini file: its flag,
    variable and ini key are its name's (``--gpumem-lease-dir``, ``GPUMEM_LEASE_DIR``, ``gpumem_lease_dir``)
    unless ``flag`` or ``env`` says otherwise.

    ``shown_default``, when set, is what help texts say instead of the raw ``default`` (an empty
    default means no file, no folder: the text says what happens then).
    ``rank_env``: a switch the ranks read from their environment; the resolved value is passed
    to them under ``env`` as ``1`` or ``0``.
    """

    name: str
    parse: Callable[[str], Any]
    default: str
    accepted: str
    help: str
    shown_default: str = ""
    rank_env: bool = False
    const: str | None = None  # a flag that takes no value on the command line and means this value
    flag: str = ""
    env: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "flag", self.flag or "--gpumem-" + self.name.replace("_", "-"))
        object.__setattr__(self, "env", self.env or "GPUMEM_" + self.name.upper())

    @property
    def ini(self) -> str:
        return f"gpumem_{self.name}"

    @property
    def default_text(self) -> str:
        return self.shown_default or self.default


OPTIONS: tuple[Option, ...] = (
    Option("launcher", _launcher_name, "direct", "one of " + ", ".join(LAUNCHERS) + ", or one a plugin adds",
           "default launcher for gpumem tests (direct spawns the ranks itself: no launcher start-up cost)"),
    Option("timeout", _positive_float, "600", "a number of seconds > 0",
           "default seconds for a whole launch before every rank is killed"),
    Option("fail_fast_grace", _non_negative_float, f"{DEFAULT_FAIL_FAST_GRACE_S:g}", "a number of seconds >= 0",
           "seconds the other ranks get to end or report their own failure once a rank's test failed "
           "(reported before its fixtures' teardown) or a rank died; then the launch is ended"),
    Option("max_ratio", _ratio, "none", "a number > 0, or none",
           "default cap on peak(N)/peak(reference) of the gated rank (none: no ratio check; the "
           "reference is nproc=1 unless the marker names one)"),
    Option("allow_mib", _non_negative_float, "0", "a number of MiB >= 0",
           "default MiB allowed on top of the ratio for buffers that exist only when N > 1"),
    Option("tolerance", _tolerance, DEFAULT_TOLERANCE, TOLERANCE_ACCEPTED,
           "default allowed drift above a stored baseline (host figures, and the GPU device figure): a "
           "percentage, a size in MiB, or max(percentage, size): the larger of the two"),
    Option("allocated_tolerance", _tolerance, DEFAULT_ALLOCATED_TOLERANCE,
           'a string like "0.5%", "16MiB" or "max(0.5%, 16MiB)" (the larger of the two)',
           "default allowed drift of the GPU allocator figure (torch max_memory_allocated) above its baseline"),
    Option("device", _choice(DEVICES), "auto", "one of " + ", ".join(DEVICES),
           "default memory that is gated: auto (GPU where the ranks use one, host otherwise), gpu, cpu"),
    Option("interval_ms", _positive_float, "0", "a number of milliseconds > 0 (0: each sampler's default)",
           "sampling period of the GPU sampler and of the host RSS timeline; the gated host figure "
           "(live allocations) is exact whatever the period",
           shown_default="0: each sampler's own (GPU 2 ms, host 50 ms)"),
    Option("floor", _choice(("auto", "on", "off")), "auto", "one of auto, on, off",
           "measure an empty job of the same framework at each size and show floor and job apart "
           "(auto: for GPU figures, where the CUDA context and communicator are the floor)"),
    Option("floor_cache", str, "", "a file path, or off",
           "where floors are kept for later sessions, per machine, driver, framework, Python, launch and size "
           "(off: measured in every session)",
           shown_default="floors.json in a pytest-gpumem folder of $XDG_CACHE_HOME (~/.cache when unset)"),
    Option("startup_cache", str, "", "a file path, or off",
           "where the ranks' start-up figures (gpumem_host_startup=cached) are kept for later sessions, per "
           "machine, Python, installed versions, test, launch and size, checked against the rootdir files "
           "the ranks imported (off: measured in every session)",
           shown_default="startups.json beside the floor cache"),
    Option("track_host", _auto_on_off, "auto", "one of auto, on, off (also 1/0, true/false, yes/no)",
           "track each rank's host allocations (memray: the gated host figure). auto: where the host figure "
           "is gated, i.e. not in launches whose ranks have GPUs (device auto or gpu); off: host figures are "
           "the resident high-water mark (VmHWM)", env=TRACK_ENV),
    Option("python_allocations", _choice(("objects", "arenas")), "objects", "one of objects, arenas",
           "how the host tracker counts Python's own objects. objects: one by one, at their size (the figure is "
           "exact to the KiB; tracking costs ~1.8x the CPU of counting arenas); arenas: by the 1 MiB arenas of "
           "CPython's small-object allocator (cheaper; the figure moves by whole MiB between identical runs)",
           env=PYTHON_ALLOCATIONS_ENV),
    Option("host_startup", _choice(("cached", "tracked")), "cached", "one of cached, tracked",
           "how a pytest rank's start-up (interpreter, pytest, the test module and its framework) enters the "
           "host figure. cached: tracked in the first launch of a test at each size, its live and peak bytes "
           "at the setup kept (beside the floor cache) and added in later launches, which track from the "
           "setup only; tracked: every rank tracked whole"),
    Option("gpu_sampler", _choice(("parent", "rank")), "parent", "one of parent, rank",
           "who samples NVML for GPU figures: the parent pytest (by the ranks' PIDs) or a thread in each rank"),
    Option("baselines", str, "baselines", "a folder path, relative to the rootdir",
           "folder of the stored baselines"),
    Option("missing_baseline", _choice(("auto", "warn", "fail", "ignore")), "auto",
           "one of auto, warn, fail, ignore",
           "what a test without a baseline does: auto = fail when CI is set, warn otherwise"),
    Option("lease_dir", str, "", "a folder path (default: a private folder in the system temp dir)",
           "folder of the GPU lease locks shared by every pytest process on this host",
           shown_default="a private folder in the system temp dir"),
    Option("lease_wait", _positive_float, "600", "a number of seconds > 0",
           "how long a test waits for busy GPUs before it fails"),
    Option("torch_snapshot", str, "", "a folder path",
           "record torch CUDA allocator history in each rank and keep the snapshots of failing tests here",
           shown_default="none: no history recorded"),
    Option("markdown", str, "", "a file path",
           "write a Markdown summary for a PR comment (also appended to $GITHUB_STEP_SUMMARY when set)",
           shown_default="none: not written"),
    Option("plots", str, "", "a folder path", "write a memory-over-time PNG per gpumem test (needs matplotlib)",
           shown_default="none: no plots"),
    Option("benchmark_json", str, "", "a file path", "write github-action-benchmark's customSmallerIsBetter JSON",
           shown_default="none: not written"),
    Option("slurm_dir", str, "", "a folder path that every node of the allocation sees",
           "launcher=srun: where the ranks write their results",
           shown_default=".gpumem-slurm in $SLURM_SUBMIT_DIR"),
    Option("srun_args", _shell_words, "", 'srun options in one string, e.g. "--gpus-per-task=1 --cpus-per-task=8"',
           "launcher=srun: extra srun options for every launch (GPU binding, CPUs per task)",
           shown_default="none"),
    Option("nnodes", _positive_int_or_zero, "0", "a whole number >= 1 (0: Slurm places the ranks)",
           "launcher=srun: nodes to spread each launch over (a marker's nnodes wins; never more than nproc)"),
    Option("report", str, "", "a file path", "write a JSON report of every gpumem test to this file",
           shown_default="none: not written"),
    Option("max_nproc", _max_nproc, "gpus", "an int >= 1, or gpus (the GPUs present)",
           "largest world size launched; larger nproc sizes are predicted from the launched ones",
           shown_default="gpus: the GPUs present where the ranks use GPUs; on host memory, what the host's "
                         "memory can hold (30 MiB a rank)"),
    Option("predict", _bool, "1", "1 or 0 (true/false, on/off)",
           "skip, instead of predict, nproc sizes above the launch cap", const="0",
           shown_default="predict", flag="--gpumem-no-predict"),
    Option("simulate", _choice(SIMULATE), "auto", "one of " + ", ".join(SIMULATE),
           "run sizes as a simulated world (torch): the gated rank (every rank for rank='all', and at the "
           "smallest simulated size above 1 where none above 1 is launched, without assume; on GPUs as many "
           "at a time as there are GPUs) alone with a stand-in communicator keeping every tensor's size: its "
           "allocator figure is the real one. "
           "auto: the sizes that need more GPUs than there are; on: every size above 1; off: never (larger "
           "sizes are then predicted or shown as not launched). A marker's simulate wins"),
    Option("fake_gpu", _choice(FAKE_GPU), "auto", "one of " + ", ".join(FAKE_GPU),
           "run device='gpu' tests on a fake GPU (torch; docs/fake-gpu.md): the job as written for CUDA, "
           "every CUDA tensor a fake one, every size a simulated world. auto: where this machine has no GPU; "
           "on: always; off: never. A marker's fake_gpu wins"),
    Option("fake_gpu_model", str, "NVIDIA H200", "a GPU model built in, or one gpumem calibrate recorded",
           "the GPU model a fake GPU emulates (its properties and library workspaces; gpumem calibrate "
           "records another)"),
    Option("unlaunched", _choice(("auto", "warn", "fail")), "auto", "one of auto, warn, fail",
           "what a scaling test does when no size above nproc=1 could be gated (too few GPUs, nothing "
           "simulated or predicted): auto = fail when CI is set, warn otherwise"),
    Option("fast_exit", _bool, "on", "on or off (also 1/0, true/false, yes/no)",
           "ranks but OneFlow's (its teardown waits for peers) end without the interpreter's teardown once "
           "threads and atexit handlers are done (off: the full teardown, 150-500 ms more per rank)",
           rank_env=True, env=FAST_EXIT_ENV),
    Option("start", _choice(("auto", "fork", "exec")), "auto", "one of auto, fork, exec",
           "how a direct launch starts its ranks. fork: from pytest, which has the test module and its "
           "frameworks imported already (no second interpreter, pytest start-up and collection: ~1.5 s a "
           "rank for a test file importing torch); exec: a fresh interpreter each. auto: fork the ranks of "
           "GPU launches, where the gated figure is GPU memory; a fake GPU's from a warm process "
           "that loaded torch once a session. Either way a rank is exec'd where a fork "
           "would change it: host allocations tracked, a start-up variable (PYTHON*, LD_*...) set for the "
           "ranks, CUDA initialised or OneFlow imported in pytest (docs/gpu.md)"),
    Option("boxing", _bool, "on", "on or off (also 1/0, true/false, yes/no)",
           "audit OneFlow's SBP conversions (eager and nn.Graph) in each rank and store it with the baseline",
           rank_env=True, env=BOXING_ENV),
    Option("sites", _auto_on_off, "auto", "one of auto, on, off (also 1/0, true/false, yes/no for on/off)",
           "peak sites: where the memory live at each rank's peak was allocated, listed when they grew in a "
           "failure. Host: read from memray's capture. GPU (torch's allocator history, whose first reading "
           "costs up to ~1 s a rank): auto records it when refreshing and relaunches a failing size with it; "
           "on records it in every launch; off: no sites", env=SITES_ENV),
)

_BY_NAME = {option.name: option for option in OPTIONS}
_OPTIONS_SPARED_FROM_ZERO = {"interval_ms"}


@dataclass(frozen=True)
class Settings:
    """The resolved session settings, one field per option of :data:`OPTIONS` (its default is declared
    there, once) and the two switches pytest's own flags give (``enabled``, ``refresh``)."""

    enabled: bool
    refresh: bool
    launcher: str
    timeout: float
    max_ratio: float | None
    allow_mib: float
    tolerance: Tolerance
    allocated_tolerance: Tolerance
    device: str
    interval_ms: float
    floor: str
    floor_cache: Path | None  # None: off
    startup_cache: Path | None  # None: off
    track_host: str
    gpu_sampler: str
    baselines: Path
    missing_baseline: str
    lease_dir: Path | None
    lease_wait: float
    torch_snapshot: Path | None
    markdown: Path | None
    plots: Path | None
    benchmark_json: Path | None
    report: Path | None
    fast_exit: bool
    boxing: bool
    sites: str
    python_allocations: str
    host_startup: str
    slurm_dir: Path | None
    srun_args: tuple[str, ...]
    nnodes: int
    max_nproc: int | None
    predict: bool
    start: str
    simulate: str
    unlaunched: str
    fail_fast_grace: float
    fake_gpu: str
    fake_gpu_model: str

    def defaults(self, launchers: tuple[str, ...] = LAUNCHERS) -> Defaults:
        """What a marker leaves out: the settings of the same names; ``launchers``: those registered."""
        return Defaults(launchers=launchers, **{f.name: getattr(self, f.name) for f in fields(Defaults)
                                                if f.name != "launchers"})

    def make_output_folders(self) -> None:
        """Create where the outputs go, so that a bad path is known before any launch."""
        for name in ("report", "markdown", "benchmark_json", "plots"):
            path = getattr(self, name)
            if path is None:
                continue
            folder = path if name == "plots" else path.parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SettingsError(f"gpumem_{name} {str(path)!r}: cannot create {str(folder)!r} "
                                    f"({exc.strerror or exc}); expected a writable path") from None

    def rank_env(self) -> dict[str, str]:
        """The rank-side switches, as the ranks read them from their environment."""
        return {option.env: "1" if getattr(self, option.name) else "0"
                for option in OPTIONS if option.rank_env and option.env}

    @property
    def fail_on_unlaunched(self) -> bool:
        """Whether a scaling test that gated nothing above nproc=1 fails (else it warns)."""
        return self.unlaunched == "fail" or (self.unlaunched == "auto" and bool(os.environ.get("CI")))

    @property
    def fail_on_missing_baseline(self) -> bool | None:
        """True: fail, False: warn, None: say nothing."""
        mode = self.missing_baseline
        if mode == "auto":
            return bool(os.environ.get("CI"))
        return {"fail": True, "warn": False, "ignore": None}[mode]


def _parse(option: Option, text: str, source: str) -> Any:
    if option.name in _OPTIONS_SPARED_FROM_ZERO and text.strip() == "0":
        return 0.0
    try:
        return option.parse(text)
    except (ValueError, TypeError):
        raise SettingsError(
            f"Invalid {option.ini} {text!r} from {source}: expected {option.accepted}"
        ) from None


def resolve(
    cli: Mapping[str, str | None],
    env: Mapping[str, str],
    ini: Mapping[str, str | None],
    *,
    rootdir: Path,
    enabled: bool,
    refresh: bool,
) -> Settings:
    """Take each value from the first source that sets it: command line, environment, ini, default."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if cli.get(option.name) is not None:
            text, source = str(cli[option.name]), f"the command line ({option.flag})"
        elif option.env and env.get(option.env):
            text, source = env[option.env], f"the {option.env} environment variable"
        elif ini.get(option.name):
            text, source = str(ini[option.name]), "the ini file"
        else:
            text, source = option.default, "the default"
        values[option.name] = _parse(option, text, source)
    baselines = Path(values.pop("baselines"))
    cache_text = values.pop("floor_cache").strip()
    floor_cache = (None if cache_text.lower() in ("off", "none") else
                   Path(os.path.expanduser(cache_text)) if cache_text else default_floor_cache(env))
    startup_text = values.pop("startup_cache").strip()
    startup_cache = (None if startup_text.lower() in ("off", "none") else
                     Path(os.path.expanduser(startup_text)) if startup_text
                     else default_floor_cache(env).with_name("startups.json"))
    texts = {name: values.pop(name) for name in
             ("report", "lease_dir", "torch_snapshot", "markdown", "plots", "benchmark_json", "slurm_dir")}
    paths: dict[str, Any] = {name: Path(text) if text else None for name, text in texts.items()}
    return Settings(
        enabled=enabled,
        refresh=refresh,
        baselines=baselines if baselines.is_absolute() else rootdir / baselines,
        floor_cache=floor_cache,
        startup_cache=startup_cache,
        **paths,
        **values,
    )


def default_floor_cache(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/pytest-gpumem/floors.json``, or under ``~/.cache`` when that is unset or not
    absolute (the XDG rule)."""
    base = env.get("XDG_CACHE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path(os.path.expanduser("~")) / ".cache"
    return root / "pytest-gpumem" / "floors.json"


def option(name: str) -> Option:
    return _BY_NAME[name]


def unsupported_platform(platform: str | None = None) -> str | None:
    """Why gpumem tests cannot run here, or None on Linux (ranks read /proc and use prctl)."""
    platform = sys.platform if platform is None else platform
    if platform.startswith("linux"):
        return None
    return f"pytest-gpumem runs on Linux only (it reads /proc and uses prctl); this is {platform}"


def rootdir_conflict(args: list[str], invocation_dir: Path, rootdir: Path) -> str | None:
    """Why a run whose rootdir (and so whose baselines folder) came from one of our option values
    must stop, or None.

    pytest picks the rootdir from the command line's paths before plugins declare their options,
    so in ``--gpumem-plots /tmp/x`` the folder counts as a path: without an ini file or --rootdir
    the rootdir moves to ``/tmp`` and baselines would be read from and written to ``/tmp/baselines``.
    """
    flags = {o.flag for o in OPTIONS}
    for flag, value in zip(args, args[1:]):
        if flag in flags and Path(invocation_dir, value).exists():
            return (f"{flag} {value}: pytest took {value!r} for a test path when it chose the "
                    f"rootdir ({rootdir}), where the baselines folder is found. Write {flag}={value}, "
                    "or pass --rootdir, or give the project an ini file (pytest.ini, or [tool.pytest.ini_options] "
                    "in pyproject.toml)")
    return None
