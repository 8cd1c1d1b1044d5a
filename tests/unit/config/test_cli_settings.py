"""`gpumem show` finds the baselines as the plugin does: same option table, ini file and rootdir."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpumem.cli import baselines_dir
from pytest_gpumem.config import inifile
from pytest_gpumem.config.settings import SettingsError


@pytest.mark.parametrize(
    "name, text",
    [
        ("pytest.ini", "[pytest]\ngpumem_baselines = stored\n"),
        (".pytest.ini", "[pytest]\ngpumem_baselines = stored\n"),
        ("pyproject.toml", '[tool.pytest.ini_options]\ngpumem_baselines = "stored"\n'),
        ("pyproject.toml", '[tool.pytest]\ngpumem_baselines = "stored"\n'),
        ("tox.ini", "[tox]\n[pytest]\ngpumem_baselines = stored\n"),
        ("setup.cfg", "[metadata]\nname = x\n[tool:pytest]\ngpumem_baselines = stored\n"),
    ],
)
def test_ini_in_a_parent_folder_sets_rootdir_and_folder(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    deep = tmp_path / "tests" / "unit"
    deep.mkdir(parents=True)
    setup = inifile.find(deep)
    assert (setup.rootdir, setup.inipath) == (tmp_path.resolve(), (tmp_path / name).resolve())
    assert baselines_dir(None, deep, {}) == tmp_path.resolve() / "stored"


def test_files_without_a_pytest_section_are_skipped_as_pytest_does(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\ngpumem_baselines = outer\n")
    inner = tmp_path / "pkg"
    inner.mkdir()
    (inner / "tox.ini").write_text("[tox]\nenvlist = py\n")
    (inner / "setup.cfg").write_text("[metadata]\nname = x\n")
    assert baselines_dir(None, inner, {}) == tmp_path.resolve() / "outer"


def test_precedence_flag_then_env_then_ini_then_default_all_under_the_rootdir(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\ngpumem_baselines = from_ini\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    root = tmp_path.resolve()
    assert baselines_dir("from_flag", sub, {"GPUMEM_BASELINES": "from_env"}) == root / "from_flag"
    assert baselines_dir(None, sub, {"GPUMEM_BASELINES": "from_env"}) == root / "from_env"
    assert baselines_dir(None, sub, {}) == root / "from_ini"
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    assert baselines_dir(None, sub, {}) == root / "baselines"
    assert baselines_dir(str(tmp_path / "abs"), sub, {}) == tmp_path / "abs"


def test_no_ini_file_rootdir_is_the_nearest_project_folder(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert inifile.find(deep) == inifile.IniSetup(tmp_path.resolve())
    assert inifile.find(deep, rootdir=tmp_path / "a").rootdir == (tmp_path / "a").resolve()


def test_bad_ini_value_names_key_source_and_file(tmp_path):
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\ngpumem_timeout = soon\n")
    with pytest.raises(SettingsError) as info:
        baselines_dir(None, tmp_path, {})
    assert "Invalid gpumem_timeout 'soon' from the ini file" in str(info.value)
    assert str(ini.resolve()) in str(info.value)


def test_unreadable_ini_names_the_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options\n")
    with pytest.raises(inifile.IniError, match="pyproject.toml: cannot read it as pytest would"):
        inifile.find(tmp_path)


def test_agrees_with_pytest_on_this_repository(pytestconfig):
    repo = Path(__file__).resolve().parents[3]
    setup = inifile.find(repo / "tests")
    assert setup.rootdir == Path(pytestconfig.rootpath).resolve()
    assert setup.inipath == (Path(pytestconfig.inipath).resolve() if pytestconfig.inipath else None)
    assert setup.values["gpumem_tolerance"] == pytestconfig.getini("gpumem_tolerance")
