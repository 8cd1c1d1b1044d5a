"""The caching allocator's reserved peak, replayed (``pytest_gpumem.sampling.caching_allocator``) against
a GPU's own ``max_memory_reserved()``.

    python3 benchmarks/allocator_replay.py --record OUTDIR   # on a GPU machine (--budget 220 s)
    python benchmarks/allocator_replay.py --replay OUTDIR/traces.json.gz --out table.txt   # anywhere
    python benchmarks/allocator_replay.py --fake OUTDIR/traces.json.gz [--only ...]   # the jobs on a fake GPU

``--fake`` runs each job here on a fake GPU and sets its peaks (allocated, and reserved as the fake GPU
replays the caching allocator while the job runs) beside the GPU's recorded ones
(results/allocator_replay_fake.txt).

``--record`` runs each job in a process of its own (three at a time), the allocator's history on from
the start (``torch.cuda.memory._record_memory_history``, no stacks), and keeps of each the events
(action, address, size, stream), the real ``max_memory_reserved()``/``max_memory_allocated()`` and the
``PYTORCH_CUDA_ALLOC_CONF`` it ran under, in OUTDIR/traces.json.gz, rewritten as each job ends; every
job ends within ``--budget`` seconds (one cut there, or not started, is an error row). ``--replay``
replays each history with the job's settings and compares the reserved peaks; "alloc-as-res" is what a
fake GPU reported before (its allocated peak taken for reserved); "traced" is the reserved peak the
history's own segment events give; a row whose replay reserves otherwise than the GPU did names the
first allocation where it does.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom")
SPLIT = "max_split_size_mb:64,roundup_power2_divisions:[64:8,>:2]"
# job -> (what it runs, PYTORCH_CUDA_ALLOC_CONF)
JOBS: dict[str, tuple[str, str]] = {
    "loop": ("a 4-layer MLP, AdamW, 6 steps, empty_cache after the third", ""),
    "resnet50_cl": ("torchvision ResNet-50, channels_last, batch 32, SGD, 3 steps", ""),
    "resnet50_cl_expandable": ("the same, expandable segments", "expandable_segments:True"),
    "resnet50_ddp_w1": ("the same under DDP (NCCL, world 1)", ""),
    "llama": ("transformers Llama from config (1024 wide, 8 layers), bf16 autocast, AdamW, 3 steps", ""),
    "llama_split": ("the same, max_split_size and power-of-two rounding", SPLIT),
    "mixtral": ("transformers Mixtral from config (512 wide, 4 layers, 8 experts), AdamW, 3 steps", ""),
    "mixtral_fsdp2_w1": ("the same under FSDP2 (NCCL, world 1)", ""),
    "sweep_gpt2": ("benchmarks/fake_gpu_sweep.py's gpt2, fp32", ""),
    "sweep_qwen2": ("the sweep's qwen2, bf16 autocast", ""),
    "sweep_phi3": ("the sweep's phi3, fp32", ""),
    "sweep_vit": ("the sweep's vit, fp32", ""),
    "sweep_convnext": ("the sweep's convnext, bf16 autocast", ""),
}


def _steps(model: Any, loss_of: Callable[[], Any], steps: int, bf16: bool, optimizer: Any = None,
           between: Callable[[int], None] | None = None) -> None:
    import torch

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if between is not None:
            between(step)


def _distributed() -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 2000))
    # on a fake GPU the plugin's stand-in group answers (installed with the fake GPU: no NCCL without one)
    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))


def _hf(kind: str) -> tuple[Any, Callable[[], Any]]:
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                          num_key_value_heads=8, intermediate_size=2816, vocab_size=32000)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MixtralConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                            num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
                                            num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    model = model.cuda()
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    return model, lambda: model(input_ids=ids, labels=ids).loss


def run_job(name: str, fake: bool = False) -> None:
    """One job on the GPU, the allocator's history on from its first allocation (on a fake GPU: its
    figures alone)."""
    import torch

    torch.cuda.init()
    if not fake:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",  # noqa: SLF001
                                                 max_entries=4_000_000)
    if name == "loop":
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
        data = torch.randn(512, 2048, device="cuda")
        _steps(model, lambda: model(data).square().mean(), 6, False,
               between=lambda step: torch.cuda.empty_cache() if step == 2 else None)
    elif name.startswith("resnet50"):
        import torchvision

        net = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        model = net
        if name.endswith("ddp_w1"):
            _distributed()
            model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0])
        images = torch.randn(32, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (32,), device="cuda")
        loss = torch.nn.CrossEntropyLoss()
        _steps(model, lambda: loss(model(images), labels), 3, False,
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    elif name.startswith(("llama", "mixtral")):
        model, loss_of = _hf(name.split("_")[0])
        if name.endswith("fsdp2_w1"):
            from torch.distributed.fsdp import fully_shard

            _distributed()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        _steps(model, loss_of, 3, True)
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from fake_gpu_sweep import build

        model_type = name.split("_", 1)[1]
        family = "image_classification" if model_type in ("vit", "convnext") else "causal_lm"
        model, loss_of = build(family, model_type, "cuda", "tiny")
        _steps(model, loss_of, 2, model_type in ("qwen2", "convnext"))
    torch.cuda.synchronize()
    figures = {"max_reserved": torch.cuda.max_memory_reserved(), "max_allocated": torch.cuda.max_memory_allocated(),
               "retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    if not fake:
        trace = torch.cuda.memory._snapshot()["device_traces"][0]  # noqa: SLF001
        figures.update(wrapped=len(trace) >= 4_000_000, events=[
            [ACTIONS.index(e["action"]), int(e.get("addr") or 0), int(e.get("size") or 0), int(e.get("stream") or 0)]
            for e in trace if e["action"] in ACTIONS])
    print(json.dumps(figures))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def record(out: Path, budget: float, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def one(name: str) -> None:
        left = deadline - time.monotonic()
        if left < 20:
            result: dict[str, Any] = {"error": f"not started: {budget:.0f} s budget spent"}
        else:
            result = _job(name, min(150.0, left))
        with lock:
            results[name] = result
            with gzip.open(out / "traces.json.gz", "wt") as handle:
                json.dump(results, handle)
        print(name, {k: v for k, v in result.items() if k != "events"}, flush=True)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(one, only or list(JOBS)))


def _job(name: str, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTORCH_CUDA_ALLOC_CONF": JOBS[name][1]}
    if not JOBS[name][1]:
        env.pop("PYTORCH_CUDA_ALLOC_CONF")
    try:
        done = subprocess.run([sys.executable, __file__, "--job", name], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {"error": f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    result: dict[str, Any] = json.loads(lines[-1])
    result.update(conf=JOBS[name][1], s=round(time.perf_counter() - started, 1))
    return result


def replay(path: Path) -> str:
    """The table: per job, the GPU's peaks, the replay's, and how far the replay's reserved peak is."""
    sys.path.insert(0, str(ROOT))
    from pytest_gpumem.sampling.alloc_conf import parse_alloc_conf
    from pytest_gpumem.sampling.caching_allocator import (
        first_divergence,
        replay_allocator,
        trace_events,
        traced_reserved_peak,
    )

    with gzip.open(path, "rt") as handle:
        results = json.load(handle)
    rows = [f"{'job':24} {'alloc MiB':>10} {'reserved':>10} {'traced':>10} {'replay':>10} {'err %':>7} "
            f"{'alloc-as-res %':>14} {'frag %':>7} {'events':>8}  settings"]
    within = replayed = 0
    order = list(JOBS)
    for name, result in sorted(results.items(), key=lambda item: order.index(item[0]) if item[0] in order
                               else len(order)):
        if "error" in result:
            rows.append(f"{name:24} error: {result['error']}")
            continue
        snapshot = {"device_traces": [[{"action": ACTIONS[a], "addr": addr, "size": size, "stream": stream}
                                       for a, addr, size, stream in result["events"]]]}
        conf = parse_alloc_conf(result["conf"]) if result["conf"] else None
        figures, diverges = replay_allocator(trace_events(snapshot), conf), first_divergence(snapshot, conf)
        real, err = result["max_reserved"], 100 * (figures.reserved_peak - result["max_reserved"]) / \
            result["max_reserved"]
        replayed, within = replayed + 1, within + (abs(err) <= 2.0)
        notes = ("" if figures.allocated_peak == result["max_allocated"] else
                 f"  (replayed allocated {figures.allocated_peak / MiB:.1f})") + \
            ("  (history wrapped: its start is lost)" if result.get("wrapped") else "") + \
            (f"  (first divergence: {diverges})" if diverges else "")
        rows.append(f"{name:24} {result['max_allocated'] / MiB:10.1f} {real / MiB:10.1f} "
                    f"{traced_reserved_peak(snapshot) / MiB:10.1f} {figures.reserved_peak / MiB:10.1f} "
                    f"{err:+7.2f} {100 * (result['max_allocated'] - real) / real:+14.2f} "
                    f"{100 * figures.fragmentation:7.1f} {len(result['events']):8}  {result['conf'] or '-'}"
                    + notes)
    first = next((r for r in results.values() if "torch" in r), {})
    return (f"torch {first.get('torch')} on {first.get('gpu')}; MiB; err: the replay's reserved peak against "
            f"max_memory_reserved(); {within} of {replayed} replayed jobs within 2%\n" + "\n".join(rows) + "\n")


def fake(path: Path, only: list[str], model: str) -> str:
    """The table: per job, the GPU's recorded peaks against a fake GPU's, each job run here in a process
    of its own (a job's process group of one is the plugin's stand-in: no NCCL without a GPU)."""
    with gzip.open(path, "rt") as handle:
        results = json.load(handle)
    rows = [f"{'job':24} {'GPU alloc':>10} {'fake':>10} {'err %':>7} {'GPU res':>10} {'fake res':>10} {'err %':>7} "
            f"{'s':>6}  settings"]
    within = compared = 0
    versions: set[str] = set()
    for name in only or list(JOBS):
        real = results.get(name, {})
        started = time.perf_counter()
        path_env = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path_env, "PYTORCH_CUDA_ALLOC_CONF": JOBS[name][1]}
        done = subprocess.run([sys.executable, __file__, "--job", name, "--fake-gpu", model], capture_output=True,
                              text=True, env=env)
        seconds = time.perf_counter() - started
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines or not lines[-1].startswith("{") or "error" in real or not real:
            errors = [line for line in done.stderr.splitlines() if "Error" in line] or ["?"]
            why = real.get("error") or ("no GPU row" if not real else errors[-1][:200])
            rows.append(f"{name:24} error: {why}")
            continue
        got = json.loads(lines[-1])
        versions.add(got["torch"])
        alloc_err = 100 * (got["max_allocated"] - real["max_allocated"]) / real["max_allocated"]
        res_err = 100 * (got["max_reserved"] - real["max_reserved"]) / real["max_reserved"]
        compared, within = compared + 1, within + (abs(res_err) <= 2.0)
        rows.append(f"{name:24} {real['max_allocated'] / MiB:10.1f} {got['max_allocated'] / MiB:10.1f} "
                    f"{alloc_err:+7.2f} {real['max_reserved'] / MiB:10.1f} {got['max_reserved'] / MiB:10.1f} "
                    f"{res_err:+7.2f} {seconds:6.1f}  {JOBS[name][1] or '-'}")
    first = next((r for r in results.values() if "torch" in r), {})
    return (f"GPU: torch {first.get('torch')} on {first.get('gpu')}; fake GPU: {model!r} on torch "
            f"{', '.join(sorted(versions))}, {os.cpu_count()} CPUs; "
            f"MiB; {within} of {compared} jobs' reserved peaks within 2%\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", type=Path)
    parser.add_argument("--replay", type=Path)
    parser.add_argument("--job", choices=sorted(JOBS))
    parser.add_argument("--fake", type=Path, help="the GPU's traces.json.gz: run the jobs on a fake GPU against it")
    parser.add_argument("--fake-gpu", help="the fake GPU model (--fake: default NVIDIA H200; --job: run on it)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget", type=float, default=220.0, help="seconds within which every job ends")
    parser.add_argument("--only", default="", help="comma-separated jobs (default: all)")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    if unknown := sorted(set(only) - set(JOBS)):
        parser.error(f"unknown jobs {unknown}; known: {', '.join(JOBS)}")
    if args.job:
        if args.fake_gpu:  # before torch is imported, as a rank installs them: the simulated world of 1 and the GPU
            from pytest_gpumem.rankside import fakegpu, simulate

            if args.job.endswith("_w1"):
                simulate.install_world(simulate.World(0, 1))
            fakegpu.install(args.fake_gpu)
        run_job(args.job, fake=bool(args.fake_gpu))
    elif args.fake:
        table = fake(args.fake, only, args.fake_gpu or "NVIDIA H200")
        print(table, end="")
        if args.out:
            args.out.write_text(f"$ python benchmarks/allocator_replay.py --fake {args.fake.parent.name}/"
                                f"{args.fake.name} --out {args.out.name}\n{table}")
    elif args.record:
        record(args.record, args.budget, only)
    elif args.replay:
        table = replay(args.replay)
        print(table, end="")
        if args.out:  # with its commands, the paths by their names alone
            args.out.write_text(f"$ python3 benchmarks/allocator_replay.py --record OUT --budget {args.budget:.0f}"
                                f"  # on the GPU named below\n$ python benchmarks/allocator_replay.py --replay "
                                f"OUT/{args.replay.name} --out {args.out.name}\n{table}")
    else:
        parser.error("one of --record, --replay")


if __name__ == "__main__":
    main()
