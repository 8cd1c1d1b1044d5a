"""Real OneFlow (CPU, global tensors) launches through its own launcher and the direct one."""

from __future__ import annotations

import pytest
from jobs import ONEFLOW_WORKLOAD

pytest.importorskip("oneflow")
pytestmark = [pytest.mark.oneflow, pytest.mark.slow]


def test_oneflow_launcher_healthy_passes_inflating_fails(pytester, launch_tag):
    pytester.makepyfile(ONEFLOW_WORKLOAD + '''
@pytest.mark.gpumem(nproc=2, max_ratio=1.2, launcher="oneflow")
def test_healthy():
    step(False)

@pytest.mark.gpumem(nproc=2, max_ratio=1.2, launcher="oneflow")
def test_inflating():
    step(True)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*rank 0 at nproc=2 (cpu): peak * MiB > 1.20 x * MiB (nproc=1) + 0 MiB = * MiB (ratio *x)*",
        "*test_healthy*2*pass*",
    ])
    assert not (pytester.path / "log").exists(), "the launcher's glog folders belong in the launch's own folder"


def test_direct_launcher_runs_oneflow_global_tensors(pytester, launch_tag):
    pytester.makepyfile(ONEFLOW_WORKLOAD + '''
@pytest.mark.gpumem(nproc=[1, 2], max_ratio=1.2)
def test_healthy():
    step(False)
''')
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_launcher_group_kill_stays_inside_the_launch(pytester, launch_tag):
    """OneFlow's launcher answers a failed rank with killpg(its own group): pytest must survive."""
    pytester.makepyfile('''
import os
import time
import pytest
import oneflow as flow

@pytest.mark.gpumem(nproc=2, launcher="oneflow", timeout=120)
def test_rank_one_dies():
    flow.env.get_world_size()
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 lost its data shard")
    time.sleep(60)   # rank 0 would wait for ever in a collective: the launcher must end it

@pytest.mark.gpumem(nproc=2, launcher="oneflow", timeout=120)
def test_rank_one_vanishes():
    flow.env.get_world_size()
    if os.environ["RANK"] == "1":
        os._exit(3)  # no report at all: the launcher sees the exit and kills its process group
    time.sleep(60)

@pytest.mark.gpumem(nproc=1, launcher="oneflow")
def test_next():
    pass
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*rank 1 of 2 failed:*", "*RuntimeError: rank 1 lost its data shard*",
        "*rank 1 of 2 ended without a result (oneflow launcher exit code 1)*",
    ])
    assert "timed out" not in result.stdout.str()


GRAPH = '''
import os
import pytest
import oneflow as flow

class Step(flow.nn.Graph):
    def __init__(self, model, opt, broadcast):
        super().__init__()
        self.model, self.broadcast = model, broadcast
        self.add_optimizer(opt)

    def build(self, x):
        if self.broadcast:                      # the regression: S(0) -> B of the batch
            x = x.to_global(sbp=flow.sbp.broadcast)
        loss = self.model(x).sum()
        loss.backward()
        return loss

@pytest.mark.gpumem(nproc=2, tolerance="5%")
def test_graph(gpumem_config):
    sbp = os.environ["BATCH_SBP"]
    gpumem_config({"batch_sbp": sbp})
    placement = flow.placement("cpu", ranks=[0, 1])
    model = flow.nn.Linear(4096, 8).to_global(placement=placement, sbp=flow.sbp.broadcast)
    step = Step(model, flow.optim.SGD(model.parameters(), lr=0.1), sbp == "broadcast")
    x = flow.randn(2 * 16384, 4096, placement=placement, sbp=flow.sbp.split(0))   # 256 MiB per rank
    step(x)
'''


def test_failure_report_explains_with_config_and_boxing(pytester, launch_tag, monkeypatch):
    pytester.makepyfile(GRAPH)
    monkeypatch.setenv("BATCH_SBP", "split")
    pytester.runpytest("--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("BATCH_SBP", "broadcast")
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "  changed since the baseline: config.batch_sbp: split -> broadcast",
        "*rank 0 at nproc=2 (cpu): peak * MiB > baseline * MiB + 5% (* MiB) = * MiB*",
        "*per-rank peaks over the run:*",
        "*nn.Graph boxing (SBP conversions) at nproc=2 against the baseline:*",
        "*new: S(0)->B x1 (was 0)*",
        "*(32768, 4096) float32 into *",
    ])


def test_a_rank_oneflow_aborts_names_oneflows_check_first(pytester, launch_tag):
    """OneFlow's CHECK aborts the rank (SIGABRT) and logs why to its glog FATAL file, not the rank's
    output: the failure's first line carries it, before the crash dump (issue 67, item 5)."""
    pytester.makepyfile('''
import pytest
import oneflow as flow

@pytest.mark.gpumem(nproc=2, timeout=120)
def test_mismatched_all_reduce():
    x = flow.ones(4 if flow.env.get_rank() == 0 else 8)   # the ranks disagree on the collective's size
    flow.comm.all_reduce(x)
    print(x.sum())
''')
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.re_match_lines([r"failed test_\w+\.py::test_mismatched_all_reduce: rank \d of 2 ended without a "
                                  r"result \([^)]*\): transport\.cpp:\d+: Check failed: .* \(\d+ vs\. \d+\)"])
