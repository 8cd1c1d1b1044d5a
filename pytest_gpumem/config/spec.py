"""Marker arguments -> a validated, frozen :class:`Spec`.

Validation happens here, at collection, so a typo fails before any process is launched.
Every error names the argument and what is accepted; the caller adds the test id.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Callable, Mapping

LAUNCHER_ENTRY_POINTS = "pytest_gpumem.launchers"  # an installed package's launchers: a Launcher class or object each


def launcher_entry_points() -> list[Any]:
    """The launchers' entry points (``importlib.metadata.EntryPoint``): the installed packages'; for a
    checkout run from the path without being installed (the GPU machine's ``PYTHONPATH=$PWD`` run, no
    metadata) the package's own as its pyproject.toml declares them, the one declaration."""
    import importlib.metadata
    from pathlib import Path

    points = list(importlib.metadata.entry_points(group=LAUNCHER_ENTRY_POINTS))
    if any(point.module.split(".")[0] == "pytest_gpumem" for point in points):
        return points
    try:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    except OSError:
        return points
    table = re.search(rf'^\[project\.entry-points\."{re.escape(LAUNCHER_ENTRY_POINTS)}"\]\n((?:[^\[\n].*\n|\n)*)',
                      text, re.M)
    return points + [importlib.metadata.EntryPoint(name, value, LAUNCHER_ENTRY_POINTS)
                     for name, value in re.findall(r'^(\w+) = "([\w.]+:\w+)"', table.group(1) if table else "", re.M)]


# The package's own, sorted (as the installed metadata lists them), from their one declaration:
# pyproject.toml's entry points. A plugin may add more (launching.launchers).
LAUNCHERS = tuple(sorted(point.name for point in launcher_entry_points()
                         if point.module.split(".")[0] == "pytest_gpumem"))
DEVICES = ("auto", "gpu", "cpu")
# How a world size is run (rankside.simulate): for real (every rank launched), simulated (the gated
# rank, or every rank for rank="all", alone with a stand-in communicator), or auto: for real where
# the GPUs exist, simulated above (torch only).
SIMULATE = ("auto", "on", "off")
# Whether a device="gpu" test runs on a fake GPU (rankside.fakegpu: every CUDA tensor a fake one,
# counted as torch's caching allocator counts it): auto where this machine has no GPU, on always,
# off never (without a GPU the test is then skipped, saying so).
FAKE_GPU = ("auto", "on", "off")
# What a simulated rank takes the values other ranks send to be (rankside.received): None stops a rank
# that reads them; "alike" fills them as every rank sending what this one sends.
ASSUME = ("alike",)
MAX_NPROC = 1024  # far above any single-host launch; catches nproc=80000 typos
# gpumem_tolerance's default, and a report's when it names none: "auto", resolved per comparison
# (Tolerance.resolve): the figure's measured spread decides, not one blanket share for every job.
DEFAULT_TOLERANCE = "auto"
# A host figure (the peak of live allocations) against a baseline recorded on the same CPU model:
# reruns read within 0.01 MiB and fresh installs within 0.3 MiB (benchmarks/results/travel_spread.txt,
# tolerance_power.txt), so 4 MiB is 13x the widest spread seen, and 1% keeps it in proportion for
# large jobs. It catches an FSDP2 reshard_after_forward=False (+9 MiB of 348) that the loose one passed.
EXACT_TOLERANCE = "max(1%, 4MiB)"
# Where the figure itself moves: NVML's per-process figure (2.8% between launches: docs/gpu.md), a
# resident set, or a host figure against a baseline from another CPU model (MKL's code paths: the script
# example read 5.0% lower on an AMD EPYC than on an Intel Xeon: docs/host.md).
MOVING_TOLERANCE = "max(5%, 32MiB)"
# The allocator's peak of live tensors (torch max_memory_allocated) read the same to 0.01 MiB in
# every launch of a job whose NVML figure moved by 2.8% (docs/gpu.md): a tolerance of its own,
# tight enough to catch a 1% growth of a 14 GiB job (140 MiB) and far above its measured spread.
DEFAULT_ALLOCATED_TOLERANCE = "max(0.5%, 16MiB)"

# Which figure each limit reads on a GPU (docs/gpu.md says why): "device" is NVML's per-process
# figure (what nvidia-smi shows, what runs out), "allocated" the framework allocator's peak of
# live tensors (exact, but without the CUDA context, the communicator's buffers and the cache).
# Where the framework reports no allocator figure (OneFlow 0.9), a limit reads "device". On host
# memory there is one figure, the peak of live allocations, and every limit reads it.
FIGURES = ("device", "allocated")
LIMITS = ("max_mib", "max_ratio", "baseline")
DEFAULT_FIGURES = (("baseline", "allocated"), ("max_mib", "device"), ("max_ratio", "allocated"))


class SpecError(ValueError):
    """A marker, ini or option value that cannot be used; the message says what is accepted."""


@dataclass(frozen=True)
class Ratio:
    """``max_ratio``: one cap for every size above the reference, or a cap per size. A job whose memory
    should stay flat (data parallel) takes one; a job whose memory should shrink with N (FSDP, ZeRO)
    takes one per size, since no single cap lets its healthy 2 through and stops a regressed 8."""

    flat: float | None = None
    sizes: tuple[tuple[int, float], ...] = ()  # (nproc, cap), sorted; used when ``flat`` is None

    def at(self, nproc: int) -> float | None:
        """The cap at ``nproc`` (None: no ratio check at that size)."""
        return self.flat if self.flat is not None else dict(self.sizes).get(nproc)

    def to_json(self) -> float | dict[str, float]:
        return self.flat if self.flat is not None else {str(n): cap for n, cap in self.sizes}

    def __str__(self) -> str:
        if self.flat is not None:
            return f"{self.flat:g}"
        return "{" + ", ".join(f"{n}: {cap:g}" for n, cap in self.sizes) + "}"


@dataclass(frozen=True)
class Tolerance:
    """Allowed drift above a baseline: a relative part, an absolute part, or both: the larger of the
    two, never their sum, hence its spelling ``max(5%, 32MiB)``."""

    percent: float | None = None
    mib: float | None = None
    auto: bool = False  # "auto": EXACT_TOLERANCE or MOVING_TOLERANCE, chosen per comparison (resolve)

    def resolve(self, exact: bool) -> Tolerance:
        """The tolerance a comparison uses: itself, or for ``auto`` the exact one where the figure
        compared reads the same on every rerun (a host figure, same CPU model), else the moving one."""
        if not self.auto:
            return self
        return parse_tolerance(EXACT_TOLERANCE if exact else MOVING_TOLERANCE)

    def allowance(self, baseline_mib: float) -> float:
        if self.auto:  # unresolved (a report read without its machine): the moving one, never tighter
            return self.resolve(exact=False).allowance(baseline_mib)
        parts = [0.0]
        if self.percent is not None:
            parts.append(baseline_mib * self.percent / 100.0)
        if self.mib is not None:
            parts.append(self.mib)
        return max(parts)

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        parts = []
        if self.percent is not None:
            parts.append(f"{self.percent:g}%")
        if self.mib is not None:
            parts.append(f"{self.mib:g}MiB")
        if len(parts) == 2:
            return f"max({parts[0]}, {parts[1]})"
        return parts[0] if parts else "0"

    def explain(self, baseline_mib: float) -> str:
        """The allowance over ``baseline_mib`` with its arithmetic: ``max(5% = 15.7, 32) MiB``,
        ``5% (15.7 MiB)``, ``32 MiB``."""
        if self.auto:
            return self.resolve(exact=False).explain(baseline_mib)
        if self.percent is not None:
            share = f"{self.percent:g}% = {baseline_mib * self.percent / 100.0:.1f}"
            if self.mib is not None:
                return f"max({share}, {self.mib:g}) MiB"
            return f"{self.percent:g}% ({baseline_mib * self.percent / 100.0:.1f} MiB)"
        return f"{self.mib:g} MiB" if self.mib is not None else "0 MiB"


_TOL_PART = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|MiB|GiB)\s*$")
_TOL_MAX = re.compile(r"^\s*max\s*\((.*)\)\s*$")
TOLERANCE_ACCEPTED = ('"auto" or a string like "5%", "256MiB" or "max(5%, 256MiB)" (the larger of the two)')



def parse_tolerance(value: Any, what: str = "tolerance") -> Tolerance:
    """Parse ``"auto"``, ``"5%"``, ``"256MiB"``, ``"1GiB"`` or ``"max(5%, 256MiB)"``."""
    accepted = TOLERANCE_ACCEPTED
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, str) and value.strip() == "auto":
        return Tolerance(auto=True)
    if isinstance(value, str):
        inside = _TOL_MAX.match(value)
        items = inside.group(1).split(",") if inside else [value]
    else:
        raise SpecError(f"{what}={value!r} is not accepted: expected {accepted}")
    percent: float | None = None
    mib: float | None = None
    for item in items:
        m = _TOL_PART.match(item)
        if not m:
            raise SpecError(f"{what}={value!r} is not accepted: expected {accepted} (non-negative)")
        number, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            percent = number
        else:
            mib = number * (1024.0 if unit == "GiB" else 1.0)
    return Tolerance(percent=percent, mib=mib)


# Mutation testing (make mutate) covers the tolerance code above; marker validation below is
# pinned by tests/unit/config/test_spec.py and tests/test_plugin.py, not by mutants.
# pragma: no mutate start
Check = Callable[[str, Any, "_Marker"], Any]  # (name, value, the marker's other values) -> the Spec's value


def _number(name: str, value: Any, *, positive: bool, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{name}={value!r} is not accepted: expected a number")
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise SpecError(f"{name}={value!r} is not accepted: expected a finite number")
    if positive and (number < 0 or (number == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise SpecError(f"{name}={value!r} is not accepted: expected a number {bound}")
    return number


def _positive(name: str, value: Any, marker: _Marker) -> float:
    return _number(name, value, positive=True)


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any, marker: _Marker) -> str:
        if value not in choices:
            raise SpecError(f"{name}={value!r} is not accepted: expected one of {', '.join(choices)}")
        return value

    return check


def _nproc(name: str, value: Any, marker: _Marker) -> tuple[int, ...]:
    accepted = f"an int or a list of ints from 1 to {MAX_NPROC}"
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise SpecError(f"nproc={value!r} is not accepted: expected {accepted}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= MAX_NPROC:
            raise SpecError(f"nproc={value!r} is not accepted: expected {accepted}")
    if len(set(items)) != len(items):
        raise SpecError(f"nproc={value!r} is not accepted: the sizes must be distinct")
    return tuple(sorted(items))


def _max_ratio(name: str, value: Any, marker: _Marker) -> Ratio | None:
    """A number, or a dict with a cap for each listed size above the reference and for no other."""
    if value is None:
        return None
    nproc, reference = marker["nproc"], marker["reference"]
    if not isinstance(value, Mapping):
        if isinstance(value, (list, tuple, set, str)):
            raise SpecError(f"max_ratio={value!r} is not accepted: expected a number > 0, or a dict from "
                            "nproc to a number > 0, e.g. {2: 0.8, 8: 0.6}")
        return Ratio(flat=_number("max_ratio", value, positive=True))
    above = [n for n in nproc if n > reference]
    wanted = ", ".join(map(str, above))
    for key, cap in value.items():
        if isinstance(key, bool) or not isinstance(key, int) or key not in above:
            raise SpecError(f"max_ratio={dict(value)!r} is not accepted: its keys are the listed sizes above the "
                            f"reference nproc={reference} ({wanted}), and {key!r} is not one of them")
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise SpecError(f"max_ratio={dict(value)!r} is not accepted: the cap for nproc={key} is {cap!r}, "
                            "expected a number > 0")
    missing = [n for n in above if n not in value]
    if missing:
        raise SpecError(f"max_ratio={dict(value)!r} is not accepted: it has no cap for nproc="
                        f"{', '.join(map(str, missing))}; give one for each listed size above the reference "
                        f"nproc={reference} ({wanted}), or drop that size from nproc")
    return Ratio(sizes=tuple(sorted((n, float(cap)) for n, cap in value.items())))


def _reference(name: str, value: Any, marker: _Marker) -> int:
    """The size the ratio is taken against: 1 (launched when unlisted), or a listed size below the largest."""
    if value is None:
        return 1
    nproc = marker["nproc"]
    listed = ", ".join(map(str, nproc))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"reference={value!r} is not accepted: expected 1 or one of the listed sizes ({listed})")
    if marker.value("max_ratio") is None:
        raise SpecError(f"reference={value!r} is not accepted without max_ratio: the reference is the size the "
                        "ratio is taken against; set max_ratio (or gpumem_max_ratio), or leave reference out")
    if value != 1 and value not in nproc:
        raise SpecError(f"reference={value!r} is not accepted: it is not among nproc=[{listed}]; a reference "
                        f"above 1 is launched as one of the listed sizes, so list it or take one of {listed}")
    if value >= max(nproc):
        raise SpecError(f"reference={value!r} is not accepted: the ratio gates the sizes above its reference, "
                        f"and nproc=[{listed}] has none above {value}; take a smaller one")
    return value


def _allow_mib(name: str, value: Any, marker: _Marker) -> float:
    return _number(name, value, positive=True, allow_zero=True)


def _rank(name: str, rank: Any, marker: _Marker) -> int | str:
    if rank != "all" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise SpecError(f"rank={rank!r} is not accepted: expected an int >= 0 or 'all'")
    nproc, reference = marker["nproc"], marker["reference"]
    if isinstance(rank, int) and rank >= min(nproc):
        raise SpecError(
            f"rank={rank!r} is not accepted: the smallest world size launched is {min(nproc)}, "
            f"so rank must be below it (or 'all')"
        )
    if isinstance(rank, int) and marker["max_ratio"] is not None and rank >= reference:
        raise SpecError(
            f"rank={rank!r} is not accepted with max_ratio: the ratio's reference is nproc={reference}, "
            f"which has no rank {rank}; name a listed size as the reference (reference={min(nproc)}) "
            "or gate a lower rank"
        )
    return rank


def _launcher(name: str, value: Any, marker: _Marker) -> str:
    return _one_of(marker.defaults.launchers)(name, value, marker)


def _tolerance(name: str, value: Any, marker: _Marker) -> Tolerance:
    return parse_tolerance(value, name)


def _env(name: str, value: Any, marker: _Marker) -> tuple[tuple[str, str], ...]:
    env = value or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SpecError(f"env={env!r} is not accepted: expected a dict of str to str")
    return tuple(sorted(env.items()))


def _program(name: str, value: Any, marker: _Marker) -> str | None:
    """``script`` or ``module``: at most one of them."""
    if name == "script" and value is not None and marker.value("module") is not None:
        raise SpecError("script and module are both given: expected at most one of them")
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"{name}={value!r} is not accepted: expected a non-empty string")
    return value


def _args(name: str, value: Any, marker: _Marker) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
        raise SpecError(f"args={value!r} is not accepted: expected a list of strings")
    if value and marker["script"] is None and marker["module"] is None:
        raise SpecError("args is given without script or module: args are passed to that program")
    return tuple(value)


def _config(name: str, value: Any, marker: _Marker) -> tuple[tuple[str, str], ...]:
    config = value or {}
    if not isinstance(config, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool))) for k, v in config.items()
    ):
        raise SpecError(f"config={config!r} is not accepted: expected a dict of str to str, number, bool or None")
    return tuple(sorted((k, str(v)) for k, v in config.items()))


def _nnodes(name: str, nnodes: Any, marker: _Marker) -> int | None:
    if nnodes is not None:
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_NPROC:
            raise SpecError(f"nnodes={nnodes!r} is not accepted: expected an int from 1 to {MAX_NPROC}")
        if (launcher := marker["launcher"]) != "srun":
            raise SpecError(f"nnodes={nnodes!r} is not accepted with launcher={launcher!r}: "
                            "nodes are for launcher='srun' (the other launchers start every rank on this host)")
    return nnodes


def _figures(name: str, value: Any, marker: _Marker) -> tuple[tuple[str, str], ...]:
    figures = value or {}
    if not isinstance(figures, Mapping) or not all(k in LIMITS and v in FIGURES for k, v in figures.items()):
        raise SpecError(f"figures={figures!r} is not accepted: expected a dict from {', '.join(LIMITS)} "
                        f"to {' or '.join(repr(f) for f in FIGURES)}, e.g. {{'max_ratio': 'device'}}")
    return tuple(sorted({**dict(DEFAULT_FIGURES), **dict(figures)}.items()))


def _assume(name: str, assume: Any, marker: _Marker) -> str | None:
    if assume is not None and assume not in ASSUME:
        raise SpecError(f"assume={assume!r} is not accepted: expected None or "
                        + ", ".join(repr(a) for a in ASSUME))
    return assume


def _fake_gpu(name: str, value: Any, marker: _Marker) -> str:
    fake_gpu = _one_of(FAKE_GPU)(name, value, marker)
    if fake_gpu == "on" and (device := marker["device"]) != "gpu":
        raise SpecError(f"fake_gpu='on' is not accepted with device={device!r}: a fake GPU stands in for "
                        "GPU memory, so it needs device='gpu'")
    return fake_gpu


def _argument(value: Any, accepted: str, meaning: str, check: Check, *, session: bool = False,
              shown: str | None = None) -> Any:
    """A field of :class:`Spec` that is a marker argument (see :class:`MarkerArgument`)."""
    return field(metadata={"argument": (value, accepted, meaning, check, session, shown)})


@dataclass(frozen=True)
class Spec:
    """What one ``gpumem`` marker asks for, fully resolved against the defaults. Each field is one
    marker argument, declared once: its type, default, help text and check."""

    nproc: tuple[int, ...] = _argument(1, f"an int or a list of distinct ints from 1 to {MAX_NPROC}",
                                       "the world sizes to launch", _nproc)
    max_mib: float | None = _argument(
        None, "a number > 0", "cap on the gated rank's peak, in MiB, at every launched size",
        lambda name, value, marker: None if value is None else _positive(name, value, marker))
    max_ratio: Ratio | None = _argument(
        None, "a number > 0, a dict from each listed nproc above the reference to a number > 0, or None (no ratio "
        "check)", "cap on peak(N) / peak(reference) of the gated rank at each listed N above the reference: one "
        "number for memory that should stay flat (data parallel), one per size for memory that should shrink with "
        "N (FSDP, ZeRO: e.g. {2: 0.8, 8: 0.6}); an nproc=1 reference is launched when the list lacks it (the report "
        "says so), and reused by later tests with the same launch parameters", _max_ratio, session=True)
    # the world size max_ratio is taken against: 1, or a listed size the job can run at
    reference: int = _argument(
        None, "1, or a listed nproc below the largest one", "the world size the ratio is taken against: a job that "
        "cannot run at one rank (tensor, pipeline, expert parallel) names its smallest size, e.g. nproc=[2, 8], "
        "reference=2", _reference, shown="1")
    allow_mib: float = _argument(
        0.0, "a number >= 0", "MiB allowed on top of the ratio for buffers that exist only when N > 1: the gate is "
        "peak(N) <= max_ratio * peak(reference) + allow_mib", _allow_mib, session=True)
    rank: int | str = _argument(0, "an int below the smallest nproc, or 'all'", "the rank that gates; 'all': the "
                                "largest rank, each rank held to its own baseline", _rank)
    device: str = _argument("auto", "one of " + ", ".join(DEVICES), "the memory that is gated: auto means GPU memory "
                            "where the ranks use a GPU, host memory otherwise", _one_of(DEVICES), session=True)
    launcher: str = _argument(
        "direct", "one of " + ", ".join(LAUNCHERS) + ", or one a plugin adds", "how the ranks start: direct (the "
        "plugin spawns them), python -m oneflow.distributed.launch, torchrun, one Slurm job step, or a launcher a "
        "plugin registers (pytest_gpumem_launchers)", _launcher, session=True)
    timeout: float = _argument(600.0, "a number of seconds > 0", "seconds for the whole launch", _positive,
                               session=True)
    tolerance: Tolerance = _argument(parse_tolerance(DEFAULT_TOLERANCE), TOLERANCE_ACCEPTED,
                                     "drift allowed above the stored baseline", _tolerance, session=True)
    env: tuple[tuple[str, str], ...] = _argument(None, "a dict of str to str",
                                                 "extra environment for the ranks, applied last", _env)
    script: str | None = _argument(None, "a path relative to the rootdir",
                                   "launch this program instead of the test body", _program)
    module: str | None = _argument(None, "a module name", "launch python -m MODULE instead of the test body",
                                   _program)
    args: tuple[str, ...] = _argument((), "a list of strings", "the arguments of script or module", _args)
    config: tuple[tuple[str, str], ...] = _argument(
        None, "a dict of str to str, number, bool or None", "settings that move memory: stored with the baseline, "
        "and a changed value is listed first when the test fails", _config)
    nnodes: int | None = _argument(None, f"an int from 1 to {MAX_NPROC}, at most nproc", "launcher='srun' only: "
                                   "nodes to spread the ranks over; None lets Slurm place them", _nnodes)
    figures: tuple[tuple[str, str], ...] = _argument(  # limit -> the figure it reads on a GPU
        None, f"a dict from {', '.join(LIMITS)} to 'device' or 'allocated'", "on a GPU, the figure each limit "
        "reads: device is what nvidia-smi shows, allocated is torch's max_memory_allocated; by default "
        + ", ".join(f"{limit} reads {figure}" for limit, figure in DEFAULT_FIGURES), _figures)
    allocated_tolerance: Tolerance = _argument(
        parse_tolerance(DEFAULT_ALLOCATED_TOLERANCE), TOLERANCE_ACCEPTED,
        "drift allowed above the baseline's allocator figure", _tolerance, session=True)
    simulate: str = _argument(
        "auto", "one of " + ", ".join(SIMULATE), "sizes above nproc=1 as a simulated world (torch; which ranks run: "
        "--gpumem-simulate); auto: the sizes that need more GPUs than there are; on: every size above 1; off: "
        "never", _one_of(SIMULATE), session=True)
    assume: str | None = _argument(
        None, "None or " + ", ".join(repr(a) for a in ASSUME), "what a simulated rank takes the values other ranks "
        "send to be, where the job reads them (token counts of expert routing, a received size): None stops the "
        "rank naming the read; 'alike' takes every rank as sending what this rank sends (a balanced router's token "
        "counts; a skewed router shows at its favourite expert's rank), and the report says the figure rests on it",
        _assume)
    fake_gpu: str = _argument(
        "auto", "one of " + ", ".join(FAKE_GPU), "device='gpu' tests on a fake GPU (torch): the job unchanged, every "
        "CUDA tensor a fake one, its allocator figure counted as on the emulated GPU model; auto where this machine "
        "has no GPU, on always, off never (a test with no GPU is then skipped)", _fake_gpu, session=True)

    def figure(self, limit: str) -> str:
        """The GPU figure ``limit`` (max_mib, max_ratio, baseline) reads: "device" or "allocated"."""
        return dict(self.figures)[limit]

    @property
    def sizes(self) -> tuple[int, ...]:
        """World sizes to launch: the requested ones, plus nproc=1 when the ratio is taken against it
        and the list lacks it (a reference above 1 is always a listed size)."""
        sizes = set(self.nproc)
        if self.max_ratio is not None:
            sizes.add(self.reference)
        return tuple(sorted(sizes))

    @property
    def body_mode(self) -> bool:
        return self.script is None and self.module is None

    def launch_key(self) -> tuple[Any, ...]:
        """What makes two launches interchangeable (everything but the world size and limits)."""
        return (self.launcher, self.device, self.env, self.script, self.module, self.args, self.nnodes)


@dataclass(frozen=True)
class MarkerArgument:
    """One argument of the ``gpumem`` marker, as its field of :class:`Spec` declares it: the parser
    accepts these names, the marker's help text and the docs' reference are written from them."""

    name: str
    value: Any  # where the marker leaves it out, unless ``session``: then the setting of the same name
    accepted: str
    meaning: str
    check: Check  # refuses a bad value, naming the argument and what is accepted; returns the Spec's value
    session: bool = False
    shown: str | None = None  # the default as the help text shows it, where not ``value``

    @property
    def default(self) -> str:
        """As the help text shows it; the ini key in brackets where the session supplies it."""
        return f"[gpumem_{self.name}]" if self.session else self.shown or str(self.value)


MARKER_ARGUMENTS = tuple(MarkerArgument(f.name, *f.metadata["argument"]) for f in fields(Spec))
_ARGUMENT = {argument.name: argument for argument in MARKER_ARGUMENTS}


class Defaults(make_dataclass(  # type: ignore[misc]
        "Defaults", [(a.name, Any, field(default=a.value)) for a in MARKER_ARGUMENTS if a.session]
        + [("launchers", tuple[str, ...], field(default=LAUNCHERS))], frozen=True)):
    """What the session supplies where a marker leaves an argument out: its settings of the same names
    (the arguments declared with ``session``), and the launcher names registered in it."""


def marker_signature() -> str:
    """``gpumem(nproc=1, max_mib=None, ...)``: the marker's arguments and defaults, for its help text."""
    return "gpumem(" + ", ".join(f"{a.name}={a.default}" for a in MARKER_ARGUMENTS) + ")"


class _Marker:
    """One marker's arguments while they are checked: each one's value (the marker's, else the
    session's or its own default) is checked once, when first asked for, so that a check may read another."""

    def __init__(self, given: Mapping[str, Any], defaults: Defaults) -> None:
        self.given, self.defaults, self._checked = given, defaults, dict[str, Any]()

    def value(self, name: str) -> Any:
        """The value before its check."""
        argument = _ARGUMENT[name]
        if name in self.given:
            return self.given[name]
        return getattr(self.defaults, name) if argument.session else argument.value

    def __getitem__(self, name: str) -> Any:
        if name not in self._checked:
            self._checked[name] = _ARGUMENT[name].check(name, self.value(name), self)
        return self._checked[name]


def parse_marker(args: tuple[Any, ...], kwargs: Mapping[str, Any], defaults: Defaults) -> Spec:
    """Validate one marker's arguments; ``gpumem(8)`` is ``gpumem(nproc=8)``."""
    if len(args) > 1:
        raise SpecError(f"takes at most one positional argument (nproc), got {len(args)}")
    kw = dict(kwargs)
    if args:
        if "nproc" in kw:
            raise SpecError("nproc is given both positionally and by name")
        kw["nproc"] = args[0]
    unknown = sorted(set(kw) - set(_ARGUMENT))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(_ARGUMENT), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SpecError(f"unknown argument {unknown[0]!r}: {hint}accepted are {', '.join(_ARGUMENT)}")
    marker = _Marker(kw, defaults)
    return Spec(**{name: marker[name] for name in _ARGUMENT})
# pragma: no mutate end
