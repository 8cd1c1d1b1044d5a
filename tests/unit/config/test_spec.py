"""Marker arguments: every bad value is refused with the argument and what is accepted."""

import math

import pytest

from pytest_gpumem.config.spec import Defaults, Ratio, SpecError, Tolerance, parse_marker, parse_tolerance

D = Defaults()


def spec(*args, **kwargs):
    return parse_marker(args, kwargs, D)


def test_defaults_and_positional_nproc():
    s = spec(4)
    assert s.nproc == (4,) and s.rank == 0 and s.launcher == "direct" and s.max_ratio is None
    assert s.sizes == (4,)


def test_ratio_adds_the_reference_size():
    s = spec(nproc=[8, 2], max_ratio=1.2)
    assert s.nproc == (2, 8) and s.sizes == (1, 2, 8)


def test_an_assumption_on_received_values_is_kept_and_none_is_the_default():
    assert spec(assume="alike").assume == "alike" and spec().assume is None


def test_a_named_reference_launches_only_the_listed_sizes():
    s = spec(nproc=[2, 8], max_ratio=1.1, reference=2)
    assert s.reference == 2 and s.sizes == (2, 8)  # no nproc=1 a TP=2 job cannot build its mesh at
    assert spec(nproc=[2, 8], max_ratio=1.1).reference == 1


def test_ini_ratio_default_and_none_turns_it_off():
    defaults = Defaults(max_ratio=1.3, allow_mib=512)
    assert parse_marker((), {"nproc": 2}, defaults).max_ratio == Ratio(flat=1.3)
    off = parse_marker((), {"nproc": 2, "max_ratio": None}, defaults)
    assert off.max_ratio is None and off.sizes == (2,)


def test_a_cap_per_size_for_a_job_that_shrinks_with_n():
    s = spec(nproc=[2, 8], max_ratio={8: 0.3, 2: 0.6})
    assert s.max_ratio == Ratio(sizes=((2, 0.6), (8, 0.3))) and s.sizes == (1, 2, 8)
    assert (s.max_ratio.at(2), s.max_ratio.at(8), s.max_ratio.at(4)) == (0.6, 0.3, None)
    assert str(s.max_ratio) == "{2: 0.6, 8: 0.3}" and str(spec(nproc=2, max_ratio=1.2).max_ratio) == "1.2"
    assert spec(nproc=[2, 4, 8], max_ratio={4: 1.0, 8: 0.5}, reference=2).max_ratio.at(8) == 0.5


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"nproc": [2, 8], "max_ratio": {2: 0.6}},
         "max_ratio={2: 0.6} is not accepted: it has no cap for nproc=8; give one for each listed size above the "
         "reference nproc=1 (2, 8), or drop that size from nproc"),
        ({"nproc": [2, 8], "max_ratio": {2: 0.6, 8: 0.3, 4: 0.4}},
         "its keys are the listed sizes above the reference nproc=1 (2, 8), and 4 is not one of them"),
        ({"nproc": [2, 8], "max_ratio": {2: 0.6, 8: 0.3}, "reference": 2},
         "its keys are the listed sizes above the reference nproc=2 (8), and 2 is not one of them"),
        ({"nproc": [2, 8], "max_ratio": {"2": 0.6, 8: 0.3}}, "and '2' is not one of them"),
        ({"nproc": [2, 8], "max_ratio": {2: 0.6, 8: -1}}, "the cap for nproc=8 is -1, expected a number > 0"),
        ({"nproc": [2, 8], "max_ratio": {2: 0.6, 8: math.nan}}, "the cap for nproc=8 is nan"),
        ({"nproc": [2, 8], "max_ratio": [0.6, 0.3]},
         "max_ratio=[0.6, 0.3] is not accepted: expected a number > 0, or a dict from nproc to a number > 0"),
    ],
)
def test_a_bad_cap_per_size_names_what_is_accepted(kwargs, fragment):
    with pytest.raises(SpecError) as info:
        spec(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"nprocs": 2}, "unknown argument 'nprocs': did you mean 'nproc'? accepted are "),
        ({"nproc": 2, "max_ration": 1.2}, "unknown argument 'max_ration': did you mean 'max_ratio'? "),
        ({"nproc": 2, "zzz": 1}, "unknown argument 'zzz': accepted are "),
        ({"nproc": 0}, "nproc=0 is not accepted: expected an int or a list of ints from 1 to 1024"),
        ({"nproc": -2}, "nproc=-2"),
        ({"nproc": 100000}, "from 1 to 1024"),
        ({"nproc": [1, 1]}, "distinct"),
        ({"nproc": []}, "nproc=[]"),
        ({"nproc": 2.0}, "nproc=2.0"),
        ({"nproc": True}, "nproc=True"),
        ({"max_mib": "lots"}, "max_mib='lots' is not accepted: expected a number"),
        ({"simulate": True}, "simulate=True is not accepted: expected one of auto, on, off"),
        ({"fake_gpu": "yes"}, "fake_gpu='yes' is not accepted: expected one of auto, on, off"),
        ({"fake_gpu": "on", "device": "cpu"}, "fake_gpu='on' is not accepted with device='cpu'"),
        ({"max_mib": -1}, "expected a number > 0"),
        ({"max_ratio": -1.0}, "max_ratio=-1.0"),
        ({"max_ratio": 0}, "max_ratio=0"),
        ({"max_ratio": math.nan}, "finite"),
        ({"allow_mib": -5}, "allow_mib=-5 is not accepted: expected a number >= 0"),
        ({"rank": "first"}, "rank='first' is not accepted: expected an int >= 0 or 'all'"),
        ({"nproc": 2, "rank": 2}, "rank must be below it"),
        ({"device": "tpu"}, "device='tpu' is not accepted: expected one of auto, gpu, cpu"),
        ({"launcher": "mpirun"}, "launcher='mpirun' is not accepted: expected one of direct, oneflow, srun, torchrun"),
        ({"timeout": 0}, "timeout=0"),
        ({"tolerance": "5"}, "tolerance='5' is not accepted"),
        ({"tolerance": "-3%"}, "tolerance='-3%'"),
        ({"tolerance": "12 parsecs"}, "tolerance='12 parsecs'"),
        ({"env": {"A": 1}}, "env={'A': 1} is not accepted: expected a dict of str to str"),
        ({"script": "a.py", "module": "m"}, "at most one"),
        ({"args": ["--x"]}, "args is given without script or module"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "reference": 4},
         "reference=4 is not accepted: it is not among nproc=[2, 8]; a reference above 1 is launched as one of "
         "the listed sizes, so list it or take one of 2, 8"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "reference": 8},
         "reference=8 is not accepted: the ratio gates the sizes above its reference, and nproc=[2, 8] has none "
         "above 8"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "reference": 16}, "reference=16 is not accepted: it is not among"),
        ({"nproc": [2, 8], "reference": 2}, "reference=2 is not accepted without max_ratio"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "reference": "2"}, "reference='2' is not accepted: expected 1 or one"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "reference": 0}, "reference=0 is not accepted"),
        ({"nproc": [2, 8], "max_ratio": 1.1, "rank": 1},
         "rank=1 is not accepted with max_ratio: the ratio's reference is nproc=1, which has no rank 1; name a "
         "listed size as the reference (reference=2)"),
        ({"script": "a.py", "args": "--x"}, "expected a list of strings"),
        ({"assume": "balanced"}, "assume='balanced' is not accepted: expected None or 'alike'"),
        ({"assume": True}, "assume=True is not accepted: expected None or 'alike'"),
    ],
)
def test_bad_argument_names_it_and_what_is_accepted(kwargs, fragment):
    with pytest.raises(SpecError) as info:
        spec(**kwargs)
    assert fragment in str(info.value)


def test_two_positionals_refused():
    with pytest.raises(SpecError, match="at most one positional"):
        spec(1, 2)


@pytest.mark.parametrize(
    "text, percent, mib",
    [("5%", 5.0, None), ("256MiB", None, 256.0), ("max(5%, 256MiB)", 5.0, 256.0), ("1GiB", None, 1024.0),
     ("max(2%, 8MiB)", 2.0, 8.0)],
)
def test_tolerance_forms(text, percent, mib):
    assert parse_tolerance(text) == Tolerance(percent=percent, mib=mib)


def test_tolerance_takes_the_larger_part():
    tol = Tolerance(percent=5.0, mib=256.0)
    assert tol.allowance(1000.0) == 256.0
    assert tol.allowance(10000.0) == 500.0


def test_launch_key_ignores_limits_and_sizes():
    a = spec(nproc=2, max_ratio=1.1, env={"X": "1"})
    b = spec(nproc=[4, 8], max_mib=100, env={"X": "1"})
    assert a.launch_key() == b.launch_key()
    assert a.launch_key() != spec(nproc=2, env={"X": "2"}).launch_key()


def test_the_marker_argument_table_is_what_the_parser_accepts_and_names_its_ini_defaults():
    """MARKER_ARGUMENTS is the one declaration: the help text and the docs' reference come from it."""
    from dataclasses import fields

    from pytest_gpumem.config.settings import OPTIONS
    from pytest_gpumem.config.spec import MARKER_ARGUMENTS

    names = [a.name for a in MARKER_ARGUMENTS]
    with pytest.raises(SpecError) as unknown:
        spec(bogus=1)
    assert unknown.value.args[0].endswith("accepted are " + ", ".join(names))
    from_ini = {a.name: a.default.strip("[]") for a in MARKER_ARGUMENTS if a.default.startswith("[")}
    # every default but the session's registered launcher names, which no marker argument sets
    assert set(from_ini) == {f.name for f in fields(Defaults)} - {"launchers"}
    assert {name: f"gpumem_{name}" for name in from_ini} == from_ini
    assert set(from_ini.values()) <= {o.ini for o in OPTIONS}
    assert all(a.accepted and a.meaning for a in MARKER_ARGUMENTS)
