"""Simulated vs real worlds on CPU: does a simulated rank read the figure a real rank reads?

    .venv-torch/bin/python benchmarks/simulate_validation.py              # sizes 2,4,8
    .venv-torch/bin/python benchmarks/simulate_validation.py --sizes 2,4  # a small machine

A generated test project, run once through ``pytest --gpumem --gpumem-report=...`` (the product
path: marker, planner, launcher, rank-side stand-in, report), holds for each world size N a torch
DDP job, a torch FSDP2 job (``fully_shard`` per layer and on the model; FSDP1 needs an accelerator)
and a regression twin of the DDP job (every rank all-gathers a 16 MiB activation per rank and
keeps it through training: grows with N), each once as a real gloo world (``simulate="off"``) and
once as a simulated one (``simulate="on"``: rank 0 alone, torch's fake process group). The tests
are interleaved (for each N: each job real, then simulated), so the machine's load falls on both
alike. Rank 0's gated host figure (memray's live allocations) is read from the report.

The twin's verdict: ``max_mib`` set halfway between the healthy DDP job's largest figure and its
figure plus the twin's smallest growth (16 MiB x 2), judged by the plugin's own verdict
(``judging.verdict.judge``) on each measured figure, real and simulated.

The difference, explained: memray's peak of importing what a simulated rank imports and a real one
does not (``torch.testing._internal.distributed.fake_pg`` and DDP's debugging hooks) on top of
torch, measured here; the rest of real - simulated is the communicator's own memory (gloo's pairs
and buffers), which a simulated rank does not have.

Results: benchmarks/results/simulate_validation.txt (and .json, the raw figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's package (hence E402 below)
sys.path.insert(0, str(ROOT / "tests"))  # the jobs, shared with tests/test_simulate.py

from jobs import TORCH_SIMULATE  # noqa: E402  (a 4-layer 1024-wide MLP, Adam, 3 steps)

from pytest_gpumem.config.spec import Defaults, parse_marker  # noqa: E402
from pytest_gpumem.judging.verdict import judge  # noqa: E402
from pytest_gpumem.results.size import SizeResult  # noqa: E402
from pytest_gpumem.sampling import Peak  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
JOBS = ("ddp", "fsdp2", "twin")
TWIN_MIB = 16  # what each rank's activation weighs (tests/jobs.py); the twin keeps N of them


# What a simulated rank imports and a real one does not (rankside.simulate), measured on top of torch.
IMPORT_PROBE = '''
import json, os, sys, tempfile
import torch
import torch.distributed
from memray import FileReader, Tracker
path = os.path.join(tempfile.mkdtemp(), "import.bin")
with Tracker(path, native_traces=False):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
reader = FileReader(path)
print(json.dumps({"peak_mib": reader.metadata.peak_memory / 2**20,
                  "live_mib": sum(a.size for a in reader.get_leaked_allocation_records()) / 2**20}))
'''

# A communicator's own host memory: rank 0 of a real gloo world of N (or of a fake one), memray from
# just before init_process_group to after a collective of each kind the jobs use, with the tensors
# the job owns allocated before tracking starts: what the process group itself allocates.
COMM_PROBE = '''
import json, os, sys, tempfile
import torch
import torch.distributed as dist
from memray import FileReader, Tracker
backend = sys.argv[1]
if backend == "fake":
    from torch.testing._internal.distributed.fake_pg import FakeStore
world = int(os.environ["WORLD_SIZE"])
local = torch.ones(16 * 2**20 // 4)
parts = [torch.empty_like(local) for _ in range(world)]
grad = torch.ones(2**20)
peaks = {}

def tracked(name, fn):
    path = os.path.join(tempfile.mkdtemp(), name + ".bin")
    with Tracker(path, native_traces=False):
        fn()
    peaks[name] = FileReader(path).metadata.peak_memory / 2**20

def group():
    if backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]), world_size=world)
    else:
        dist.init_process_group("gloo")
    dist.all_reduce(grad)
    dist.barrier()

tracked("group", group)                                   # set-up, pairs, a 4 MiB all-reduce
tracked("all_gather", lambda: dist.all_gather(parts, local))  # N x 16 MiB into tensors the job owns
flat, shard = torch.ones(2**20), torch.empty(2**20 // world)   # FSDP2's collectives on a 4 MiB layer

def fsdp():
    dist.all_gather_into_tensor(flat, shard)
    dist.reduce_scatter_tensor(shard, flat)

tracked("fsdp", fsdp)
dist.destroy_process_group()
if os.environ["RANK"] == "0":
    print(json.dumps(peaks))
'''


def communicator_cost(n: int, backend: str) -> dict[str, float]:
    """memray's peaks in rank 0 of a gloo (or fake) world of ``n``: its group's set-up and an all-reduce;
    an all-gather."""
    from pytest_gpumem.launching.supervise import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n)}
    ranks = range(n if backend == "gloo" else 1)
    procs = [subprocess.Popen([sys.executable, "-c", COMM_PROBE, backend], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in ranks]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return {k: float(v) for k, v in json.loads(outs[0].strip().splitlines()[-1]).items()}


def communicators(sizes: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    for n in sizes:
        out[str(n)] = {backend: communicator_cost(n, backend) for backend in ("gloo", "fake")}
        print(f"communicator at {n}: {out[str(n)]}", flush=True)
    return out


def project(sizes: tuple[int, ...], timeout: float) -> str:
    """The test file: for each size, each job real then simulated (interleaved)."""
    lines = [TORCH_SIMULATE]
    for n in sizes:
        for job in JOBS:
            for mode in ("off", "on"):
                lines.append(f'''
@pytest.mark.gpumem(nproc={n}, simulate="{mode}", timeout={timeout})
def test_{job}_{n}_{"real" if mode == "off" else "simulated"}():
    JOBS["{job}"]()
''')
    return "".join(lines)


def run_project(sizes: tuple[int, ...], timeout: float) -> tuple[dict[str, Any], float]:
    with tempfile.TemporaryDirectory(prefix="gpumem-simulate-") as tmp:
        folder = Path(tmp)
        (folder / "test_simulate_validation.py").write_text(project(sizes, timeout))
        report = folder / "report.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                               "--gpumem", f"--gpumem-report={report}", "test_simulate_validation.py"],
                              cwd=folder, env=env, text=True, capture_output=True)
        seconds = time.monotonic() - started
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
        if not report.exists():
            raise SystemExit(f"pytest left no report (exit {proc.returncode})")
        return json.loads(report.read_text()), seconds


def figures(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """test name -> rank 0's gated figure, method, duration, whether it ran simulated."""
    out = {}
    for test in report["tests"]:
        name = test["test"].split("::")[1]
        for size in test["sizes"]:
            out[name] = {"mib": size.get("gated_mib"), "method": size.get("methods", {}).get("0"),
                         "duration_s": size.get("duration_s"), "simulated": size.get("simulated") or [],
                         "status": test["status"]}
    return out


def import_cost() -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], text=True, capture_output=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verdicts(measured: dict[str, dict[str, Any]], sizes: tuple[int, ...]) -> tuple[float, dict[str, str]]:
    """max_mib halfway between the healthy job's largest figure and the twin's smallest growth above
    it; each healthy and twin figure judged against it by the plugin's verdict."""
    healthy = [v["mib"] for k, v in measured.items() if k.startswith("test_ddp_") and v["mib"] is not None]
    limit = max(healthy) + TWIN_MIB * min(sizes) / 2
    spec = parse_marker((), {"nproc": 1, "max_mib": limit}, Defaults())
    out = {}
    for name, entry in measured.items():
        if entry["mib"] is None or not name.startswith(("test_ddp_", "test_twin_")):
            continue
        failed = judge(spec, [SizeResult(1, "cpu", {0: Peak(entry["mib"], "measured")})]).failures
        out[name] = "FAIL" if failed else "pass"
    return limit, out


def render(doc: dict[str, Any]) -> str:
    measured, sizes = doc["measured"], doc["sizes"]
    imported = doc["imports"]["live_mib"]
    runs = doc.get("seconds_note") or f"one, {doc['seconds']:.0f} s"
    lines = ["Simulated vs real worlds on CPU (torch gloo): rank 0's gated host figure (memray live allocations)",
             f"command: {doc['command']}", f"environment: {doc['environment']}",
             f"pytest --gpumem runs: {runs}; tests interleaved (for each N: each job real, "
             "then simulated) on a shared 2-core machine", "",
             "job    N  real MiB  simulated MiB  real - simulated  gloo's own (real - simulated + imports)"]
    for job in JOBS:
        for n in sizes:
            real, sim = measured.get(f"test_{job}_{n}_real", {}), measured.get(f"test_{job}_{n}_simulated", {})
            if real.get("mib") is None or sim.get("mib") is None:
                lines.append(f"{job:<6} {n:<2} {real.get('status', '-'):>8}  {sim.get('status', '-'):>13}")
                continue
            diff = real["mib"] - sim["mib"]
            lines.append(f"{job:<6} {n:<2} {real['mib']:8.2f}  {sim['mib']:13.2f}  {diff:+16.2f}  "
                         f"{diff + imported:+.2f}")
    lines += ["", f"regression twin: max_mib = {doc['limit']:.2f} MiB (the healthy DDP job's largest figure + "
              f"{TWIN_MIB} MiB x {min(sizes)} / 2), judged by judging.verdict.judge",
              "job    N  real  simulated"]
    for job in ("ddp", "twin"):
        for n in sizes:
            lines.append(f"{job:<6} {n:<2} {doc['verdicts'].get(f'test_{job}_{n}_real', '-'):<5} "
                         f"{doc['verdicts'].get(f'test_{job}_{n}_simulated', '-')}")
    lines += ["", "what a simulated rank imports and a real one does not (fake_pg, DDP's debugging hooks), memray on "
              f"top of torch: peak {doc['imports']['peak_mib']:.2f} MiB, still live {imported:.2f} MiB",
              "launch seconds (rank 0's duration): " + ", ".join(
                  f"{k.removeprefix('test_')} {v['duration_s']:.0f}" for k, v in measured.items()
                  if v.get("duration_s") is not None)]
    comm = doc.get("communicator") or {}
    if comm:
        lines += ["", "the communicator's own host memory, memray's peak in rank 0 (tensors the job owns allocated "
                  "before tracking): init_process_group + a 4 MiB all_reduce + barrier | all_gather of N x 16 MiB "
                  "into the job's tensors "
                  "| all_gather_into_tensor + reduce_scatter_tensor of a 4 MiB layer (FSDP2's)",
                  "N  gloo group  fake group  | gloo all_gather  fake all_gather  | gloo FSDP2's  fake FSDP2's"]
        for n, by in sorted(comm.items(), key=lambda kv: int(kv[0])):
            gloo, fake = by["gloo"], by["fake"]
            lines.append(f"{n:<2} {gloo['group']:10.2f}  {fake['group']:10.2f}  | {gloo['all_gather']:15.2f}  "
                         f"{fake['all_gather']:15.2f}  | {gloo.get('fsdp', float('nan')):12.2f}  "
                         f"{fake.get('fsdp', float('nan')):12.2f}")
    lines += ["", *doc.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="world sizes, each real and simulated")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulate_validation.json")
    parser.add_argument("--comm-sizes", default="2,4,8", help="world sizes of the communicator probe")
    parser.add_argument("--merge", action="store_true",
                        help="add these sizes to the JSON's (a machine that cannot run them all at once)")
    parser.add_argument("--comm-only", action="store_true", help="only the communicator probe, into the JSON")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .txt from the JSON")
    parser.add_argument("--note", action="append", default=[], help="a line for the results file")
    args = parser.parse_args(argv)
    comm_sizes = [int(n) for n in args.comm_sizes.split(",") if n]
    if args.render_only or args.comm_only:
        doc = json.loads(args.out.read_text())
        doc["notes"] = args.note or doc.get("notes", [])
        if args.comm_only:
            doc["communicator"] = communicators(comm_sizes)
            doc["command"] += f"; then --comm-only --comm-sizes {args.comm_sizes}"
    else:
        import torch

        sizes = tuple(sorted(int(s) for s in args.sizes.split(",")))
        report, seconds = run_project(sizes, args.timeout)
        measured = figures(report)
        limit, judged = verdicts(measured, sizes)
        communicator = communicators(comm_sizes)
        seconds_note = ""
        command = (f".venv-torch/bin/python benchmarks/simulate_validation.py --sizes {args.sizes} "
                   f"--comm-sizes {args.comm_sizes or repr('')}" + (" --merge" if args.merge else ""))
        if args.merge and args.out.exists():  # an earlier run's sizes beside these, each run's seconds
            earlier = json.loads(args.out.read_text())
            measured = {**earlier["measured"], **measured}
            sizes = tuple(sorted({*earlier["sizes"], *sizes}))
            limit, judged = verdicts(measured, sizes)
            seconds_note = f"{earlier['seconds']:.0f} s ({earlier['command']}) + {seconds:.0f} s ({command})"
            command = f"{earlier['command']}; then {command}"
            communicator = {**earlier.get("communicator", {}), **communicator}
        doc = {"sizes": list(sizes), "measured": measured, "limit": limit, "verdicts": judged,
               "imports": import_cost(), "communicator": communicator, "seconds": seconds,
               "notes": args.note, "seconds_note": seconds_note,
               "command": command,
               "environment": f"torch {torch.__version__}, Python {platform.python_version()}, "
                              f"{os.cpu_count()} CPUs, {datetime.date.today().isoformat()}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    text = render(doc)
    args.out.with_suffix(".txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
