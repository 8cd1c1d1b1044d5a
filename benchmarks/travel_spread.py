"""How far does the travel test's gated figure move between identical runs? The spread behind its limit.

    .venv-torch/bin/python benchmarks/travel_spread.py [--runs 20]        # the torch DDP (gloo) job
    .venv-oneflow/bin/python benchmarks/travel_spread.py [--runs 20]      # the OneFlow global-tensor job

Runs the job of tests/test_figures_travel.py (the same source, nproc=[1, 2]) ``--runs`` times, each
in a pytest session of its own through ``pytest --gpumem --gpumem-report``, alternating the
installed framework and a fresh copy of its files first on PYTHONPATH (as the test does), and
reads rank 0's gated figure (the peak of live allocations) at each size. ``--env KEY=VALUE`` runs
every launch with that variable set (e.g. PYTHONHASHSEED=0), to compare variants side by side.

Each run's figures are printed as they come; the summary (spread = max - min per size, in MiB and
bytes, and the limit the test sets) is appended to benchmarks/results/travel_spread.txt with the
command.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test module's `from conftest import` is the tests' conftest

from tests.test_figures_travel import ALLOWED_SPREAD_MIB, ONEFLOW_JOB, TORCH_JOB, _folder_as_long_as  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "travel_spread.txt"


def framework() -> str:
    for name in ("oneflow", "torch"):
        if importlib.util.find_spec(name) is not None:
            return name
    raise SystemExit("run this with the interpreter of .venv-torch or .venv-oneflow")


def package_copy(name: str, base: Path, same_length: bool) -> tuple[Path, Path]:
    """(the installed package's site folder, a folder holding a fresh copy of its files), the copy's
    path as long as the site folder's when ``same_length`` (as the test does)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    installed = Path(spec.origin).parent
    into = _folder_as_long_as(installed.parent, base) if same_length else base / "copy"
    shutil.copytree(installed, into / name, ignore=shutil.ignore_patterns("include", "*.a"))
    libs = installed.parent / f"{name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, into / libs.name)
    return installed.parent, into


def one_run(workdir: Path, job: str, site: Path, pythonpath: str | None, env: dict[str, str]) -> dict[int, float]:
    """{nproc: rank 0's gated MiB} of one ``pytest --gpumem`` session over the job."""
    (workdir / "test_job.py").write_text(job)
    report = workdir / "report.json"
    report.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") and k != "PYTHONPATH"}
    run_env.update(env, EXPECT_FRAMEWORK_UNDER=str(site))
    if pythonpath:
        run_env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpumem",
           "--gpumem-missing-baseline=ignore", f"--gpumem-report={report}", "test_job.py"]
    done = subprocess.run(cmd, cwd=workdir, env=run_env, capture_output=True, text=True)
    if done.returncode != 0 or not report.exists():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    sizes = json.loads(report.read_text())["tests"][0]["sizes"]
    return {s["nproc"]: s["gated_mib"] for s in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--copy-path", choices=["same-length", "short"], default="same-length",
                        help="the copy's path: as long as the installed package's (as the test does), or a short one")
    args = parser.parse_args()
    name = framework()
    env = dict(item.split("=", 1) for item in args.env)
    job = {"torch": TORCH_JOB, "oneflow": ONEFLOW_JOB}[name]
    values: dict[int, list[float]] = {}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        site, copy = package_copy(name, Path(tmp), args.copy_path == "same-length")
        workdir = Path(tmp) / "job"
        workdir.mkdir()
        for run in range(args.runs):
            label, where, pythonpath = ("copy", copy, str(copy)) if run % 2 else ("installed", site, None)
            got = one_run(workdir, job, where, pythonpath, env)
            for nproc, mib in got.items():
                values.setdefault(nproc, []).append(mib)
            figures = "  ".join(f"nproc={n}: {m:9.3f}" for n, m in sorted(got.items()))
            line = f"  run {run + 1:2d} ({label:9s}) {figures}"
            print(line, flush=True)
            lines.append(line)
    version = importlib.import_module(name).__version__
    command = f"{Path(sys.executable).parent.parent.name}/bin/python benchmarks/travel_spread.py --runs {args.runs}"
    command += "".join(f" --env {item}" for item in args.env) + f" --copy-path {args.copy_path}"
    out = [f"== {name} {version}, Python {platform.python_version()}, {datetime.date.today()}, "
           f"{os.cpu_count()} CPUs, command: {command}",
           "[reruns] tests/test_figures_travel.py's job, rank 0's gated figure (live allocations), MiB; "
           f"odd runs: the installed package ({len(str(site))} characters), even runs: a fresh copy first on "
           f"PYTHONPATH ({len(str(copy))} characters)", *lines]
    for nproc, got in sorted(values.items()):
        for label, part in (("installed", got[0::2]), ("copy", got[1::2])):
            if part:
                out.append(f"  nproc={nproc}, {label}: {len(part)} runs, spread {max(part) - min(part):.3f} MiB")
        spread = max(got) - min(got)
        out.append(f"  nproc={nproc}: {len(got)} runs, {min(got):.3f} .. {max(got):.3f}, spread {spread:.3f} MiB; "
                   f"the test allows {ALLOWED_SPREAD_MIB[name, nproc]} MiB over its 3 runs")
    text = "\n".join(out) + "\n\n"
    print(text)
    with RESULTS.open("a") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
