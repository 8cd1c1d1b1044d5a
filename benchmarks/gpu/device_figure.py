"""The device figure (NVML's per-process figure, what nvidia-smi shows) against the caching allocator's,
on a GPU (issue 66): what lives outside the allocator, part by part, and each job's three figures.

    python3 benchmarks/gpu/device_figure.py --out OUTDIR [--budget 540] [--only probe,hub,tier,replay,sweep]

Probes, each in a process of its own, add one thing at a time and read, after each, NVML's figure for
the process less ``memory_reserved()`` (what the allocator cannot see): the context after ``cuda.init``
and a first kernel, then the first matrix product (cuBLAS's kernels loaded), one with a bias
(cuBLASLt), a backward (the autograd thread), an optimizer step, a convolution (cuDNN), flash
attention, NCCL at world 1 (its communicator, then each collective's first call). Each library is
also probed alone after the context, to show whether the parts add up.

Jobs (the hub models and the tier's jobs of tests/jobs.py at world 1 with real NCCL; the allocator
replay's jobs; 20 models of the sweep) each run in a process of their own with a thread reading NVML
every 2 ms: allocated and reserved peaks, NVML's peak for the process, and what was outside the
allocator at that peak. Everything lands in OUTDIR/device_figure.json, rewritten as each row ends.
``gpumem calibrate --out OUTDIR/gpumem-calibration.json`` on the same GPU gives the parts a fake GPU adds.

``--fake`` runs the same jobs here on a fake GPU of that calibration and sets its predicted reserved
and device figures beside the GPU's (results/device_figure.txt):

    python benchmarks/gpu/device_figure.py --fake OUTDIR/device_figure.json --calibration OUTDIR/gpumem-calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
# each probe: the stages it runs, in order (every probe starts with the context)
PROBES: dict[str, tuple[str, ...]] = {
    "all": ("context", "elementwise", "gemm", "gemm_bias", "backward", "adamw", "conv", "conv_backward",
            "flash", "nccl_init", "all_reduce", "all_gather", "reduce_scatter", "broadcast"),
    "context": ("context", "elementwise"),
    "gemm": ("context", "gemm", "gemm_bias", "backward"),
    "cudnn": ("context", "conv", "conv_backward"),
    "nccl": ("context", "nccl_init", "all_reduce", "all_gather", "reduce_scatter", "broadcast"),
    "flash": ("context", "flash"),
}
HUB_JOBS = ("resnet50_ddp", "vit_ddp", "swin_ddp", "convnext_ddp", "t5_ddp", "mixtral_fsdp2")
TIER_JOBS = ("fsdp1", "fsdp2", "ddp")
REPLAY_JOBS = ("loop", "resnet50_cl", "resnet50_cl_expandable", "resnet50_ddp_w1", "llama", "llama_split",
               "mixtral", "mixtral_fsdp2_w1")
SWEEP_MODELS = (("causal_lm", "gpt2"), ("causal_lm", "llama"), ("causal_lm", "qwen2"), ("causal_lm", "phi3"),
                ("causal_lm", "mistral"), ("causal_lm", "gemma"), ("causal_lm", "opt"), ("causal_lm", "bloom"),
                ("causal_lm", "falcon"), ("causal_lm", "gpt_neox"), ("causal_lm", "mixtral"),
                ("causal_lm", "qwen2_moe"), ("causal_lm", "olmo"), ("causal_lm", "stablelm"),
                ("causal_lm", "starcoder2"), ("image_classification", "vit"),
                ("image_classification", "convnext"), ("image_classification", "resnet"),
                ("image_classification", "swin"), ("causal_lm", "phi"))


class Nvml:
    """NVML's figure for this process (the compute process whose pid is ours; None while NVML does not
    list it, and always in a container without the host's pid namespace)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.matched: bool | None = None

    def process_mib(self) -> float | None:
        found = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        mine = [p for p in found if p.pid == os.getpid()]
        self.matched = bool(mine) or self.matched
        # another process's figure is never taken for ours: before this process holds a context NVML does
        # not list it, and a job running beside it would be read instead (the first run here did so)
        if not mine or mine[0].usedGpuMemory is None:
            return None
        return float(mine[0].usedGpuMemory) / MiB


def _figures(nvml: Nvml) -> dict[str, Any]:
    import torch

    torch.cuda.synchronize()
    return {"process_mib": nvml.process_mib(), "reserved_mib": torch.cuda.memory_reserved() / MiB,
            "allocated_mib": torch.cuda.memory_allocated() / MiB, "pid_matched": nvml.matched}


def probe(stages: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each stage's figures, the stages run in order in this process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    nvml = Nvml()
    rows = []
    keep: list[Any] = []
    for stage in stages:
        if stage == "context":
            torch.cuda.init()
            torch.cuda.set_device(0)
            keep.append(torch.zeros(1, device="cuda"))
        elif stage == "elementwise":
            x = torch.randn(1024, device="cuda")
            keep.append((x * 2 + 1).relu().sum())
        elif stage == "gemm":
            a = torch.randn(256, 256, device="cuda")
            keep.append(a @ a)
        elif stage == "gemm_bias":
            a, b = torch.randn(256, 256, device="cuda"), torch.randn(256, device="cuda")
            keep.append(torch.addmm(b, a, a))
        elif stage == "backward":
            lin = torch.nn.Linear(256, 256).cuda()
            lin(torch.randn(64, 256, device="cuda")).sum().backward()
            keep.append(lin)
        elif stage == "adamw":
            lin = torch.nn.Linear(256, 256).cuda()
            lin(torch.randn(64, 256, device="cuda")).sum().backward()
            torch.optim.AdamW(lin.parameters()).step()
            keep.append(lin)
        elif stage in ("conv", "conv_backward"):
            conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16)).cuda()
            images = torch.randn(8, 3, 32, 32, device="cuda", requires_grad=stage == "conv_backward")
            out = conv(images)
            if stage == "conv_backward":
                out.sum().backward()
            keep.append(out)
        elif stage == "flash":
            q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            keep.append(q)
        elif stage == "nccl_init":
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(29500 + os.getpid() % 2000))
            dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
        elif stage == "all_reduce":
            t = torch.ones(1 << 20, device="cuda")
            dist.all_reduce(t)
        elif stage == "all_gather":
            t = torch.ones(1 << 20, device="cuda")
            out = torch.empty(1 << 20, device="cuda")
            dist.all_gather_into_tensor(out, t)
        elif stage == "reduce_scatter":
            t = torch.ones(1 << 20, device="cuda")
            out = torch.empty(1 << 20, device="cuda")
            dist.reduce_scatter_tensor(out, t)
        elif stage == "broadcast":
            t = torch.ones(1 << 20, device="cuda")
            dist.broadcast(t, 0)
        else:
            raise SystemExit(f"unknown stage {stage}")
        rows.append({"stage": stage, **_figures(nvml)})
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def _job_body(kind: str, name: str) -> Callable[[], Any]:
    """What the job runs: the function its module gives it, on device 0 at world 1."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 2000))
    if kind in ("hub", "tier"):
        sys.path.insert(0, str(ROOT / "tests"))
        import jobs

        namespace: dict[str, Any] = {"__name__": f"gpumem_{kind}"}
        exec(compile(jobs.HUB if kind == "hub" else jobs.GPU_TIER, f"{kind}_jobs.py", "exec"), namespace)  # noqa: S102
        os.environ.update(jobs.HUB_REAL_ENV.get(name, {}))
        return namespace["JOBS"][name]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if kind == "replay":
        import allocator_replay

        if allocator_replay.JOBS[name][1]:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = allocator_replay.JOBS[name][1]
        return lambda: allocator_replay.run_job(name, fake=True)
    import fake_gpu_sweep

    family, model_type = name.split(":")

    def sweep() -> None:
        model, loss_of = fake_gpu_sweep.build(family, model_type, "cuda", "tiny")
        import torch

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            loss_of().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return sweep


def job(kind: str, name: str) -> dict[str, Any]:
    """The job's peaks: allocated and reserved (torch's), NVML's for the process, read every 2 ms."""
    import torch

    body = _job_body(kind, name)
    nvml = Nvml()
    peak: dict[str, Any] = {"process_mib": 0.0, "outside_mib": 0.0, "reserved_at_peak_mib": 0.0, "reads": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            used = nvml.process_mib()
            if used is not None:
                reserved = torch.cuda.memory_reserved(0) / MiB if torch.cuda.is_initialized() else 0.0
                peak["reads"] += 1
                if used > peak["process_mib"]:
                    peak.update(process_mib=used, reserved_at_peak_mib=reserved)
                peak["outside_mib"] = max(peak["outside_mib"], used - reserved)
            done.wait(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    body()
    torch.cuda.synchronize()
    time.sleep(0.05)
    done.set()
    watcher.join()
    libraries = sorted({line.split("/")[-1].split(".so")[0] for line in Path("/proc/self/maps").read_text()
                        .splitlines() if any(k in line for k in ("cudnn", "nccl", "cublas", "cufft", "cusparse"))})
    return {"max_allocated_mib": torch.cuda.max_memory_allocated() / MiB,
            "max_reserved_mib": torch.cuda.max_memory_reserved() / MiB, **peak, "pid_matched": nvml.matched,
            "end": _figures(nvml), "libraries": libraries}


def fake_job(kind: str, name: str, model: str, calibration: str) -> dict[str, Any]:
    """The job on a fake GPU of ``model`` (a world of one: the plugin's stand-in group): its peaks and
    the device figure it predicts, with the parts."""
    from pytest_gpumem.rankside import fakegpu, simulate

    if kind == "replay":  # its allocator settings, before the fake GPU reads them at install
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import allocator_replay

        os.environ.update({"PYTORCH_CUDA_ALLOC_CONF": allocator_replay.JOBS[name][1]} if allocator_replay.JOBS[name][1]
                          else {})
    simulate.install_world(simulate.World(0, 1))
    fakegpu.install(model, calibration)
    body = _job_body(kind, name)
    import torch

    body()
    reserved = torch.cuda.max_memory_reserved() / MiB
    return {"max_allocated_mib": torch.cuda.max_memory_allocated() / MiB, "max_reserved_mib": reserved,
            "device": fakegpu.describe(reserved).get("device"), "torch": torch.__version__}


def compare(path: Path, calibration: Path, only: list[str]) -> str:
    """The table: each job's GPU figures against the fake GPU's, each fake job in a process of its own."""
    gpu = json.loads(path.read_text())
    model = gpu["gpu"]
    rows = [f"{'job':34} {'GPU alloc':>9} {'fake':>9} {'GPU res':>9} {'fake':>9} {'err %':>6} {'GPU dev':>9} "
            f"{'fake':>9} {'err %':>6}  parts (MiB)"]
    counts = {"reserved": 0, "device": 0, "compared": 0}
    for task, real in gpu["jobs"].items():
        if only and not any(task.startswith(o) for o in only):
            continue
        if "error" in real:
            rows.append(f"{task:34} GPU error: {real['error'][:150]}")
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run([sys.executable, __file__, "--fake-job", task, "--model", model, "--calibration",
                               str(calibration)], capture_output=True, text=True, env=env, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            rows.append(f"{task:34} fake error: " + " | ".join(done.stderr.strip().splitlines()[-2:])[:200])
            continue
        fake = json.loads(lines[-1])
        device = fake["device"] or {}
        predicted = sum(device.get("parts_mib", {}).values())
        res_err = 100 * (fake["max_reserved_mib"] - real["max_reserved_mib"]) / real["max_reserved_mib"]
        dev_err = 100 * (predicted - real["process_mib"]) / real["process_mib"]
        counts["compared"] += 1
        counts["reserved"] += abs(res_err) <= 2.0
        counts["device"] += abs(dev_err) <= 3.0
        parts = " ".join(f"{k} {v:.0f}" for k, v in device.get("parts_mib", {}).items() if k != "reserved")
        rows.append(f"{task:34} {real['max_allocated_mib']:9.1f} {fake['max_allocated_mib']:9.1f} "
                    f"{real['max_reserved_mib']:9.1f} {fake['max_reserved_mib']:9.1f} {res_err:+6.2f} "
                    f"{real['process_mib']:9.1f} {predicted:9.1f} {dev_err:+6.2f}  {parts}")
    return (f"GPU: {model}, torch {gpu['torch']} (CUDA {gpu['cuda']}); fake GPU: the same model from the GPU's "
            f"calibration, {os.cpu_count()} CPUs; MiB; GPU dev is NVML's peak for the process (2 ms reads); "
            f"{counts['reserved']} of {counts['compared']} reserved peaks within 2%, {counts['device']} of "
            f"{counts['compared']} device figures within 3%\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget", type=float, default=540)
    parser.add_argument("--only", default="probe,hub,tier,replay,sweep")
    parser.add_argument("--probe")
    parser.add_argument("--job")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--fake", type=Path, help="the GPU's device_figure.json: the jobs on a fake GPU against it")
    parser.add_argument("--calibration", type=Path, help="gpumem calibrate's file from the same GPU")
    parser.add_argument("--fake-job")
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.fake_job:
        kind, name = args.fake_job.split("/", 1)
        print(json.dumps(fake_job(kind, name, args.model, str(args.calibration))))
        return
    if args.fake:
        table = compare(args.fake, args.calibration, [o for o in args.only.split(",") if o and o != "probe"]
                        if args.only != parser.get_default("only") else [])
        print(table, end="")
        if args.out:
            args.out.write_text(table)
        return
    if args.probe:
        print(json.dumps(probe(PROBES[args.probe])))
        return
    if args.job:
        kind, name = args.job.split("/", 1)
        print(json.dumps(job(kind, name)))
        return
    import torch

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                              "gpu": torch.cuda.get_device_name(0), "probes": {}, "jobs": {}}
    lock = threading.Lock()

    def child(argv: list[str], timeout: float) -> Any:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                           if p)}
        try:
            done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "["))]
        if done.returncode != 0 or not lines:
            return {"error": f"exit {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-3:])[:600]}
        return json.loads(lines[-1])

    def save() -> None:
        (args.out / "device_figure.json").write_text(json.dumps(result, indent=1))

    wanted = args.only.split(",")
    if "probe" in wanted:
        for name in PROBES:
            result["probes"][name] = child(["--probe", name], 60)
            print(name, json.dumps(result["probes"][name]), flush=True)
            save()
    tasks = [f"hub/{n}" for n in HUB_JOBS if "hub" in wanted] + \
        [f"tier/{n}" for n in TIER_JOBS if "tier" in wanted] + \
        [f"replay/{n}" for n in REPLAY_JOBS if "replay" in wanted] + \
        [f"sweep/{f}:{m}" for f, m in SWEEP_MODELS if "sweep" in wanted]

    def one(task: str) -> None:
        left = args.budget - (time.monotonic() - started)
        row = {"error": "not started: budget spent"} if left < 25 else child(["--job", task], min(120.0, left))
        with lock:
            result["jobs"][task] = row
            save()
        print(task, json.dumps(row), flush=True)

    from concurrent.futures import ThreadPoolExecutor

    rows = [r for probe_rows in result["probes"].values() if isinstance(probe_rows, list) for r in probe_rows]
    parallel = args.parallel if all(r["pid_matched"] for r in rows) else 1  # else one process on the GPU at a time
    result["parallel"] = parallel
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, tasks))


if __name__ == "__main__":
    main()
