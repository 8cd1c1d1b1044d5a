"""docs/ci.md and action.yml run as written (issue 55: the refresh workflow's snippet crashed).

Every ``run:`` step of every workflow in docs/ci.md, the action's own steps where a workflow calls
it, and every ``bash`` block run here, in a project of one small gpumem test, in order: the
refresh workflow records the baseline and writes the pull request's body; the hosted-runner gate
and the GPU nightly pass against it; ``gpumem diff`` compares main with the pull request; ``gpumem
bisect`` finds no bad commit. The GitHub-only steps (``uses:`` another action) are left out; ``pip``
installs nothing here (the plugin and torch are installed already), each install is recorded and
checked instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ACTION = "pytest-gpumem/pytest-gpumem@main"  # how docs/ci.md calls the repository's action.yml
GITHUB_ONLY = ("actions/", "marocchino/", "peter-evans/", "benchmark-action/")
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
_EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")

JOB = '''
import pytest


@pytest.mark.gpumem(nproc=1)
def test_job():
    kept = bytearray(32 * 2**20)
'''

# A shell's `python` here: the test's interpreter, except `python -m pip`, which is recorded.
PYTHON = '''#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "$*" >> "{log}"; exit 0; fi
exec "{python}" "$@"
'''


def blocks(language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall((REPO / "docs" / "ci.md").read_text()) if lang == language]


def workflows() -> dict[str, dict[str, Any]]:
    return {doc["name"]: doc for doc in map(yaml.safe_load, blocks("yaml"))}


def expand(text: str, values: dict[str, str]) -> str:
    """``${{ expr }}`` replaced by its value; an expression this test does not know fails it."""
    def value(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"add {match.group(1)!r} to the test's values"
        return values[match.group(1)]
    return _EXPRESSION.sub(value, text)


class Runner:
    """Runs steps as GitHub would run their shell, in ``project``, with ``python`` and ``gpumem`` on PATH."""

    def __init__(self, project: Path, tmp: Path) -> None:
        self.project, self.pip_log = project, tmp / "pip.log"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        for name, text in (("python", PYTHON.format(log=self.pip_log, python=sys.executable)),
                           ("gpumem", f'#!/bin/sh\nexec "{sys.executable}" -m pytest_gpumem.cli "$@"\n')):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUMEM_", "PYTEST_"))},
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CI": "true", "GITHUB_ACTION_PATH": str(REPO),
                    "RUNNER_TEMP": str(tmp / "runner"), "GITHUB_WORKSPACE": str(project),
                    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        (tmp / "runner").mkdir()

    def shell(self, script: str, env: dict[str, str] | None = None, ok: bool = True) -> str:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=self.project, text=True,
                              capture_output=True, env={**self.env, **(env or {})}, timeout=600)
        assert (done.returncode == 0) == ok, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def steps(self, steps: list[dict[str, Any]], values: dict[str, str]) -> list[str]:
        """Each step in order: a ``run:`` in its shell, this repository's action by its own steps;
        the names of the steps left to GitHub."""
        left = []
        for step in steps:
            uses = step.get("uses", "")
            if uses == ACTION:
                left += self.action({k: str(v) for k, v in (step.get("with") or {}).items()}, values)
            elif uses:
                assert uses.startswith(GITHUB_ONLY), uses
                left.append(uses)
            else:
                env = {k: expand(str(v), values) for k, v in (step.get("env") or {}).items()}
                self.shell(expand(step["run"], values), env)
        return left

    def action(self, given: dict[str, str], values: dict[str, str]) -> list[str]:
        action = yaml.safe_load((REPO / "action.yml").read_text())
        inputs = {name: given.get(name, str(spec.get("default", ""))) for name, spec in action["inputs"].items()}
        assert set(given) <= set(inputs), f"docs/ci.md passes inputs action.yml lacks: {set(given) - set(inputs)}"
        scope = {**values, **{f"inputs.{name}": value for name, value in inputs.items()}}
        return self.steps(action["runs"]["steps"], scope)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_job.py").write_text(JOB)
    (root / "pytest.ini").write_text("[pytest]\n")
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "job"],
                    ["update-ref", "refs/remotes/origin/main", "HEAD"]):
        _git(root, *command)
    return root


def test_every_step_of_docs_ci_and_of_the_action_runs_here(project: Path, tmp_path: Path):
    runner = Runner(project, tmp_path)
    flows = workflows()
    assert list(flows) == ["gpumem", "gpumem-nightly", "gpumem-refresh"]  # the hosted runner's first
    assert flows["gpumem"]["jobs"]["memory"]["runs-on"] == "ubuntu-latest"
    values = {"github.ref": "refs/pull/1/merge", "github.base_ref": "main", "github.sha": "0" * 40,
              "github.token": "", "github.job": "memory", "github.run_attempt": "1", "runner.os": "Linux",
              "inputs.selection": "tests/"}

    left = runner.steps(flows["gpumem-refresh"]["jobs"]["refresh"]["steps"], values)
    assert left == ["actions/checkout@v4", "actions/setup-python@v5", "peter-evans/create-pull-request@v7"]
    body = (project / "body.md").read_text()
    assert "- tests/test_job.py::test_job nproc=1: (new) -> " in body, body
    assert (project / "baselines" / "tests" / "test_job.py.json").exists()

    for name in ("gpumem", "gpumem-nightly"):  # the gate: the action's steps, CI=true, the baseline above
        (project / "summary.md").unlink(missing_ok=True)
        left = runner.steps(flows[name]["jobs"]["memory"]["steps"], values)
        assert left == ["actions/checkout@v4", "actions/setup-python@v5", "actions/cache@v4",
                        "actions/upload-artifact@v4", "marocchino/sticky-pull-request-comment@v2"]
        assert (project / "summary.md").read_text().startswith("✅ **pytest-gpumem**: 1 passed")
    installs = runner.pip_log.read_text().splitlines()
    assert "install -q torch --index-url https://download.pytorch.org/whl/cpu" in installs  # hosted: CPU build
    assert "install -q torch --index-url https://download.pytorch.org/whl/cu128" in installs  # nightly: CUDA
    assert installs.count(f"install -q {REPO}[plots]") == 2  # the action's own checkout; no pyproject.toml: no -e .
    assert not [line for line in installs if "-e ." in line]  # nor in the refresh workflow's install

    diff, bisect = blocks("bash")
    runner.shell(expand(diff, values))  # main vs the pull request: the same commit, no regression (exit 0)
    assert "`tests/test_job.py::test_job`" in (project / "diff.md").read_text()

    good = _head(project)
    job = project / "tests" / "test_job.py"
    job.write_text(job.read_text().replace("32 * 2**20", "64 * 2**20"))
    _git(project, "commit", "-q", "-am", "grow the job")
    _git(project, "update-ref", "refs/remotes/origin/main", "HEAD")
    out = runner.shell(bisect, {"LAST_GREEN": good, "TEST": "tests/test_job.py::test_job"})
    assert out.splitlines()[-1].startswith(f"first bad commit: {_head(project)} grow the job"), out


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)


def _head(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()
