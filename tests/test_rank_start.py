"""A rank that dies before the plugin's rank code starts still says why (issue 19, item 3).

The faithful setup is an interpreter where the plugin is importable only through PYTHONPATH, as
on the GPU machine (``PYTHONPATH=.:<site> make test-gpu``): a venv without the plugin installed,
a copy of the package in a folder of its own, and this venv's site-packages as a plain PYTHONPATH
entry (its ``.pth`` files, the editable install among them, are not read from there). pytest's
plugin autoload is off and ``-p pytest_gpumem.plugin`` loads it, as on that machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import pytest_gpumem
from conftest import processes_tagged

pytestmark = pytest.mark.slow
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
SUBPROCESS_TIMEOUT_S = 120


class Bare:
    """A venv without the plugin, and the folder that holds a copy of it."""

    def __init__(self, root: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        self.python = str(root / "venv" / "bin" / "python")
        self.plugin_dir = root / "plugin"
        shutil.copytree(Path(pytest_gpumem.__file__).parent, self.plugin_dir / "pytest_gpumem",
                        ignore=shutil.ignore_patterns("__pycache__"))
        self.site = sysconfig.get_paths()["purelib"]  # pytest, memray, psutil, torch: not the plugin

    def run(self, cwd: Path, pythonpath: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": pythonpath, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        env.pop("PYTEST_ADDOPTS", None)
        return subprocess.run([self.python, "-m", "pytest", "-p", "pytest_gpumem.plugin", "-p", "no:cacheprovider",
                               *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Bare:
    return Bare(tmp_path_factory.mktemp("bare"))


def project(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_job.py").write_text("import pytest\n\n" + body)
    return folder


def test_the_bare_setup_cannot_import_the_plugin_without_pythonpath(bare: Bare, tmp_path: Path):
    """What makes the cases below faithful: only PYTHONPATH brings the plugin in."""
    found = subprocess.run([bare.python, "-c", "import pytest_gpumem"], env={**os.environ, "PYTHONPATH": bare.site},
                           cwd=tmp_path,
                           capture_output=True, text=True)
    assert "No module named 'pytest_gpumem'" in found.stderr


def test_plugin_on_an_absolute_pythonpath_reaches_the_ranks(bare: Bare, tmp_path: Path, launch_tag: str):
    folder = project(tmp_path / "p", '''
@pytest.mark.gpumem(nproc=2, timeout=60)
def test_job():
    pass
''')
    done = bare.run(folder, f"{bare.plugin_dir}{os.pathsep}{bare.site}", "--gpumem", "test_job.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert processes_tagged(launch_tag) == []


@pytest.mark.parametrize("launcher", ["direct", pytest.param("torchrun", marks=[pytest.mark.torch, needs_torch])])
def test_a_marker_pythonpath_without_the_plugin_shows_the_ranks_output_and_why(
        bare: Bare, tmp_path: Path, launch_tag: str, launcher: str):
    folder = project(tmp_path / "p", f'''
@pytest.mark.gpumem(nproc=1, timeout=60, launcher={launcher!r}, env={{"PYTHONPATH": "/nonexistent"}})
def test_job():
    pass
''')
    done = bare.run(folder, f"{bare.plugin_dir}{os.pathsep}{bare.site}", "--gpumem", "-rf", "test_job.py")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    head = {"direct": "rank 0 of 1 ended without a result (exit code 1) before the plugin's rank code started; "
                      "last lines of its output:",
            "torchrun": "rank 0 of 1 ended without a result (torchrun launcher exit code 1) before the plugin's "
                        "rank code started; last lines of the launcher's output (the rank left no log of its own):"}
    assert head[launcher] in out
    after = out[out.index(head[launcher]):]
    assert "No module named 'pytest_gpumem'" in after
    assert ("hint: the rank could not import pytest_gpumem with PYTHONPATH='/nonexistent', which the marker's env= "
            "sets in place of the session's: install the plugin into") in after
    assert "FAILED test_job.py::test_job - rank 0 of 1 ended without a result" in out
    assert processes_tagged(launch_tag) == []


def test_a_relative_pythonpath_of_the_session_reaches_ranks_that_run_elsewhere(
        bare: Bare, tmp_path: Path, launch_tag: str):
    """``PYTHONPATH=.:<site> make test-gpu`` from the repository root: the plugin's own tests run
    pytester sessions in another folder, and their ranks start there. Before the fix every such
    test failed with ``rank 0 of 1 ended without a result (exit code 1)`` and nothing else."""
    root = tmp_path / "repo"
    shutil.copytree(bare.plugin_dir / "pytest_gpumem", root / "pytest_gpumem")
    project(root, '''
pytest_plugins = ["pytester"]


def test_a_gpumem_session_in_another_folder(pytester):
    pytester.makepyfile(test_inner="""
import pytest

@pytest.mark.gpumem(nproc=2, timeout=60)
def test_job():
    pass
""")
    result = pytester.runpytest("--gpumem", "-p", "pytest_gpumem.plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
''')
    done = bare.run(root, f".{os.pathsep}{bare.site}", f"--basetemp={tmp_path / 'basetemp'}", "test_job.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert processes_tagged(launch_tag) == []
