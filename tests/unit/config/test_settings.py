"""Settings: command line > environment > ini > default, errors naming their source."""

from pathlib import Path

import pytest

from pytest_gpumem.config.settings import OPTIONS, SettingsError, resolve

ROOT = Path("/project")


def settings(cli=None, env=None, ini=None):
    return resolve(cli or {}, env or {}, ini or {}, rootdir=ROOT, enabled=True, refresh=False)


def test_defaults():
    s = settings()
    assert s.launcher == "direct" and s.timeout == 600 and s.max_ratio is None
    assert s.baselines == ROOT / "baselines" and s.report is None


def test_precedence_cli_over_env_over_ini():
    ini = {"timeout": "30", "launcher": "torchrun", "max_ratio": "1.5"}
    env = {"GPUMEM_TIMEOUT": "20", "GPUMEM_LAUNCHER": "oneflow"}
    s = settings(cli={"timeout": "10"}, env=env, ini=ini)
    assert s.timeout == 10 and s.launcher == "oneflow" and s.max_ratio == 1.5


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"ini": {"timeout": "soon"}},
         "Invalid gpumem_timeout 'soon' from the ini file: expected a number of seconds > 0"),
        ({"env": {"GPUMEM_MAX_RATIO": "-2"}},
         "Invalid gpumem_max_ratio '-2' from the GPUMEM_MAX_RATIO environment variable"),
        ({"cli": {"launcher": "two words"}},
         "Invalid gpumem_launcher 'two words' from the command line (--gpumem-launcher): "
         "expected one of direct, oneflow, srun, torchrun, or one a plugin adds"),
        ({"ini": {"tolerance": "12 parsecs"}}, "Invalid gpumem_tolerance '12 parsecs' from the ini file"),
        ({"ini": {"missing_baseline": "maybe"}}, "expected one of auto, warn, fail, ignore"),
        ({"ini": {"allow_mib": "nan"}}, "Invalid gpumem_allow_mib 'nan'"),
    ],
)
def test_bad_value_names_source_and_accepted(source, expected):
    with pytest.raises(SettingsError) as info:
        settings(**source)
    assert expected in str(info.value)


def test_ratio_none_in_ini_turns_the_default_off():
    assert settings(ini={"max_ratio": "none"}).max_ratio is None


def test_missing_baseline_auto_follows_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert settings().fail_on_missing_baseline is False
    monkeypatch.setenv("CI", "true")
    assert settings().fail_on_missing_baseline is True
    assert settings(ini={"missing_baseline": "ignore"}).fail_on_missing_baseline is None


def test_every_option_declared_once():
    for attr in ("name", "flag", "ini"):
        values = [getattr(o, attr) for o in OPTIONS]
        assert len(values) == len(set(values))


def test_rank_switches_are_settings_handed_to_the_ranks_as_1_or_0():
    assert settings().rank_env() == {"GPUMEM_FAST_EXIT": "1", "GPUMEM_BOXING": "1"}
    s = settings(cli={"boxing": "off"}, env={"GPUMEM_FAST_EXIT": "false"}, ini={"boxing": "on", "sites": "0"})
    assert (s.fast_exit, s.boxing, s.sites) == (False, False, "off")
    assert s.rank_env() == {"GPUMEM_FAST_EXIT": "0", "GPUMEM_BOXING": "0"}
    assert settings().sites == "auto" and settings(env={"GPUMEM_SITES": "yes"}).sites == "on"
    with pytest.raises(SettingsError, match="Invalid gpumem_boxing 'maybe' from the ini file: expected on or off"):
        settings(ini={"boxing": "maybe"})


def test_help_texts_say_what_an_empty_default_means():
    for option in OPTIONS:
        assert option.default_text.strip(), f"{option.ini} would print '(default: )'"


def test_the_tolerance_default_is_written_once():
    from pytest_gpumem.config import spec

    assert settings().tolerance == spec.Defaults().tolerance == spec.parse_tolerance(spec.DEFAULT_TOLERANCE)
    assert spec.DEFAULT_TOLERANCE == "auto" and settings().tolerance.auto
    texts = [path.read_text() for path in Path(spec.__file__).parent.rglob("*.py")]
    for value in (spec.EXACT_TOLERANCE, spec.MOVING_TOLERANCE):  # what auto resolves to, each written once
        assert sum(text.count(f'"{value}"') for text in texts) == 1, value


def test_the_floor_cache_lives_under_xdg_cache_home_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert settings().floor_cache == Path("/home/someone/.cache/pytest-gpumem/floors.json")
    assert settings(env={"XDG_CACHE_HOME": "/var/cache/ci"}).floor_cache == Path(
        "/var/cache/ci/pytest-gpumem/floors.json")
    assert settings(env={"XDG_CACHE_HOME": "relative"}).floor_cache == Path(  # XDG: only absolute paths count
        "/home/someone/.cache/pytest-gpumem/floors.json")
    assert settings(ini={"floor_cache": "~/floors.json"}).floor_cache == Path("/home/someone/floors.json")
    assert settings(env={"GPUMEM_FLOOR_CACHE": "off"}).floor_cache is None


def test_host_tracking_is_auto_by_default_and_keeps_the_variable_older_spellings():
    assert settings().track_host == "auto"
    assert settings(cli={"track_host": "on"}).track_host == "on"
    assert settings(env={"GPUMEM_TRACK_ALLOCATIONS": "0"}).track_host == "off"  # as documented before 0.2
    assert settings(env={"GPUMEM_TRACK_ALLOCATIONS": "1"}, ini={"track_host": "off"}).track_host == "on"
    with pytest.raises(SettingsError, match="Invalid gpumem_track_host 'maybe' from the ini file: expected one of "
                                            "auto, on, off"):
        settings(ini={"track_host": "maybe"})
