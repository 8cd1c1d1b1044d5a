"""GPU evidence on a real machine (torch + NCCL): run it where there are GPUs, commit what it prints.

    PYTHONPATH=. PYTEST_PLUGINS=pytest_gpumem.plugin python benchmarks/gpu_evidence.py OUT_DIR [--parts ...]
    PYTHONPATH=.:/tmp/site python3 benchmarks/gpu_evidence.py OUT_DIR --parts speed [--runs 5] [--device cpu]

1. spike: a rank holds a steady amount, allocates 2 GiB more for 5 ms and frees it; 20 launches
   through the plugin at the default sampling rate: is the recorded peak >= steady + 2 GiB?
2. ddp: nproc=[1, 2] NCCL DDP on two GPUs; each rank reads its own NVML/nvidia-smi figure while it
   holds its peak; the plugin's recorded peak must be within 1% of it; the 1 -> 2 ratio.
3. leases: 8 one-GPU tests under `pytest -n 2` (and `-n 0` for the throughput ratio); the lease log
   must show no GPU held by two tests at once.
4. grid: spikes of 256 MiB .. 2 GiB held 1 .. 50 ms, watched by the sampler directly: capture rate.
5. cost: CPU time of the sampler per GPU per second while a job holds memory steady.
6. repeat: the DDP job 10 times with the floor measured: spread of the gated figure, floor and job.
7. inrank: the spike of 1. through the NVML sampler inside each rank vs the parent-side one.
8. speed: the bare job vs the same job as a gpumem test, 1 and 2 ranks, a trivial body and the DDP
   example's job, medians of --runs interleaved rounds and where the time goes (benchmarks/speed.py;
   OUT/gpu_speed.txt, or with --device cpu or no GPU, gloo and host memory: OUT/cpu_speed.txt).
It reads GPU settings (accounting mode) and never changes any.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

from pytest_gpumem.sampling.nvml import DEFAULT_INTERVAL_S, NvmlSampler, visible_gpus  # noqa: E402

MiB = 1024 * 1024

OWN_USAGE = '''
import os, subprocess, pynvml

def own_usage_mib():
    """What NVML and nvidia-smi say this process uses on its GPU right now."""
    pynvml.nvmlInit()
    uuid = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ.get("LOCAL_RANK", "0"))]
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    nvml = [p.usedGpuMemory / 2**20 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == os.getpid()]
    pynvml.nvmlShutdown()
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    rows = [float(line.split(",")[1]) for line in smi.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
    return (nvml[0] if nvml else None), (rows[0] if rows else None)
'''

SPIKE = OWN_USAGE + '''
import json, time
import pytest
import torch

@pytest.mark.gpumem(nproc=1, device="gpu", timeout=120)
@pytest.mark.parametrize("run", range(20))
def test_spike(run):
    steady = torch.ones(256 * 2**20 // 4, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.2)
    steady_mib, _ = own_usage_mib()
    spike = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")   # cudaMalloc of 2 GiB
    torch.cuda.synchronize()
    t0 = time.monotonic()
    time.sleep(0.005)
    held = time.monotonic() - t0
    del spike
    torch.cuda.empty_cache()                                            # cudaFree
    torch.cuda.synchronize()
    time.sleep(0.1)
    with open(os.path.join(os.environ["EVIDENCE"], f"spike-{run}.json"), "w") as f:
        json.dump({"steady_mib": steady_mib, "held_s": held}, f)
'''

DDP = OWN_USAGE + '''
import json, time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.gpumem(nproc=[1, 2], device="gpu", max_ratio=1.0, allow_mib=1024, launcher="torchrun", timeout=300)
def test_ddp():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda())
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(512, 4096, device="cuda")
    for _ in range(5):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    dist.barrier()
    readings = []
    for _ in range(5):                     # the caching allocator holds the peak: read it a few times
        readings.append(own_usage_mib())
        time.sleep(0.05)
    with open(os.path.join(os.environ["EVIDENCE"], f"ddp-ws{world}-rank{rank}.json"), "w") as f:
        json.dump({"nvml_mib": max(r[0] for r in readings), "smi_mib": max(r[1] for r in readings)}, f)
    dist.barrier()
    dist.destroy_process_group()
'''

LEASES = '''
import time
import pytest
import torch

@pytest.mark.gpumem(nproc=1, device="gpu", timeout=120)
@pytest.mark.parametrize("job", range(8))
def test_job(job):
    x = torch.randn(8192, 8192, device="cuda")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        x = (x @ x).tanh()
    torch.cuda.synchronize()
'''


OOM = '''
import pytest
import torch

@pytest.mark.gpumem(nproc=1, device="gpu", timeout=120)
def test_gpu_oom():
    torch.cuda.set_per_process_memory_fraction(0.02)        # ~2.8 GiB of the H200
    keep = [torch.empty(2**30, dtype=torch.uint8, device="cuda") for _ in range(8)]

@pytest.mark.gpumem(nproc=1, device="gpu", timeout=120)
def test_after_oom():
    torch.ones(1, device="cuda")
'''

SNAPSHOT = '''
import pytest
import torch

@pytest.mark.gpumem(nproc=1, device="gpu", max_mib=1000, timeout=120)
def test_over_cap():
    keep = [torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(4)]
'''

INFLATE = OWN_USAGE + '''
import pytest
import torch
import torch.distributed as dist

def train(gather):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.randn(2**29 // 4 * 4, device="cuda")          # 2 GiB of activations per rank
    if gather:                                               # the bug: every rank keeps every batch
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
    dist.all_reduce(torch.ones(1024, device="cuda"))
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()

@pytest.mark.gpumem(nproc=[1, 2], device="gpu", max_ratio=1.0, allow_mib=1024, launcher="torchrun", timeout=300)
def test_healthy():
    train(False)

@pytest.mark.xfail(strict=True, reason="all-gathered activations: rank memory grows with the world size")
@pytest.mark.gpumem(nproc=[1, 2], device="gpu", max_ratio=1.0, allow_mib=1024, launcher="torchrun", timeout=300)
def test_inflated():
    train(True)
'''


def faults(folder: Path, out: Path) -> list[str]:
    _, report = pytest_run(folder, "oom", OOM, out)
    lines = ["GPU OOM in a rank (torch):"]
    log = (out / "oom.log").read_text()
    for rec in report["tests"]:
        lines.append(f"  {rec['test']}: {rec['status']}")
    message = next((line.strip() for line in log.splitlines() if "OutOfMemoryError" in line), "(none)")
    lines.append("  message: " + message)
    leftover = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.split()
    lines.append(f"  compute processes left on the GPUs afterwards: {len(leftover)}")
    return lines


def snapshot(folder: Path, out: Path) -> list[str]:
    snaps = out / "snapshots"
    _, report = pytest_run(folder, "snapshot", SNAPSHOT, out, f"--gpumem-torch-snapshot={snaps}")
    log = (out / "snapshot.log").read_text()
    files = sorted(snaps.glob("*.pickle")) if snaps.exists() else []
    named = [line.strip() for line in log.splitlines() if ".pickle" in line]
    return ["torch allocator snapshot of a failing GPU test:",
            f"  status {report['tests'][0]['status'] if report['tests'] else '?'}; files: "
            + ", ".join(f"{f.name} ({f.stat().st_size} bytes)" for f in files),
            "  printed: " + (named[0] if named else "(not printed)")]


def inflate(folder: Path, out: Path) -> list[str]:
    _, report = pytest_run(folder, "inflate", INFLATE, out)
    lines = ["NCCL DDP nproc=[1, 2], healthy vs all-gathering variant (max_ratio 1.0 + 1024 MiB):"]
    for rec in report["tests"]:
        for size in rec["sizes"]:
            ratio = "" if size["ratio"] is None else f", ratio {size['ratio']:.2f}x"
            lines.append(f"  {rec['test'].split('::')[1]} nproc={size['nproc']}: ranks "
                         + ", ".join(f"{r}: {m:.0f} MiB" for r, m in size["ranks"].items())
                         + f"{ratio} -> {rec['status']}")
        lines.extend(f"    {m}" for m in rec["messages"])
    return lines


def pytest_run(folder: Path, name: str, source: str, out: Path, *args: str, label: str = "") -> tuple[float, dict]:
    test = folder / f"test_{name}.py"
    test.write_text(textwrap.dedent(source))
    report = out / f"{label or name}.json"
    env = {**os.environ, "EVIDENCE": str(out), "GPUMEM_MISSING_BASELINE": "ignore"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "-q",
                           f"--gpumem-report={report}", *args, str(test)],
                          cwd=folder, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (out / f"{report.stem}.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:])
    return wall, json.loads(report.read_text()) if report.exists() else {"tests": []}


def spike(folder: Path, out: Path) -> list[str]:
    _, report = pytest_run(folder, "spike", SPIKE, out)
    caught, rows = 0, []
    for rec in report["tests"]:
        run = int(rec["test"].split("[")[1].rstrip("]"))
        truth = json.loads((out / f"spike-{run}.json").read_text())
        peak = rec["sizes"][0]["gated_mib"]
        ok = peak is not None and truth["steady_mib"] is not None and peak >= truth["steady_mib"] + 2048
        caught += ok
        rows.append(f"  run {run:2d}: steady {truth['steady_mib']:.0f} MiB, held {truth['held_s'] * 1e3:.1f} ms, "
                    f"recorded peak {peak:.0f} MiB [{rec['sizes'][0]['methods']['0']}] {'caught' if ok else 'MISSED'}")
    interval_ms = float(os.environ.get("GPUMEM_INTERVAL_MS") or DEFAULT_INTERVAL_S * 1e3)
    return [f"spike 2 GiB for 5 ms, sampling every {interval_ms:g} ms: caught in "
            f"{caught} of {len(report['tests'])} launches"] + rows


def ddp(folder: Path, out: Path) -> list[str]:
    _, report = pytest_run(folder, "ddp", DDP, out)
    lines = []
    for rec in report["tests"]:
        for size in rec["sizes"]:
            ws = size["nproc"]
            for rank, mib in size["ranks"].items():
                truth = json.loads((out / f"ddp-ws{ws}-rank{rank}.json").read_text())
                err = (mib - truth["nvml_mib"]) / truth["nvml_mib"] * 100
                lines.append(f"  nproc={ws} rank {rank}: plugin {mib:.0f} MiB [{size['methods'][rank]}], "
                             f"NVML at peak {truth['nvml_mib']:.0f} MiB, nvidia-smi {truth['smi_mib']:.0f} MiB, "
                             f"difference {err:+.2f}%")
            if size["ratio"] is not None:
                lines.append(f"  ratio rank 0 nproc=1 -> {ws}: {size['ratio']:.3f}x ({rec['status']})")
    return ["DDP nproc=[1, 2], NCCL, torchrun, one GPU per rank:"] + lines


def repeat(folder: Path, out: Path, runs: int = int(os.environ.get("GPUMEM_EVIDENCE_RUNS", "10"))) -> list[str]:
    """The DDP job ``runs`` times, floor measured: how much a GPU figure moves, and which part moves."""
    rows: dict[int, list[tuple[float, float]]] = {}
    provenance: dict[str, str] = {}
    source = DDP.replace("def test_ddp():", f"@pytest.mark.parametrize('run', range({runs}))\ndef test_ddp(run):")
    _, report = pytest_run(folder, "repeat", source, out, "--gpumem-floor=on")  # one session: floors measured once
    if report["tests"]:
        for rec in report["tests"]:
            provenance = rec["provenance"]
            for size in rec["sizes"]:
                floor = (size.get("floor") or {}).get("ranks", {}).get("0")
                rows.setdefault(size["nproc"], []).append((size["gated_mib"], floor))
    lines = [f"DDP nproc=[1, 2] (NCCL, torchrun) {runs} times, rank 0, floor = an empty torch job "
             "(CUDA context + torch start-up [+ NCCL communicator at nproc=2]):",
             "  provenance: " + ", ".join(f"{k}={provenance[k]}" for k in
                                         ("nvidia_driver", "cuda_driver", "torch", "torch_cuda", "nccl")
                                         if k in provenance)]
    for n, values in sorted(rows.items()):
        gated = [g for g, _ in values]
        floors = [f for _, f in values if f is not None]
        jobs = [g - f for g, f in values if f is not None]
        lines.append(f"  nproc={n}: gated {min(gated):.0f} .. {max(gated):.0f} MiB "
                     f"(spread {max(gated) - min(gated):.0f})"
                     + (f"; floor {min(floors):.0f} .. {max(floors):.0f}; job's own {min(jobs):.0f} .. {max(jobs):.0f}"
                        f" (spread {max(jobs) - min(jobs):.0f})" if floors else "; floor not measured"))
        lines.append("    runs (gated = floor + job): " + ", ".join(
            f"{g:.0f}" + (f"={f:.0f}+{g - f:.0f}" if f is not None else "") for g, f in values))
    return lines


def inrank(folder: Path, out: Path) -> list[str]:
    """The 2 GiB / 5 ms spike through the sampler inside each rank, next to the parent-side one."""
    lines = []
    runs = int(os.environ.get("GPUMEM_EVIDENCE_RUNS", "20"))
    source = SPIKE.replace("range(20)", f"range({runs})")
    for where in ("parent", "rank"):
        _, report = pytest_run(folder, "spike", source, out, f"--gpumem-gpu-sampler={where}", "-n", "2",
                               label=f"spike-{where}")  # one launch per GPU at a time (leases)
        caught = 0
        for rec in report["tests"]:
            run = int(rec["test"].split("[")[1].rstrip("]"))
            truth = json.loads((out / f"spike-{run}.json").read_text())
            peak = rec["sizes"][0]["gated_mib"] if rec["sizes"] else None
            caught += bool(peak is not None and truth["steady_mib"] is not None
                           and peak >= truth["steady_mib"] + 2048)
        methods = sorted({m for rec in report["tests"] for s in rec["sizes"] for m in s["methods"].values()})
        lines.append(f"  sampler in the {where}: caught {caught} of {len(report['tests'])} [{', '.join(methods)}]")
    return [f"spike 2 GiB held 5 ms, {runs} launches each, parent-side vs in-rank NVML sampling:"] + lines


def leases(folder: Path, out: Path) -> list[str]:
    lease_dir = out / "leases"
    wall2, rep2 = pytest_run(folder, "leases", LEASES, out, "-n", "2", f"--gpumem-lease-dir={lease_dir}",
                             label="leases-n2")
    wall0, _ = pytest_run(folder, "leases", LEASES, out, "-n", "0", f"--gpumem-lease-dir={lease_dir}-serial",
                          label="leases-n0")
    events = [json.loads(line) for line in (lease_dir / "lease.log").read_text().splitlines()]
    held: dict[str, str] = {}
    overlaps = concurrent = 0
    for event in sorted(events, key=lambda e: e["t"]):
        for gpu in event["gpus"]:
            if event["event"] == "acquire":
                overlaps += gpu in held
                held[gpu] = event["owner"]
            else:
                held.pop(gpu, None)
        concurrent = max(concurrent, len(held))
    (out / "lease.log").write_text((lease_dir / "lease.log").read_text())
    return [f"leases: 8 one-GPU tests under -n 2: {len(events) // 2} leases, GPUs held by two tests at once: "
            f"{overlaps}, most GPUs busy at once: {concurrent}, "
            f"passed {sum(r['status'] == 'passed' for r in rep2['tests'])}/8",
            f"suite throughput: -n 0 {wall0:.1f} s, -n 2 {wall2:.1f} s, speed-up {wall0 / wall2:.2f}x"]


GRID_CHILD = '''
import json, sys, time, torch
sizes, durations, repeats = json.loads(sys.argv[1])
steady = torch.ones(256 * 2**20 // 4, device="cuda"); torch.cuda.synchronize()
print("ready", flush=True); sys.stdin.readline(); time.sleep(0.3)
events = []
for size in sizes:
    for dur in durations:
        for _ in range(repeats):
            x = torch.empty(size * 2**20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
            t0 = time.monotonic(); time.sleep(dur / 1e3); t1 = time.monotonic()
            del x; torch.cuda.empty_cache(); torch.cuda.synchronize()
            events.append([size, dur, t0, t1]); time.sleep(0.03)
print(json.dumps(events), flush=True)
'''


def grid(interval_s: float) -> list[str]:
    sizes, durations, repeats = [256, 1024, 2048], [1, 2, 5, 10, 50], 5
    gpus = visible_gpus()
    child = subprocess.Popen([sys.executable, "-c", GRID_CHILD, json.dumps([sizes, durations, repeats])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus[0].uuid})
    assert child.stdout.readline().strip() == "ready"
    sampler = NvmlSampler(gpus[:1], interval_s)
    sampler.add_process(0, child.pid)
    sampler.start()
    base = sampler._t0  # the timeline is relative to this monotonic instant
    child.stdin.write("go\n")
    child.stdin.flush()
    events = json.loads(child.stdout.readline())
    child.wait()
    sampler.stop()
    samples = [(base + t, row.get(0)) for t, row in sampler.timeline()]
    steady = min(v for _, v in samples if v is not None)
    lines = [f"grid at {interval_s * 1e3:g} ms (steady {steady:.0f} MiB): capture rate, worst error of the caught peak"]
    for size in sizes:
        cells = []
        for dur in durations:
            hits, errors = 0, []
            for s, d, t0, t1 in events:
                if (s, d) != (size, dur):
                    continue
                # the spike lives from the cudaMalloc before t0 to the cudaFree after t1; the next
                # spike starts 30 ms later, so the window stays well inside the gap
                window = [v for t, v in samples if t0 - 0.005 <= t <= t1 + 0.015 and v is not None]
                top = max(window, default=0.0)
                if top >= steady + 0.98 * size:
                    hits += 1
                    errors.append(abs(top - steady - size) / size * 100)
            cells.append(f"{dur}ms {hits}/{repeats}" + (f" ({max(errors):.1f}%)" if errors else ""))
        lines.append(f"  {size:5d} MiB: " + ", ".join(cells))
    return lines


def cost(interval_s: float) -> list[str]:
    gpus = visible_gpus()
    child = subprocess.Popen([sys.executable, "-c", "import torch,time; x=torch.ones(2**28, device='cuda'); "
                              "torch.cuda.synchronize(); time.sleep(14)"], env={**os.environ})
    time.sleep(6)
    sampler = NvmlSampler(gpus, interval_s)
    sampler.add_process(0, child.pid)
    c0, w0 = time.process_time(), time.monotonic()
    sampler.start()
    time.sleep(5)
    sampler.stop()
    c1, w1 = time.process_time(), time.monotonic()
    child.wait()
    share = (c1 - c0) / (w1 - w0) * 100
    return [f"sampler cost at {interval_s * 1e3:g} ms on {len(gpus)} GPU(s), steady job: "
            f"{share:.2f}% of one core, {share / len(gpus):.2f}% per GPU"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", default="spike,ddp,leases,grid,cost",
                        help="comma list of spike, ddp, leases, grid, cost, faults, snapshot, inflate, repeat, inrank, "
                             "speed")
    parser.add_argument("--runs", type=int, default=5, help="speed: measured rounds after the warm-up (default 5)")
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                        help="speed: auto (GPU where one is visible), gpu, or cpu (gloo and host memory)")
    parser.add_argument("--base", type=Path, help="speed: another checkout of pytest-gpumem measured alongside")
    parser.add_argument("--sites-off", action="store_true",
                        help="speed: also measure the plugin with --gpumem-sites=off (what peak sites cost)")
    parser.add_argument("--start-exec", action="store_true",
                        help="speed: also measure the plugin with --gpumem-start=exec (what forking the ranks saves)")
    parser.add_argument("--lazy-import", action="store_true",
                        help="speed: also measure the test importing its job (torch) in its body")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="speed: start no round that would end past this many seconds (default 400)")
    parser.add_argument("--intervals-ms", default=str(DEFAULT_INTERVAL_S * 1e3),
                        help="sampling periods for grid and cost, comma list")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "cases"
    folder.mkdir(exist_ok=True)
    parts = args.parts.split(",")
    info = ""
    if shutil.which("nvidia-smi") and args.device != "cpu":
        info = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,accounting.mode,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    lines = ["GPUs (read only):"] + ["  " + line for line in info.splitlines() or ["none visible"]]
    if "speed" in parts:
        from speed import speed

        lines += speed(folder, out, args.runs, args.device, base=args.base, budget_s=args.budget_s,
                       sites_off=args.sites_off, lazy=args.lazy_import, start_exec=args.start_exec)
    for name, part in (("spike", spike), ("ddp", ddp), ("leases", leases), ("faults", faults),
                       ("snapshot", snapshot), ("inflate", inflate), ("repeat", repeat), ("inrank", inrank)):
        if name in parts:
            lines += part(folder, out)
    for ms in map(float, args.intervals_ms.split(",")):
        if "grid" in parts:
            lines += grid(ms / 1e3)
        if "cost" in parts:
            lines += cost(ms / 1e3)
    text = "\n".join(lines)
    (out / "gpu_evidence.txt").write_text(text + "\n")
    print("=" * 30 + "\n" + text)


if __name__ == "__main__":
    main()
