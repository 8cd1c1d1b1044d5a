"""Real torch (gloo, CPU) launches through the direct launcher and torchrun."""

from __future__ import annotations

import re

import pytest
from jobs import TORCH_DDP

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow]


def test_healthy_passes_and_inflating_fails_direct(pytester, launch_tag):
    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2)
def test_healthy():
    step(False)

@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2)
def test_inflating():
    step(True)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "gpumem: * MiB > * MiB (rank 0, nproc=2)*",
        "*rank 0 at nproc=2 (cpu): peak * MiB > 1.20 x * MiB (nproc=1) + 0 MiB = * MiB (ratio *x)*",
        "*gpumem: peak memory per rank*",
        "*test_healthy*2*1.00x*pass*",
        "*test_inflating*2*failed (limit)*",
    ])


def test_the_cpu_floor_is_shown_in_the_table_the_failure_and_the_markdown(pytester, launch_tag, tmp_path):
    """--gpumem-floor=on on CPU: the figure split into floor + job's own, as on GPU, wherever it is shown."""
    markdown = tmp_path / "summary.md"
    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.gpumem(nproc=1, max_mib=1)
def test_over():
    step(False)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=on",
                                f"--gpumem-markdown={markdown}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*floor + job's own MiB per rank {0: * + *} (floor: an empty job, torch start-up)*",  # the failure
        "*gpumem: peak memory per rank*",
        "*test  *nproc  *gated peak MiB  *floor + job MiB*",  # the table
        "*test_over  *1  *(rank 0)  *.? + *.?  *failed (limit)*",
    ])
    text = markdown.read_text()
    assert "| floor + job MiB |" in text and " + " in text.split("test_over`", 1)[1].splitlines()[0]


@pytest.mark.long  # make test-long: torchrun launches in make test (test_faults' torchrun faults, test_tolerance)
def test_torchrun_launcher_gates_the_same_way(pytester, launch_tag):
    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.gpumem(nproc=2, max_ratio=1.2, launcher="torchrun")
def test_healthy():
    step(False)

@pytest.mark.gpumem(nproc=2, max_ratio=1.2, launcher="torchrun")
def test_inflating():
    step(True)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 at nproc=2 (cpu): peak * MiB > 1.20 x *"])


def test_fixtures_parameters_and_env_reach_every_rank(pytester, launch_tag, tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    pytester.makeconftest('''
import pytest

@pytest.fixture
def greeting():
    return "hello"
''')
    pytester.makepyfile(f'''
import os
import pytest

@pytest.mark.gpumem(nproc=2, env={{"OUT": {str(out)!r}}})
@pytest.mark.parametrize("flavour", ["a", "b"])
def test_body(flavour, greeting, tmp_path):
    assert tmp_path.is_dir()
    name = f"{{os.environ['RANK']}}-{{os.environ['WORLD_SIZE']}}-{{flavour}}-{{greeting}}"
    open(os.path.join(os.environ["OUT"], name), "w").close()
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert sorted(p.name for p in out.iterdir()) == [
        "0-2-a-hello", "0-2-b-hello", "1-2-a-hello", "1-2-b-hello"]


def test_failing_rank_names_itself_and_the_session_goes_on(pytester, launch_tag):
    pytester.makepyfile('''
import os
import pytest

@pytest.mark.gpumem(nproc=2)
def test_rank_one_breaks():
    assert os.environ["RANK"] == "0", "only rank 0 is right"

@pytest.mark.gpumem(nproc=2)
def test_after():
    pass
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 of 2 failed:*", "*AssertionError: only rank 0 is right*"])


def test_all_ranks_skipping_skips_and_without_option_skips(pytester, launch_tag):
    pytester.makepyfile('''
import pytest

@pytest.mark.gpumem(nproc=2)
def test_skips():
    pytest.skip("no data set here")
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no data set here*"])
    plain = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    plain.assert_outcomes(skipped=1)
    plain.stdout.fnmatch_lines(["*gpumem test (launches nproc 2): run with pytest --gpumem*"])


def test_inflation_marked_xfail_is_xfailed(pytester, launch_tag):
    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.xfail(strict=True, reason="known inflation")
@pytest.mark.gpumem(nproc=2, max_ratio=1.2)
def test_inflating():
    step(True)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(xfailed=1)
    result.stdout.fnmatch_lines(["*test_inflating*xfailed (limit)*"])


def test_script_mode_runs_the_program_as_users_launch_it(pytester, launch_tag, tmp_path):
    out = tmp_path / "runs.txt"
    pytester.makepyfile(train_net=f'''
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
with open({str(out)!r}, "a") as f:
    f.write(f"{{dist.get_rank()}}/{{dist.get_world_size()}} {{' '.join(sys.argv[1:])}}\\n")
dist.destroy_process_group()
''')
    pytester.makepyfile(test_script='''
import pytest

@pytest.mark.gpumem(nproc=[1, 2], script="train_net.py", args=["--config-file", "gpt2.py"], max_ratio=1.3)
def test_train_net():
    raise AssertionError("the body is not run in script mode")
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert sorted(out.read_text().splitlines()) == [
        "0/1 --config-file gpt2.py", "0/2 --config-file gpt2.py", "1/2 --config-file gpt2.py"]


@pytest.mark.long  # make test-long: test_the_cpu_floor_is_shown_in_the_table_... runs in make test
def test_floor_shows_what_is_not_the_job_own(pytester, launch_tag):
    """An empty torch job at each size (start-up, and the gloo communicator at N > 1), launched once
    and reused, is shown apart from the job: the inflating part is all in the job's own share."""
    import json

    pytester.makepyfile(TORCH_DDP + '''
@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2)
def test_inflating():
    step(True)

@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2)
def test_healthy():
    step(False)
''')
    report = pytester.path / "report.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-floor=on",
                                f"--gpumem-report={report}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*floor + job's own MiB per rank {0: * + *} (floor: an empty job, torch start-up)*",
        "*floor + job's own MiB per rank {0: * + *, 1: * + *} (floor: an empty job, torch start-up + communicator)*",
    ])
    tests = {t["test"].split("::")[1]: t for t in json.loads(report.read_text())["tests"]}
    for name in ("test_healthy", "test_inflating"):
        for size in tests[name]["sizes"]:
            floor = size["floor"]["ranks"]["0"]
            assert 0 < floor < size["gated_mib"], (name, size["nproc"], floor, size["gated_mib"])
    # one floor per size for both tests: the same empty job, measured once
    floors = {(t, s["nproc"]): s["floor"]["ranks"]["0"] for t in tests for s in tests[t]["sizes"]}
    assert floors[("test_healthy", 2)] == floors[("test_inflating", 2)]
    inflating = {s["nproc"]: s["gated_mib"] - s["floor"]["ranks"]["0"] for s in tests["test_inflating"]["sizes"]}
    assert inflating[2] - inflating[1] > 100, inflating  # the 150 MiB gathered is the job's own


def test_a_grown_site_names_the_allocating_line_and_the_caller_that_keeps_it(pytester, launch_tag):
    """The newcomer's regression: each step's logits appended to a list. The logits are allocated in
    the model's ``forward``; the list that keeps them is in the caller: the failure names both."""
    model = pytester.makepyfile(tinymodel='''
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(256, 4096)

    def forward(self, x):
        return self.head(x)  # allocates the logits: 1024 x 4096 float32, 16 MiB
''')
    test = pytester.makepyfile(test_lm='''
import os

import pytest
import torch

from tinymodel import Tiny


def train(model, steps):
    kept = []
    for _ in range(steps):
        kept.append(model(torch.ones(1024, 256)))  # keeps every step's logits alive
    return kept


@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.0, allow_mib=16)
def test_lm():
    with torch.no_grad():
        train(Tiny(), 2 * int(os.environ["WORLD_SIZE"]))
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", "--gpumem-report=report.json")
    result.assert_outcomes(failed=1)
    def line_of(path, needle):
        return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)

    forward = f"tinymodel.py:{line_of(model, 'return self.head(x)')} forward"
    caller = f"test_lm.py:{line_of(test, 'kept.append(')} train"  # the line that keeps the logits
    lines = result.stdout.str().splitlines()
    at = next(i for i, line in enumerate(lines) if f"MiB  {forward} (forward)" in line)
    assert re.match(r"\s*\+3\d\.\d MiB  ", lines[at]), lines[at]  # two more steps of 16 MiB at nproc=2
    assert lines[at + 1].strip() == f"called from {caller}", lines[at:at + 3]
    assert lines[at + 2].strip() == f"called from test_lm.py:{line_of(test, 'train(Tiny()')} test_lm", lines[at:at + 3]
    from pytest_gpumem.judging.record_reader import load_report

    record = load_report(pytester.path / "report.json")[0]
    assert record.grown_sites[0].label.startswith(forward)
    assert record.grown_sites[0].callers[0] == caller
