"""The gated host figure depends on the code, not on the install or the run.

The same job, through two copies of a framework's library files and run again, must give the same
gated figure (the peak of live allocations) within 1 MiB (2 MiB with a peer). The resident
high-water mark (VmHWM) follows the page cache: it moved by tens of MiB between copies on some
runs (benchmarks/results/figures.txt) and by under 1 MiB on others, so it is shown in the failure
message, not required to move. Real launches, real frameworks, a communicating job (DDP on gloo,
OneFlow global tensors) whose threads make RSS wander; each job asserts it imported the copy it
was given.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TORCH_JOB = '''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2])
def test_job():
    import torch
    import torch.distributed as dist
    assert torch.__file__.startswith(os.environ["EXPECT_FRAMEWORK_UNDER"]), torch.__file__
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(4096, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(512, 4096), torch.randint(0, 10, (512,))
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()   # gradients all-reduced by gloo's threads
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
'''

ONEFLOW_JOB = '''
import os
import pytest

@pytest.mark.gpumem(nproc=[1, 2], launcher="oneflow")
def test_job():
    import oneflow as flow
    assert flow.__file__.startswith(os.environ["EXPECT_FRAMEWORK_UNDER"]), flow.__file__
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    model = flow.nn.Linear(4096, 64).to_global(placement=placement, sbp=flow.sbp.broadcast)
    opt = flow.optim.SGD(model.parameters(), lr=0.01)
    x = flow.randn(512 * world, 4096, placement=placement, sbp=flow.sbp.split(0))
    for _ in range(3):
        loss = model(x).sum()
        loss.backward()   # P -> B: gradients all-reduced across the ranks
        opt.step()
        opt.zero_grad()
    assert loss.to_global(sbp=flow.sbp.broadcast).to_local().item() != 0
'''


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def framework_copy(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the installed package's site folder, a folder holding a fresh copy of its files)."""
    name = request.param
    pytest.importorskip(name)
    installed = _package_dir(name)
    copy = tmp_path_factory.mktemp(f"{name}-copy")
    shutil.copytree(installed, copy / name, ignore=shutil.ignore_patterns("include", "*.a"))
    libs = installed.parent / f"{name}.libs"  # auditwheel's vendored libraries (OneFlow has them)
    if libs.is_dir():
        shutil.copytree(libs, copy / libs.name)
    return installed.parent, copy


def _measure(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, site: Path,
             pythonpath: str | None, label: str) -> dict[int, tuple[float, float]]:
    """{world size: (gated MiB, VmHWM MiB)} of rank 0, from the JSON report of one real run."""
    if pythonpath is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setenv("EXPECT_FRAMEWORK_UNDER", str(site))
    report = pytester.path / f"{label}.json"
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}")
    result.assert_outcomes(passed=1)
    sizes = json.loads(report.read_text())["tests"][0]["sizes"]
    out = {}
    for size in sizes:
        assert size["methods"]["0"] == "live allocations (memray)"
        out[size["nproc"]] = (size["gated_mib"], size["rss_ranks"]["0"])
    return out


@pytest.mark.parametrize(
    "framework_copy, job",
    [pytest.param("torch", TORCH_JOB, marks=pytest.mark.torch, id="torch-ddp-gloo"),
     pytest.param("oneflow", ONEFLOW_JOB, marks=pytest.mark.oneflow, id="oneflow-global")],
    indirect=["framework_copy"],
)
def test_gated_figure_holds_across_installs_and_reruns(pytester, monkeypatch, launch_tag, framework_copy, job):
    site, copy = framework_copy
    pytester.makepyfile(test_job=job)
    runs = {
        "installed": _measure(pytester, monkeypatch, site, None, "installed"),
        "rerun": _measure(pytester, monkeypatch, site, None, "rerun"),
        "copy": _measure(pytester, monkeypatch, copy, str(copy), "copy"),
    }
    for nproc in (1, 2):
        gated = [run[nproc][0] for run in runs.values()]
        hwm = [run[nproc][1] for run in runs.values()]
        summary = {label: run[nproc] for label, run in runs.items()}
        # With a peer, the communication threads' short-lived buffers land a little earlier or later
        # against the main thread's peak: the torch DDP example spread 1.1-1.3 MiB over 13 runs at
        # nproc=2 (benchmarks/results/figures.txt), 0.2 MiB at nproc=1.
        allowed = 1.0 if nproc == 1 else 2.0
        assert max(gated) - min(gated) <= allowed, (
            f"nproc={nproc}: gated figure moved (VmHWM spread {max(hwm) - min(hwm):.1f} MiB): {summary}")
