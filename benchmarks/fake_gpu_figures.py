"""The GPU tier's jobs and models from the hub (tests/jobs.py GPU_TIER, FOREIGN, HUB): the allocator figure
on a real GPU and on a fake one.

    python3 benchmarks/fake_gpu_figures.py --real --out real.json            # on a GPU machine
    .venv-torch/bin/python benchmarks/fake_gpu_figures.py --real-json real.json  # fake (an H200 unless --fake)
    python3 benchmarks/fake_gpu_figures.py --real --jobs hub --out hub_real.json   # HUB_JOBS only

Each job, variant (healthy, NO_SHARD, a 1% tensor kept alive) and world size runs in a process of
its own, as a rank does under the plugin: nproc=1 for real (real mode) and larger sizes as rank 0
of a simulated world (``rankside.simulate``; on a GPU, equal to real NCCL to the hundredth), or
every size on a fake GPU (``rankside.fakegpu``; without ``--real``). Each prints rank 0's
``max_memory_allocated``. The jobs' frameworks are looked for in ``.venv-torch/frameworks`` too.
With ``--real-json``, the table puts the two side by side. ``--calibrate`` also prints what
``gpumem calibrate`` measures here, or with ``--calibration FILE`` writes it there: a GPU without a
built-in model is then emulated with ``--fake "<its name>" --calibration FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the jobs, shared with the tests

import jobs  # noqa: E402

CASES = [  # (job, variant, env)
    ("fsdp1", "healthy", {}), ("fsdp1", "NO_SHARD", {"SHARDING": "NO_SHARD"}), ("fsdp1", "+1%", {"EXTRA_MIB": "78"}),
    ("fsdp2", "healthy", {}), ("fsdp2", "reshard_after_forward=False", {"SHARDING": "NO_SHARD"}),
    ("ddp", "healthy", {}), ("ddp", "+1%", {"EXTRA_MIB": "70"}), ("ddp_gather", "healthy", {}),
    # tests/jobs.py FOREIGN: transformers' models trained with torch's wrappers (jobs not written for this)
    ("gpt2_ddp", "healthy", {}), ("llama_fsdp2", "healthy", {}), ("bert_fsdp1", "healthy", {}),
    # tests/jobs.py HUB (issue 54): more of transformers' models, trained as their users train them
    *((job, "healthy", {}) for job in jobs.HUB_JOBS),
]
FOREIGN = {"gpt2_ddp", "llama_fsdp2", "bert_fsdp1"}
SETS = {"foreign": FOREIGN, "hub": set(jobs.HUB_JOBS)}  # --jobs foreign,hub: every model from the hub


def one(job: str, world: int, fake: str | None, calibration: str | None = None) -> None:
    """In the child: rank 0 of a world of ``world``, the job run as the plugin's rank would."""
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 3000))
    sys.path.insert(0, str(ROOT))
    if fake or world > 1:
        from pytest_gpumem.rankside import simulate

        os.environ[simulate.SIMULATE_ENV] = f"0/{world}"
        simulate.install_world(simulate.World(0, world))
    if fake:
        from pytest_gpumem.rankside import fakegpu

        fakegpu.install(fake, calibration)
    namespace: dict = {}
    source, name = ((jobs.FOREIGN, "foreign.py") if job in FOREIGN else (jobs.HUB, "hub.py") if job in jobs.HUB_JOBS
                    else (jobs.GPU_TIER, "gpu_tier.py"))
    exec(compile(source, name, "exec"), namespace)
    if os.environ.get("FIGURES_TRACE"):
        _trace()
    import torch

    if os.environ.get("FIGURES_SNAPSHOT"):  # the allocator's history, for a side-by-side of the blocks at the peak
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=100000)
    started = time.perf_counter()
    kept = namespace["JOBS"][job]()
    if os.environ.get("FIGURES_SNAPSHOT"):
        torch.cuda.memory._dump_snapshot(os.environ["FIGURES_SNAPSHOT"])

    print(json.dumps({"allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                      "seconds": time.perf_counter() - started, "kept": kept is not None}))


def _trace() -> None:
    """Print the allocator's figures after each encoder layer's forward and each optimizer step."""
    import torch

    def say(tag: str) -> None:
        print(f"trace {tag}: now {torch.cuda.memory_allocated() / 2**20:.2f} "
              f"peak {torch.cuda.max_memory_allocated() / 2**20:.2f}", flush=True)

    def after_forward(module, inputs, output) -> None:
        if type(module).__name__ in ("TransformerEncoderLayer", "MultiheadAttention", "Linear"):
            say(f"forward {type(module).__name__}")

    torch.nn.modules.module.register_module_forward_hook(after_forward)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *a: say("before step"))
    register_optimizer_step_post_hook(lambda *a: say("after step"))


WRITE_CALIBRATION = ("import sys; from pathlib import Path; from pytest_gpumem.calibrate import probe; "
                     "from pytest_gpumem.rankside.fakegpu.models import write_calibration; "
                     "found = probe(); write_calibration(Path(sys.argv[1]), found); print('calibrated:', found)")


def _frameworks() -> dict[str, str]:
    """PYTHONPATH with ``make venvs``' frameworks folder (transformers, beside the torch venv) where it exists."""
    frameworks = Path(sys.prefix) / "frameworks"
    if not frameworks.is_dir():
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(frameworks), os.environ.get("PYTHONPATH")]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="on this machine's GPU")
    parser.add_argument("--fake", metavar="MODEL", help="on a fake GPU of this model (without --real: NVIDIA H200)")
    parser.add_argument("--sizes", default="1,2,8")
    parser.add_argument("--jobs", default="", help="comma-separated job names or sets (foreign, hub; default: all)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("--real-json", type=Path, help="the --real run's JSON, to print side by side")
    parser.add_argument("--calibrate", action="store_true",
                        help="gpumem calibrate's probe first: printed, or written to --calibration")
    parser.add_argument("--calibration", metavar="FILE",
                        help="a gpumem-calibration.json: --calibrate writes this GPU's there, --fake reads its model")
    parser.add_argument("--blocking-wait", choices=("0", "1"), default="1",
                        help="TORCH_NCCL_BLOCKING_WAIT of a real run: 1 the plugin's default, 0 the job as run")
    parser.add_argument("--one", nargs=2, metavar=("JOB", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real and args.fake:
        parser.error("--real runs on this machine's GPU, --fake on a fake one: choose one")
    args.fake = None if args.real else args.fake or "NVIDIA H200"
    if args.one:
        one(args.one[0], int(args.one[1]), args.fake, args.calibration)
        return 0
    if args.calibrate and args.calibration:  # gpumem calibrate --out FILE, without the plugin's dependencies
        subprocess.run([sys.executable, "-c", WRITE_CALIBRATION, str(Path(args.calibration).resolve())], cwd=ROOT,
                       check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    elif args.calibrate:
        subprocess.run([sys.executable, "-m", "pytest_gpumem.cli", "calibrate", "--print"], cwd=ROOT, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    wanted = set().union(*(SETS.get(name, {name}) for name in filter(None, args.jobs.split(","))))
    figures = {}
    for job, variant, env in CASES:
        if wanted and job not in wanted:
            continue
        for world in map(int, args.sizes.split(",")):
            command = [sys.executable, __file__, "--one", job, str(world)]
            command += ["--fake", args.fake] if args.fake else ["--real"]
            command += ["--calibration", str(Path(args.calibration).resolve())] if args.calibration else []
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run(command, capture_output=True, text=True, cwd=tmp,
                                      env={**os.environ, **_frameworks(),
                                           "TORCH_NCCL_BLOCKING_WAIT": args.blocking_wait, **env,
                                           **(jobs.HUB_REAL_ENV.get(job, {}) if args.real else {})}, timeout=600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(f"{job} {variant} nproc={world}: failed\n{done.stderr[-3000:]}", flush=True)
                continue
            found = json.loads(lines[-1])
            figures[f"{job}|{variant}|{world}"] = found
            print(f"{job:10} {variant:28} nproc={world}: {found['allocated_mib']:10.2f} MiB "
                  f"({found['seconds']:.1f} s)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    if args.real_json:
        real = json.loads(args.real_json.read_text())
        print(f"\n{'job':10} {'variant':28} {'nproc':>5} {'real MiB':>10} {'fake MiB':>10} {'fake-real':>9}")
        for key, found in figures.items():
            job, variant, world = key.split("|")
            if key in real:
                r, f = real[key]["allocated_mib"], found["allocated_mib"]
                print(f"{job:10} {variant:28} {world:>5} {r:10.2f} {f:10.2f} {100 * (f - r) / r:+8.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
