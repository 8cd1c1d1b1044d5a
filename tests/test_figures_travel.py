"""The gated host figure depends on the code, not on the install or the run.

The same job, through two copies of a framework's library files and run again, must give the same
gated figure (the peak of live allocations) within ``ALLOWED_SPREAD_MIB``, by framework and size. The resident
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
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from conftest import GLOO_TRANSIENT_MIB

pytestmark = pytest.mark.slow

# The most the gated figure may move over the test's 3 runs, per world size, in MiB, from the spreads
# in benchmarks/results/travel_spread.txt (benchmarks/travel_spread.py): reruns of one install moved
# by at most 0.011 MiB (torch 0.008 over 20 runs, OneFlow 0.011 over 8), a copy at a path of the same length read
# up to 0.12 MiB below the installed torch (0.04 for OneFlow), at both sizes. 0.5 MiB is 4x the
# largest, and half of the 1 MiB arena step that the figure took before Python's allocations were
# traced one by one (which made this test fail once in four `make test` runs).
# At nproc=2 the ranks talk through gloo, whose worker threads hold transient buffers: a run can catch
# them at its peak by thread timing. With the start-up measured apart (issue 29) the job's own peak is
# what is gated, and a loaded CI machine read torch's at 177.77 MiB once against 174.60 and 174.49 (+3.17
# MiB; 20 reruns here, quiet and under two busy loops, read 174.32-174.44: travel_spread.txt). nproc=2
# allows GLOO_TRANSIENT_MIB more (conftest).
# OneFlow runs each op on its runtime's worker threads at every world size, so its peak can catch their
# transient buffers too: a CI run of `make test` read the job's nproc=1 figure at 81.80 MiB against 81.08
# and 81.06 (+0.74 MiB, the rerun of the same install); 32 reruns here, beside two burners and a 4-rank
# load benchmark, read 81.039-81.077 (travel_spread.txt). OneFlow's runs allow ONEFLOW_TRANSIENT_MIB more.
ONEFLOW_TRANSIENT_MIB = 1.5
ALLOWED_SPREAD_MIB = {("torch", 1): 0.5, ("torch", 2): 0.5 + GLOO_TRANSIENT_MIB,
                      ("oneflow", 1): 0.5 + ONEFLOW_TRANSIENT_MIB, ("oneflow", 2): 0.5 + GLOO_TRANSIENT_MIB}

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


def _folder_as_long_as(site: Path, base: Path) -> Path:
    """A new folder under ``base`` whose path has as many characters as ``site``'s.

    The figure counts the bytes of every string that names a framework file (a module's
    ``__file__``, its code objects' file names): torch through a path 36 characters shorter read
    0.32 MiB less (benchmarks/results/travel_spread.txt). With paths of one length, two installs
    differ only in where the files lie.
    """
    pad = len(str(site)) - len(str(base)) - 1
    folder = base / ("x" * pad) if pad > 0 else base / "c"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def framework_copy(request) -> Iterator[tuple[Path, Path]]:
    """(the installed package's site folder, a folder holding a fresh copy of its files)."""
    name = request.param
    pytest.importorskip(name)
    installed = _package_dir(name)
    base = Path(tempfile.mkdtemp(prefix=f"{name}-"))  # short, so that the copy's path can match the site's
    try:
        copy = _folder_as_long_as(installed.parent, base)
        if len(str(copy)) != len(str(installed.parent)):
            pytest.skip(f"{name} is installed under a path shorter than a temporary folder's ({installed.parent}): "
                        "a copy cannot lie at a path of the same length")
        shutil.copytree(installed, copy / name, ignore=shutil.ignore_patterns("include", "*.a"))
        libs = installed.parent / f"{name}.libs"  # auditwheel's vendored libraries (OneFlow has them)
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name)
        yield installed.parent, copy
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _measure(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, site: Path,
             pythonpath: str | None, label: str) -> dict[int, tuple[float, float, str]]:
    """{world size: (gated MiB, VmHWM MiB, rank 0's largest peak sites)} from the JSON report of one run."""
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
        sites = sorted((size.get("sites") or {}).get("0") or [], key=lambda site: -site["mib"])[:3]
        out[size["nproc"]] = (size["gated_mib"], size["rss_ranks"]["0"],
                              "; ".join(f"{site['where']} {site['mib']:.2f}" for site in sites))
    return out


@pytest.mark.parametrize(
    "framework_copy, job",
    [pytest.param("torch", TORCH_JOB, marks=[pytest.mark.torch, pytest.mark.long], id="torch-ddp-gloo"),
     pytest.param("oneflow", ONEFLOW_JOB, marks=pytest.mark.oneflow, id="oneflow-global")],
    indirect=["framework_copy"],
)
def test_gated_figure_holds_across_installs_and_reruns(pytester, monkeypatch, launch_tag, framework_copy, job):
    site, copy = framework_copy
    framework = "oneflow" if job is ONEFLOW_JOB else "torch"
    pytester.makepyfile(test_job=job)
    runs = {
        "installed": _measure(pytester, monkeypatch, site, None, "installed"),
        "rerun": _measure(pytester, monkeypatch, site, None, "rerun"),
        "copy": _measure(pytester, monkeypatch, copy, str(copy), "copy"),
    }
    for nproc in (1, 2):
        gated = [run[nproc][0] for run in runs.values()]
        hwm = [run[nproc][1] for run in runs.values()]
        summary = {label: run[nproc][:2] for label, run in runs.items()}
        sites = "\n".join(f"  {label}: {run[nproc][2]}" for label, run in runs.items())
        allowed = ALLOWED_SPREAD_MIB[framework, nproc]
        assert max(gated) - min(gated) <= allowed, (
            f"nproc={nproc}: gated figure moved by more than {allowed} MiB "
            f"(VmHWM spread {max(hwm) - min(hwm):.1f} MiB): {summary}\nrank 0's largest peak sites:\n{sites}")


def test_counting_python_objects_by_arena_is_the_cheaper_coarser_choice(pytester, launch_tag):
    """``--gpumem-python-allocations=arenas`` counts CPython's small objects by the 1 MiB arenas they
    live in: never less than the objects themselves, whole arenas of free space included."""
    pytester.makepyfile(test_job='''
import pytest

@pytest.mark.gpumem(nproc=1)
def test_job():
    held = [str(i) * 3 for i in range(200_000)]  # ~12 MiB of small objects, pymalloc's
    assert len(held) == 200_000
''')
    figures = {}
    for mode in ("objects", "arenas"):
        report = pytester.path / f"{mode}.json"
        pytester.runpytest("--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={report}",
                           f"--gpumem-python-allocations={mode}").assert_outcomes(passed=1)
        figures[mode] = json.loads(report.read_text())["tests"][0]["sizes"][0]["gated_mib"]
    assert figures["arenas"] >= figures["objects"] > 10.0, figures
