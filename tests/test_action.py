"""action.yml run as a runner runs it, on a fresh repository with one fake-GPU test (issue 64).

docs/ci.md's first workflow is read from the page itself: its call of this repository's action, with
its ``with:`` inputs and the action's defaults for the rest, runs step by step. Each ``run:`` script
is written to a file and run as GitHub runs ``shell: bash`` (``bash --noprofile --norc -eo pipefail
FILE``), its ``${{ }}`` expressions substituted (an unknown one fails the test), with GitHub's
environment: ``CI``, the workspace, the action's path, a ``pull_request`` event at
``GITHUB_EVENT_PATH``, and fresh files per step at ``GITHUB_OUTPUT``, ``GITHUB_ENV``, ``GITHUB_PATH``
and ``GITHUB_STEP_SUMMARY`` (read back as the runner reads them). Every step's ``if:`` is evaluated.

What stands in for GitHub, which this machine cannot reach:
- the action's checkout (``github.action_path``): this repository's files as git lists them, copied,
  as the runner unpacks the action's repository at the ref ``uses:`` names;
- ``actions/setup-python`` (not run): a throwaway venv of this interpreter first on PATH, which sees
  this venv's packages (torch, pip, setuptools, matplotlib) but not this checkout;
- pip's index: ``PIP_NO_INDEX``, ``PIP_NO_DEPS`` and no build isolation, so the install step's own
  commands run unchanged: pip and torch are found satisfied, the plugin is built from the action's
  checkout and installed into the throwaway venv;
- ``actions/cache``, ``actions/upload-artifact`` and ``marocchino/sticky-pull-request-comment`` are
  not run: the test checks that the files the upload names exist and reads the file the comment posts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from conftest import OWN_CACHES

yaml = pytest.importorskip("yaml")
pytest.importorskip("torch")  # the fake GPU runs torch's CPU build
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ACTION = "pytest-gpumem/pytest-gpumem@main"  # how docs/ci.md calls this repository's action.yml
NOT_RUN = ("actions/setup-python@", "actions/cache@", "actions/upload-artifact@",
           "marocchino/sticky-pull-request-comment@")
# The steps left to GitHub that would run, setup-python and cache first: on a failed gate too (if: always()).
UPLOAD_AND_COMMENT = ["actions/setup-python@v5", "actions/cache@v4", "actions/upload-artifact@v4",
                      "marocchino/sticky-pull-request-comment@v2"]
_EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_FENCE = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)

# A job written for GPUs (set_device, nccl, DDP over .cuda()): on this GPU-less machine, a fake GPU.
# One size, 2 (one launch: rank 0 of a simulated world of 2), for time.
JOB = '''import os

import pytest
import torch


@pytest.mark.gpumem(nproc=2, device="gpu")
def test_train():
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda())
    model(torch.randn(64, 1024, device="cuda")).sum().backward()
    dist.destroy_process_group()
'''


def minimal_workflow() -> dict[str, Any]:
    """docs/ci.md's first YAML block: the workflow a reader copies first."""
    first = _FENCE.search((REPO / "docs" / "ci.md").read_text())
    assert first, "docs/ci.md has no yaml block"
    return yaml.safe_load(first.group(1))


def expand(text: str, scope: dict[str, str]) -> str:
    """``${{ expr }}`` replaced by its value; an expression the test does not know fails it."""
    def value(match: re.Match[str]) -> str:
        assert match.group(1) in scope, f"add {match.group(1)!r} to the test's scope"
        return scope[match.group(1)]
    return _EXPRESSION.sub(value, text)


def holds(condition: str, scope: dict[str, str], failed: bool, workspace: Path) -> bool:
    """A step's ``if:``: terms joined by ``&&``, each a status function, ``hashFiles('p') != ''`` or
    ``name == 'text'``/``!=``; without a status function success() is implied, as GitHub implies it."""
    status = {"always()": True, "success()": not failed, "failure()": failed, "cancelled()": False}
    answers, named_status = [], False
    for term in _EXPRESSION.sub(r"\1", condition).split("&&"):
        term = term.strip()
        files = re.fullmatch(r"hashFiles\('([^']*)'\) (==|!=) ''", term)
        compared = re.fullmatch(r"([\w.-]+) (==|!=) '([^']*)'", term)
        if term in status:
            named_status = True
            answers.append(status[term])
        elif files:
            answers.append(any(workspace.glob(files.group(1))) == (files.group(2) == "!="))
        elif compared:
            assert compared.group(1) in scope, f"add {compared.group(1)!r} to the test's scope"
            answers.append((scope[compared.group(1)] == compared.group(3)) == (compared.group(2) == "=="))
        else:
            raise AssertionError(f"the test cannot evaluate {term!r} of {condition!r}")
    return all(answers) and (named_status or not failed)


def env_file(path: Path) -> dict[str, str]:
    """GITHUB_ENV's ``NAME=value`` lines (its ``NAME<<DELIMITER`` form fails the test: teach it first)."""
    lines = path.read_text().splitlines()
    assert all("=" in line for line in lines), f"the test reads NAME=value lines only: {lines}"
    return dict(line.split("=", 1) for line in lines)


class Runner:
    """One job's steps in ``workspace``, as a runner runs a composite action's steps."""

    def __init__(self, workspace: Path, action_path: Path, python_bin: Path, tmp: Path) -> None:
        self.workspace, self.tmp, self.summary, self.logs, self.failed = workspace, tmp, "", {}, []
        event = tmp / "event.json"
        event.write_text(json.dumps({"action": "synchronize", "number": 7, "pull_request": {
            "number": 7, "base": {"ref": "main"}, "head": {"ref": "grow"}}}))
        self.scope = {"github.action_path": str(action_path), "github.token": "a-token", "github.sha": "0" * 40,
                      "github.event_name": "pull_request", "github.job": "memory", "github.run_attempt": "1",
                      "runner.os": "Linux"}
        clean = {k: v for k, v in os.environ.items() if k in OWN_CACHES or not k.startswith(
            ("GPUMEM_", "PYTEST_", "PIP_", "GITHUB_", "RUNNER_", "VIRTUAL_ENV", "PYTHON"))}
        self.env = {**clean, "CI": "true", "GITHUB_ACTIONS": "true", "RUNNER_OS": "Linux",
                    "RUNNER_TEMP": str(tmp), "GITHUB_WORKSPACE": str(workspace),
                    "GITHUB_ACTION_PATH": str(action_path), "GITHUB_EVENT_NAME": "pull_request",
                    "GITHUB_EVENT_PATH": str(event), "PATH": f"{python_bin}{os.pathsep}{os.environ['PATH']}",
                    # pip without an index (see the module's docstring; pip reads NO_BUILD_ISOLATION=0 as
                    # "no isolation"); no user or site pip.conf
                    "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1", "PIP_NO_BUILD_ISOLATION": "0",
                    "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def action(self, given: dict[str, str]) -> tuple[list[str], dict[str, dict[str, str]]]:
        """The action's steps with ``given`` inputs: the ``uses:`` steps that would have run, and each
        ``uses:`` step's expanded ``with:`` (what it would be handed); ``failed``: the run steps that failed."""
        action = yaml.safe_load((REPO / "action.yml").read_text())
        self.failed = []
        inputs = {name: given.get(name, str(spec.get("default", ""))) for name, spec in action["inputs"].items()}
        assert set(given) <= set(inputs), f"docs/ci.md passes inputs action.yml lacks: {set(given) - set(inputs)}"
        scope = {**self.scope, **{f"inputs.{name}": expand(value, self.scope) for name, value in inputs.items()}}
        failed, would_run, handed = False, [], {}
        for number, step in enumerate(action["runs"]["steps"]):
            run_it = holds(str(step.get("if", "success()")), scope, failed, self.workspace)
            if "uses" in step:
                assert step["uses"].startswith(NOT_RUN), step["uses"]
                handed[step["uses"]] = {k: expand(str(v), scope) for k, v in (step.get("with") or {}).items()}
                would_run += [step["uses"]] if run_it else []
            elif run_it:
                assert step["shell"] == "bash", step
                env = {k: expand(str(v), scope) for k, v in (step.get("env") or {}).items()}
                if not self.bash(step["name"], expand(step["run"], scope), env, number):
                    failed = True
                    self.failed.append(step["name"])
        return would_run, handed

    def bash(self, name: str, script: str, env: dict[str, str], number: int) -> bool:
        """One ``run:`` step; what it wrote to GITHUB_ENV and GITHUB_PATH reaches the later steps."""
        files = {key: self.tmp / f"{key.lower()}_{number}" for key in (
            "GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_PATH", "GITHUB_STEP_SUMMARY", "GITHUB_STATE")}
        for path in files.values():
            path.write_text("")
        (self.tmp / f"step_{number}.sh").write_text(script)
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(self.tmp / f"step_{number}.sh")],
                              cwd=self.workspace, text=True, capture_output=True, timeout=300,
                              env={**self.env, **{k: str(v) for k, v in files.items()}, **env})
        self.logs[name] = f"{script}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        self.env.update(env_file(files["GITHUB_ENV"]))
        for line in files["GITHUB_PATH"].read_text().splitlines():  # each prepended: the last one first
            self.env["PATH"] = f"{line}{os.pathsep}{self.env['PATH']}"
        self.summary += files["GITHUB_STEP_SUMMARY"].read_text()
        return done.returncode == 0


def action_checkout(dest: Path) -> Path:
    """This repository's files as git lists them (tracked, and new ones not ignored): the action's checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def throwaway_python(dest: Path) -> Path:
    """A venv of this interpreter that sees this venv's packages (one path line, so the editable
    install of this checkout, a .pth file there, is not read): what setup-python leaves on PATH."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([dest / "bin" / "python", "-c", where], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "base-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return dest / "bin"


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture
def fresh_repository(tmp_path: Path) -> Path:
    """A repository of one test file, nothing else: no pyproject.toml, no ini file, no baselines."""
    root = tmp_path / "workspace"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_train.py").write_text(JOB)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "a job")
    return root


def first_run(repository: Path, tmp_path: Path) -> tuple[Runner, dict[str, str]]:
    """docs/ci.md's minimal workflow's action on ``repository``, checked: the plugin comes from the
    action's checkout; CI fails the test without a baseline, and the report, the artifacts and the
    comment still come out (the later steps' ``if: always()``). The runner and the ``with:`` inputs."""
    workflow = minimal_workflow()
    assert workflow["permissions"]["pull-requests"] == "write"  # the comment needs it
    calls = [step for step in workflow["jobs"]["memory"]["steps"] if step.get("uses") == ACTION]
    assert len(calls) == 1, "docs/ci.md's first workflow calls the action once"
    given = {name: str(value) for name, value in (calls[0].get("with") or {}).items()}
    checkout = action_checkout(tmp_path / "action")
    python_bin = throwaway_python(tmp_path / "python")
    runner_tmp = tmp_path / "runner"
    runner_tmp.mkdir()
    runner = Runner(repository, checkout, python_bin, runner_tmp)

    would_run, handed = runner.action(given)
    assert runner.failed == ["Memory gate"], runner.logs  # the red check
    assert "::notice::no pyproject.toml or setup.py" in runner.logs["Install"], runner.logs["Install"]
    where = "import importlib.util as u; print(u.find_spec('pytest_gpumem').origin, u.find_spec('torch').origin)"
    found = subprocess.run(["python", "-c", where], cwd=repository, env=runner.env, capture_output=True, text=True)
    assert found.returncode == 0, f"{found.stderr}\n{runner.logs['Install']}"  # the plugin is importable
    installed = found.stdout.split()
    assert installed[0].startswith(str(tmp_path / "python")), installed  # the venv's copy, not this checkout
    assert not installed[1].startswith(str(tmp_path / "python")), installed  # torch: found, not fetched
    origin = json.loads(next((tmp_path / "python").glob("lib/*/site-packages/pytest_gpumem-*.dist-info"))
                        .joinpath("direct_url.json").read_text())
    assert origin["url"] == checkout.as_uri(), origin
    assert would_run == UPLOAD_AND_COMMENT
    summary = (repository / "summary.md").read_text()
    assert summary.startswith("❌ **pytest-gpumem**: 1 failed (1 baseline-missing)"), summary
    assert "**fake GPU** (NVIDIA H200)" in summary
    assert summary in runner.summary  # the job's summary page
    record, = json.loads((repository / "gpumem.json").read_text())["tests"]
    assert (record["test"], record["status"], record["cause"]) == (
        "tests/test_train.py::test_train", "failed", "baseline-missing"), record
    _check_handed(handed, repository, summary)
    return runner, given


def test_docs_minimal_workflow_runs_the_action_on_a_fresh_repository(fresh_repository: Path, tmp_path: Path):
    first_run(fresh_repository, tmp_path)


@pytest.mark.long  # tests/test_ci_docs.py runs the action's steps against a recorded baseline in make test
def test_the_action_goes_green_once_the_baselines_the_comment_names_are_recorded(
        fresh_repository: Path, tmp_path: Path):
    runner, given = first_run(fresh_repository, tmp_path)
    workspace = fresh_repository
    # What the comment says to do, done: the baselines recorded and committed; the next run is green. Same
    # workspace, the first run's files in it (a self-hosted runner's checkout with `clean: false`): a
    # separate option value that exists as a file must not become pytest's test path.
    summary = (workspace / "summary.md").read_text()
    refresh = re.search(r"record it with `(gpumem refresh [^`]+)`", summary)
    assert refresh, summary
    subprocess.run(refresh.group(1), shell=True, cwd=workspace, check=True, capture_output=True,
                   env={k: v for k, v in runner.env.items() if k != "CI"})
    _git(workspace, "add", "baselines")
    _git(workspace, "commit", "-q", "-m", "record the baselines")
    would_run, handed = runner.action(given)
    assert runner.failed == [], runner.logs
    summary = (workspace / "summary.md").read_text()
    assert summary.startswith("✅ **pytest-gpumem**: 1 passed"), summary
    record, = json.loads((workspace / "gpumem.json").read_text())["tests"]
    assert (record["test"], record["status"], record["cause"]) == ("tests/test_train.py::test_train", "passed", None)
    assert [(size["nproc"], size["device"], bool(size["fake_gpu"])) for size in record["sizes"]] == [
        (2, "gpu", True)], record
    assert would_run == UPLOAD_AND_COMMENT
    _check_handed(handed, workspace, summary)


def _check_handed(handed: dict[str, dict[str, str]], workspace: Path, summary: str) -> None:
    """What the steps left to GitHub would be handed: every path the upload keeps, and the summary as
    the comment's body; the action's outputs name files that exist."""
    outputs = yaml.safe_load((REPO / "action.yml").read_text())["outputs"]
    assert {name: (workspace / spec["value"]).is_file() for name, spec in outputs.items()} == {
        "summary": True, "report": True}
    kept = handed["actions/upload-artifact@v4"]["path"].split()
    assert kept == ["gpumem.json", "summary.md", "junit.xml", "plots/"]
    assert all((workspace / path).exists() for path in kept), [p for p in kept if not (workspace / p).exists()]
    assert any((workspace / "plots").glob("*.png"))  # the [plots] extra's matplotlib drew them
    comment = handed["marocchino/sticky-pull-request-comment@v2"]
    assert comment["GITHUB_TOKEN"] == "a-token"
    assert (workspace / comment["path"]).read_text() == summary
