"""What a fake-GPU size costs, and where its time goes, before and after the warm fork server (issue 64).

    .venv-torch/bin/python benchmarks/fake_size_cost.py --out benchmarks/results/fake_size_cost.txt

All in one run, side by side on the same machine (the figures are disturbed alike by whatever else runs):

1. The unit: importing torch and ``transformers`` (and ``LlamaForCausalLM``) in a fresh interpreter,
   what every exec'd rank paid at every size. Median of ``--unit-runs``, and again just before and
   after each session: a session's sizes are divided by the unit taken beside them (the load of a
   shared machine changes over a run; each row prints its 5-minute load average).
2. The breakdown of one exec'd rank's size, in a fresh interpreter that does what a rank does
   (``rankside.simulate``, ``rankside.fakegpu``, then the job): interpreter, imports of the rank code
   and pytest, the fake GPU's set-up with torch's import, ``transformers``, the model's construction,
   the job's ops under fake dispatch. The ops' time is then split by a profile of a second pass
   (fake dispatch, value tracking, the fake allocator's counting, the allocator history for peak sites).
   For a tiny model (2 layers, 128 wide) and the issue's LM (a Llama of 134M parameters, FSDP2, bf16
   mixed precision, 2 micro-batches accumulated, clipping, 2 steps). After: the same for one rank forked
   as the fake GPU's warm server forks it (the warm-up once, then fork, rank code, model, ops).
3. Whole sessions, ``pytest --gpumem`` in a project of its own: each job as one test of nproc=[1, 2, 8]
   with ``--gpumem-start=exec`` (before: every rank exec'd) and by default (after: forked from the
   warm server); a size's cost is the report's ``duration_s`` (launch to every rank reaped).
   Then a suite of 20 tiny tests x 3 sizes by default, and the same tests under plain ``pytest``
   (the bodies run once in pytest, on the CPU): the cost of ``--gpumem`` over it.

Goals (against the unit): a tiny size <= 0.5, the LM's size <= 2, the suite under 180 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ROOT / ".venv-torch" / "frameworks"

JOBS = '''
import os

import torch
import torch.distributed as dist

WORLD = "WORLD_SIZE" in os.environ  # plain pytest runs the body once, on the CPU, with no world


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def start():
    if WORLD and not dist.is_initialized():
        if device() == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device() == "cuda" else "gloo")


def end():
    if WORLD:
        dist.destroy_process_group()


def tiny(kind="ddp", width=128, layers=2, steps=2):
    """A tiny model (2 layers, 128 wide), trained as DDP, FSDP2 or alone."""
    start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device())
    if WORLD and kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif WORLD and kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(16, width, device=device())).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    end()


def build_lm():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    with torch.device(device()):
        return LlamaForCausalLM(config)


def train_lm(model, steps=2, accumulate=2, batch=2, seq=512):
    """FSDP2, bf16 mixed precision, grad accumulation, clipping: the issue's LM, 2 steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if WORLD:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        for _ in range(accumulate):
            ids = torch.randint(0, 32000, (batch, seq), device=device())
            (model(input_ids=ids, labels=ids).loss / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def lm():
    start()
    train_lm(build_lm())
    end()
'''

TEST = '''
import pytest
from fake_jobs import {function}


@pytest.mark.gpumem(nproc=[1, 2, 8], device="gpu")
def test_{name}():
    {function}({args})
'''

SUITE_KINDS = ("ddp", "fsdp2", "alone", "ddp")  # 20 tests: 5 of each, widths varied

# One exec'd rank's size, in a fresh interpreter (rank.main's order: the simulated world, the fake GPU,
# then the job's imports); each phase timed, then the ops again under a profile.
PHASES = '''
import time
t0 = time.perf_counter()
import cProfile, importlib, json, os, pstats, sys
import pytest
from pytest_gpumem.rankside import fakegpu, rank, rank_plugin, simulate
from pytest_gpumem.rankside.gpu_allocator import TorchAllocator
t1 = time.perf_counter()
simulate.install_world(simulate.world())
fakegpu.install("NVIDIA H200")
watch = TorchAllocator(history=True, root=None)
watch.install()
import torch
t2 = time.perf_counter()
import fake_jobs
job = sys.argv[1]
if job == "lm":
    import transformers
    from transformers import LlamaForCausalLM
t3 = time.perf_counter()
fake_jobs.start()
model = fake_jobs.build_lm() if job == "lm" else None
t4 = time.perf_counter()
run = (lambda: fake_jobs.train_lm(model)) if job == "lm" else (lambda: fake_jobs.tiny(steps=2))
run()
t5 = time.perf_counter()
profile = cProfile.Profile()
model = fake_jobs.build_lm() if job == "lm" else None
profile.enable()
run()
profile.disable()
stats = pstats.Stats(profile).stats
parts = {"values": 0.0, "accounting": 0.0, "history": 0.0, "dispatch": 0.0, "total": 0.0}
for (path, _, _), (_, _, tottime, _, _) in stats.items():
    parts["total"] += tottime
    for part, files in (("values", ("fakegpu/values.py",)), ("accounting", ("fakegpu/accounting.py",)),
                        ("history", ("gpu_allocator.py", "torch_history.py")),
                        ("dispatch", ("fakegpu/dispatch.py", "fakegpu/rules.py", "fakegpu/mends/",
                                      "_subclasses/fake_tensor.py", "_subclasses/fake_impls.py"))):
        if any(f in path for f in files):
            parts[part] += tottime
print(json.dumps({"rank code and pytest": t1 - t0, "torch with the fake GPU": t2 - t1,
                  "transformers": t3 - t2, "model": t4 - t3, "ops": t5 - t4,
                  "shares": {k: v / parts["total"] for k, v in parts.items() if k != "total"}}))
'''


# One served rank's size: a process loads what the fake GPU's server loads (fork_server.WARM, the fake GPU),
# then forks a child that does what a served rank does (the simulated world, the project's modules
# afresh, then the job); each phase timed in the child, the warm-up once in the parent.
AFTER = '''
import time
t0 = time.perf_counter()
import importlib, json, os, sys
from pytest_gpumem.launching.fork_server import WARM
from pytest_gpumem.rankside import fakegpu
fakegpu.install("NVIDIA H200")
for name in WARM:
    importlib.import_module(name)
t1 = time.perf_counter()
job = sys.argv[1]
pid = os.fork()
if pid == 0:
    c0 = time.perf_counter()
    from pytest_gpumem.rankside import simulate
    from pytest_gpumem.rankside.gpu_allocator import TorchAllocator
    simulate.install_world(simulate.world())
    watch = TorchAllocator(history=True, root=None)
    watch.install()
    import fake_jobs
    c1 = time.perf_counter()
    if job == "lm":
        from transformers import LlamaForCausalLM
    c2 = time.perf_counter()
    fake_jobs.start()
    model = fake_jobs.build_lm() if job == "lm" else None
    c3 = time.perf_counter()
    fake_jobs.train_lm(model) if job == "lm" else fake_jobs.tiny(steps=2)
    c4 = time.perf_counter()
    print(json.dumps({"fork": c0 - t1, "rank code": c1 - c0, "transformers": c2 - c1, "model": c3 - c2,
                      "ops": c4 - c3}), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"warm-up, once a session": t1 - t0}))
'''


def python(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{args} ended {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start, done.stdout


def environment(project: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(FRAMEWORKS), str(ROOT)]),
            "GPUMEM_FAKE_GPU": "on"}


def unit(project: Path, runs: int) -> list[float]:
    code = "import torch, transformers; from transformers import LlamaForCausalLM"
    return [python("-c", code, cwd=project, env=environment(project))[0] for _ in range(runs)]


def breakdown(project: Path, job: str) -> dict:
    env = {**environment(project), "GPUMEM_SIMULATED_RANK": "0/1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "OMP_NUM_THREADS": "1"}
    bare, _ = python("-c", "pass", cwd=project, env=env)
    _, out = python("-c", PHASES, job, cwd=project, env=env)
    return {"interpreter": bare, **json.loads(out.strip().splitlines()[-1])}


def served_breakdown(project: Path, job: str) -> dict:
    env = {**environment(project), "GPUMEM_SIMULATED_RANK": "0/1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29518", "OMP_NUM_THREADS": "1"}
    _, out = python("-c", AFTER, job, cwd=project, env=env)
    found: dict = {}
    for line in out.strip().splitlines()[-2:]:
        found.update(json.loads(line))
    return found


def session(project: Path, tests: list[str], *args: str) -> tuple[float, dict[str, dict[int, dict]]]:
    """(the pytest command's seconds, each test's sizes from the report)."""
    report = project / "report.json"
    report.unlink(missing_ok=True)
    seconds, out = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--gpumem",
                          "--gpumem-missing-baseline=ignore", f"--gpumem-report={report}", *args, *tests,
                          cwd=project, env=environment(project))
    if not report.exists():
        raise RuntimeError(out[-3000:])
    tests = json.loads(report.read_text())["tests"]
    found = {t["test"].split("::")[-1]: {s["nproc"]: s for s in t["sizes"]} for t in tests}
    failed = [t["test"] for t in tests if t["status"] != "passed"]
    if failed:
        raise RuntimeError(f"failed: {failed}\n{out[-3000:]}")
    return seconds, found


def write_project(project: Path) -> None:
    (project / "fake_jobs.py").write_text(JOBS)
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_tiny.py").write_text(TEST.format(function="tiny", name="tiny", args=""))
    (project / "test_lm.py").write_text(TEST.format(function="lm", name="lm", args=""))
    head = "\nimport pytest\nfrom fake_jobs import tiny\n"
    suite = "".join(TEST.format(function="tiny", name=f"{kind}_{i}", args=f'"{kind}", width={64 * (1 + i % 4)}')
                    .replace(head, "") for i in range(20) for kind in [SUITE_KINDS[i % 4]])
    (project / "test_suite.py").write_text(head + suite)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit-runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say("command: .venv-torch/bin/python benchmarks/fake_size_cost.py" + " ".join(["", *sys.argv[1:]]).replace(
        str(ROOT) + os.sep, "") + f" ({os.cpu_count()} cores, shared with other work: ratios are side by side)")
    with tempfile.TemporaryDirectory(prefix="fake-size-cost-") as tmp:
        project = Path(tmp)
        write_project(project)
        units = unit(project, args.unit_runs)
        u = statistics.median(units)
        say(f"unit: import torch + transformers (LlamaForCausalLM) in a fresh interpreter: median {u:.2f} s "
            f"of {', '.join(f'{x:.2f}' for x in units)}")
        say()
        say("before: one exec'd rank's size, phase by phase (a fresh interpreter doing what the rank does), s")
        phases = {job: breakdown(project, job) for job in ("tiny", "lm")}
        names = ["interpreter", "rank code and pytest", "torch with the fake GPU", "transformers", "model", "ops"]
        say(f"{'job':6}" + "".join(f"{n:>26}" for n in names))
        for job, found in phases.items():
            say(f"{job:6}" + "".join(f"{found[n]:>26.2f}" for n in names))
        say()
        say("after: one served rank's size, phase by phase (a child forked from a process that loaded what the "
            "server loads), s")
        served = {job: served_breakdown(project, job) for job in ("tiny", "lm")}
        after = ["warm-up, once a session", "fork", "rank code", "transformers", "model", "ops"]
        say(f"{'job':6}" + "".join(f"{n:>26}" for n in after))
        for job, found in served.items():
            say(f"{job:6}" + "".join(f"{found[n]:>26.2f}" for n in after))
        say("(transformers: the job imports it inside its function, after collection, so the server has not)")
        for job, found in phases.items():
            say(f"{job}: the ops' profile: " + ", ".join(f"{k} {v:.0%}" for k, v in found["shares"].items())
                + " (the rest: torch's autograd and modules, the job's Python)")
        say()
        say("whole sessions, pytest --gpumem, one test of nproc=[1, 2, 8] each (every rank at 2, rank 0 alone at 1 "
            "and 8); a size: the report's duration_s, s")
        rows, loads = {}, {}
        for job in ("tiny", "lm"):
            for label, extra in (("exec (before)", ("--gpumem-start=exec",)), ("served (after)", ())):
                # the unit taken again just before and after the session: the ratio is to the unit under
                # the same load (the 2 cores are shared; the load changes over a run)
                around = unit(project, 1)
                wall, sizes = session(project, [f"test_{job}.py"], *extra)
                around += unit(project, 1)
                loads[(job, label)] = os.getloadavg()[1]
                rows[(job, label)] = (wall, {n: s["duration_s"] for n, s in sizes[f"test_{job}"].items()},
                                      {n: s["start"] for n, s in sizes[f"test_{job}"].items()},
                                      {n: s["simulated"] for n, s in sizes[f"test_{job}"].items()},
                                      statistics.mean(around))
        say(f"{'job':6}{'start':>16}{'pytest':>9}{'nproc=1':>9}{'nproc=2':>9}{'nproc=8':>9}{'unit then':>11}"
            f"{'later size / unit':>19}{'load':>6}  ranks run")
        for (job, label), (wall, durations, starts, ran, then) in rows.items():
            later = statistics.mean([durations[2], durations[8]])
            say(f"{job:6}{label:>16}{wall:>9.1f}" + "".join(f"{durations[n]:>9.2f}" for n in (1, 2, 8))
                + f"{then:>11.2f}{later / then:>19.2f}{loads[(job, label)]:>6.1f}  {ran} "
                + f"({'/'.join(sorted(set(starts.values())))})")
        say("(nproc=1 of the served rows includes starting the server: its imports, once a session; 'unit then': "
            "the unit's mean just before and after that session; load: the 5-minute load average after it, on 2 cores)")
        say()
        around = unit(project, 1)
        suite_wall, suite = session(project, ["test_suite.py"])
        sizes = [s for test in suite.values() for s in test.values()]
        plain, _ = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "test_suite.py",
                          cwd=project, env=environment(project))
        mean = statistics.mean(s["duration_s"] for s in sizes)
        say(f"suite: 20 tiny tests x 3 sizes, pytest --gpumem: {suite_wall:.1f} s ({len(sizes)} sizes, "
            f"{', '.join(sorted({s['start'] for s in sizes}))}; mean size {mean:.2f} s); "
            f"plain pytest of the same tests {plain:.1f} s: --gpumem costs {suite_wall - plain:.1f} s more, "
            f"{suite_wall / plain:.1f}x; load {os.getloadavg()[1]:.1f}; "
            f"the unit then {statistics.mean(around + unit(project, 1)):.2f} s")
        say()
        tiny, lm = rows[("tiny", "served (after)")], rows[("lm", "served (after)")]
        tiny_after = statistics.mean([tiny[1][n] for n in (2, 8)]) / tiny[4]
        lm_after = statistics.mean([lm[1][n] for n in (2, 8)]) / lm[4]
        for goal, value, limit in (("a tiny size <= 0.5 unit", tiny_after, 0.5),
                                   ("the LM's size <= 2 units", lm_after, 2.0),
                                   ("the suite < 180 s", suite_wall, 180.0)):
            say(f"goal {goal}: {value:.2f} {'met' if value <= limit else 'NOT met'}")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
