"""What the installed plugin does to sessions that do not use it, and off Linux.

Each check runs a fresh interpreter: the test session itself has imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_gpumem.config.settings import unsupported_platform

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("psutil", "filelock", "pynvml", "matplotlib", "torch", "oneflow")

# Runs pytest in-process in a fresh interpreter and prints what it imported; `setup` runs first.
PROBE = """
import json, sys
{setup}
import pytest
code = pytest.main(["-p", "pytest_gpumem.plugin", "-p", "no:cacheprovider", "-rs", *sys.argv[1:]])
print("PROBE " + json.dumps({{"code": int(code), "modules": sorted(sys.modules)}}))
"""


def probe(cwd: Path, *args: str, setup: str = "") -> tuple[dict, str]:
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-c", PROBE.format(setup=textwrap.dedent(setup)), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, proc.stdout + proc.stderr
    return json.loads(line[len("PROBE "):]), proc.stdout


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mix.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.gpumem(nproc=2, max_mib=100)
        def test_big():
            pass

        def test_plain():
            pass
    '''))
    return tmp_path


@pytest.mark.parametrize("args", [(), ("--gpumem", "-k", "plain")], ids=["no --gpumem", "--gpumem, none selected"])
def test_a_session_without_gpumem_tests_imports_nothing_heavy(project, args):
    """Nothing paid when unused: no runner, gate, leases, NVML, psutil or filelock in the session."""
    result, out = probe(project, *args)
    assert result["code"] == 0, out
    ours = {m for m in result["modules"] if m.startswith("pytest_gpumem")}
    # (protocol: the rank files' names and readers, standard library only; the rank side uses it;
    # fakegpu.models and sampling.alloc_conf: the fake GPU's model and allocator settings checked at
    # configure, standard library only; hookspecs: the pytest_gpumem_launchers spec, pluggy only;
    # session: its preflight, the machinery imported when built)
    assert ours <= {"pytest_gpumem", "pytest_gpumem.plugin", "pytest_gpumem.hookspecs", "pytest_gpumem.session",
                    "pytest_gpumem.config",
                    "pytest_gpumem.config.settings", "pytest_gpumem.config.env_names",
                    "pytest_gpumem.config.spec", "pytest_gpumem.rankside", "pytest_gpumem.rankside.protocol",
                    "pytest_gpumem.rankside.rank", "pytest_gpumem.rankside.fakegpu",
                    "pytest_gpumem.rankside.fakegpu.models", "pytest_gpumem.sampling",
                    "pytest_gpumem.sampling.alloc_conf"}, ours
    assert not [m for m in result["modules"] if m.split(".")[0] in HEAVY]


def test_without_the_resource_module_and_off_linux_gpumem_tests_skip_saying_why(project):
    """A platform without `resource` (Windows) imports the plugin; gpumem tests skip, never crash."""
    result, out = probe(project, "--gpumem", setup='''
        sys.modules["resource"] = None  # import resource -> ImportError, as on Windows
        import pytest_gpumem.plugin, pytest_gpumem.rankside.rank, pytest_gpumem.config.settings
        pytest_gpumem.config.settings.sys = type("FakeSys", (), {"platform": "win32"})
    ''')
    assert result["code"] == 0, out
    assert "1 passed, 1 skipped" in out
    assert "gpumem test: pytest-gpumem runs on Linux only (it reads /proc and uses prctl); this is win32" in out


def test_unsupported_platform_names_it():
    assert unsupported_platform("linux") is None
    assert "this is darwin" in (unsupported_platform("darwin") or "")


def test_the_floor_environment_pins_the_floors_pyproject_admits():
    """tools/floor-requirements.txt (make test-floor) installs exactly each dependency's lower bound."""
    import re

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    def release(version: str | None) -> tuple[int, ...]:  # "8.0" and "8.0.0" are the same release
        parts = [int(x) for x in (version or "0").split(".")]
        while parts and parts[-1] == 0:
            parts.pop()
        return tuple(parts)

    floors = dict(re.fullmatch(r"([\w.-]+)>=([\w.]+)", d).groups() for d in deps)
    pinned = dict(line.split("==") for line in (REPO / "tools" / "floor-requirements.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert {name: release(pinned.get(name)) for name in floors} == {n: release(v) for n, v in floors.items()}
    assert pinned["pytest"] == "8.0.0" and pinned["pluggy"] == "1.3.0"  # the first pytest with wrapper hooks
