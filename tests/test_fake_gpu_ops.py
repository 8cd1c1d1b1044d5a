"""The fake GPU's corrections for jobs written by others (issue 34), each in a fresh rank-like process.

Each case is what a foreign job (tests/jobs.py FOREIGN: transformers' GPT-2, Llama, BERT) did that
the tier's jobs did not, and each failed on a fake GPU before its correction: ``torch.tensor`` of
data on a CUDA device (a cache's empty tensor), DTensor's random ops (torchtitan-style initialisation
of sharded parameters), FSDP1 moving a CPU module with ``device_id`` (tied weights too), and a rank
that never makes a CUDA tensor. The process is a real interpreter, as a rank is: the fake GPU
patches torch for the life of the process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.skipif(torch.cuda.is_available(),
                                                   reason="a real GPU here: the fake GPU is for machines without")]

ROOT = Path(__file__).resolve().parent.parent
PRELUDE = f'''
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
from pytest_gpumem.rankside import fakegpu, simulate
simulate.install_world(simulate.World(0, 2))
fakegpu.install("NVIDIA H200")
import torch
import torch.distributed as dist
'''


# A rank ends without the interpreter's finalisation (rankside.rank._exit_fast): a backward's graph is freed
# by autograd's CUDA thread after the caller has its gradients, and a thread that asks for the GIL during
# finalisation is ended from under a C++ frame (an abort, 1 exit in 8 here). These processes end alike.
EPILOGUE = "\nsys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n"


def run(body: str) -> dict:
    """The last JSON line ``body`` printed, run after the prelude in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + EPILOGUE], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def test_torch_tensor_of_data_on_cuda_is_a_fake_tensor_counted_as_one_block():
    found = run('''
        before = torch.cuda.memory_allocated()
        empty = torch.tensor([], dtype=torch.float32, device="cuda")  # transformers' cache, lazily
        values = torch.tensor([1.0, 2.0, 3.0], device="cuda")
        print(json.dumps({"types": [type(t).__name__ for t in (empty, values)], "devices": [str(values.device)],
                          "added": torch.cuda.memory_allocated() - before}))
    ''')
    assert found == {"types": ["FakeTensor", "FakeTensor"], "devices": ["cuda:0"], "added": 512}


def test_random_init_of_sharded_dtensors_runs_and_counts_each_rank_its_shard():
    found = run('''
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        mesh = init_device_mesh("cuda", (2,))
        weight = distribute_tensor(torch.empty(1024, 1024, device="cuda"), mesh, [Shard(0)])
        del_before = torch.cuda.memory_allocated()
        with torch.no_grad():
            weight.normal_(0.0, 0.02)  # DTensor's RNG tracker: its state compared across ranks
            weight.uniform_(-1, 1)
        print(json.dumps({"local": list(weight.to_local().shape), "fake": type(weight.to_local()).__name__,
                          "shard_mib": del_before / 2**20, "after_mib": torch.cuda.memory_allocated() / 2**20}))
    ''')
    assert found["local"] == [512, 1024] and found["fake"] == "FakeTensor"
    assert found["after_mib"] == found["shard_mib"]  # random fills in place: nothing kept


def test_fsdp1_moving_a_cpu_module_with_device_id_keeps_tied_weights_tied():
    found = run('''
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        embed = torch.nn.Embedding(1024, 512)
        head = torch.nn.Linear(512, 1024, bias=False)
        head.weight = embed.weight  # tied, as transformers ties input and output embeddings
        model = FSDP(torch.nn.Sequential(embed, head), device_id=torch.cuda.current_device(), use_orig_params=True)
        params = list(model.parameters())
        print(json.dumps({"devices": sorted({str(p.device) for p in params}), "count": len(params),
                          "allocated_mib": torch.cuda.memory_allocated() / 2**20}))
    ''')
    assert found["devices"] == ["cuda:0"] and found["count"] == 1
    # one 2 MiB weight, flat and padded, sharded over 2 ranks: 1 MiB kept by this rank (+ the unsharded
    # copy freed after init)
    assert 0.99 <= found["allocated_mib"] <= 1.01, found


def test_a_rank_that_never_makes_a_cuda_tensor_reads_not_initialised_and_what_waits_for_cuda_runs_first():
    """As on a real GPU: the plugin's allocator history waits for CUDA's init (``_lazy_call``) and
    starts before the first allocation; a rank that never gets there has no allocator figure."""
    found = run('''
        waited = []
        torch.cuda._lazy_call(lambda: waited.append(torch.cuda.memory_allocated()))
        first = torch.cuda.is_initialized()
        torch.ones(4).sum()  # CPU work only
        second = torch.cuda.is_initialized()
        torch.empty(1, device="cuda")
        print(json.dumps({"before": first, "cpu_only": second, "after": torch.cuda.is_initialized(),
                          "waited": waited}))
    ''')
    assert found == {"before": False, "cpu_only": False, "after": True, "waited": [0]}


def test_grouped_mm_in_float32_is_answered_by_its_cpu_kernel_and_listed():
    """transformers' mixture-of-experts layers route the experts through ``grouped_mm``, whose shape rule
    asks for bfloat16 while CUDA's kernel takes float32 too (it loops over the groups): every MoE model
    of transformers crashed on a fake GPU in fp32. The CPU kernel answers the shapes, the report lists it."""
    found = run('''
        torch.cuda.set_device(0)
        tokens = torch.randn(64, 32, device="cuda", requires_grad=True)
        experts = torch.randn(4, 32, 16, device="cuda", requires_grad=True)
        offsets = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
        out = torch.nn.functional.grouped_mm(tokens, experts, offs=offsets)
        out.pow(2).sum().backward()
        cpu = torch.nn.functional.grouped_mm(torch.zeros(64, 32), torch.zeros(4, 32, 16), offs=offsets.cpu())
        from pytest_gpumem.rankside import fakegpu
        print(json.dumps({"fake": [list(out.shape), list(out.stride()), str(out.dtype), type(out).__name__],
                          "cpu": [list(cpu.shape), list(cpu.stride()), str(cpu.dtype)],
                          "grads": [list(tokens.grad.shape), list(experts.grad.shape)],
                          "supplied": fakegpu.supplied()}))
    ''')
    assert found["fake"] == [*found["cpu"], "FakeTensor"]
    assert found["grads"] == [[64, 32], [4, 32, 16]]
    # forward and backward's two products; the job's line is in "<string>", which is no file: torch is named
    assert found["supplied"] == ["rule: aten::_grouped_mm answered by its CPU kernel on stand-in data (its shape "
                                 "rule refused it: Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and "
                                 "mat_b.dtype=torch.float32.) at torch (x3)"]


def test_an_op_its_cpu_kernel_refuses_too_is_the_jobs_own_error():
    """The CPU kernel answers for a rule stricter than CUDA, never for a job's mistake: mismatched
    contraction sizes raise the kernel's own error, as on a GPU."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent('''
        torch.cuda.set_device(0)
        offsets = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
        torch.nn.functional.grouped_mm(torch.randn(32, 24, device="cuda"), torch.randn(2, 32, 16, device="cuda"),
                                       offs=offsets)
    ''')], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and "contraction dimension of mat_a and mat_b must match" in last, last
    assert "failed while attempting to run meta" not in done.stderr  # fake mode's log of the refused rule, quieted


@pytest.mark.parametrize("rank", [0, 1])
def test_sync_batch_norm_under_ddp_runs_at_a_world_of_2_on_each_rank(rank: int):
    """SyncBatchNorm takes its CUDA statistics kernels only above a world of 1 (``batch_norm_stats``,
    ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt`` and backward's two), none of which has
    a shape rule in torch: a DDP vision job ran at nproc=1 and crashed at 2. Each rank of 2 runs, and
    what it holds is the activations, the statistics per channel and the gathered statistics."""
    prelude = PRELUDE.replace("World(0, 2)", f"World({rank}, 2)").replace('RANK="0"', f'RANK="{rank}"')
    body = prelude + textwrap.dedent('''
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU())
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda(),
                                                        device_ids=[0])
        for _ in range(2):
            out = net(torch.randn(8, 3, 64, 64, device="cuda"))
            out.float().pow(2).mean().backward()
        print(json.dumps({"shape": list(out.shape), "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                          "rank": dist.get_rank()}))
    ''') + EPILOGUE
    done = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert found["shape"] == [8, 64, 64, 64] and found["rank"] == rank
    activation_mib = 8 * 64 * 64 * 64 * 4 / 2**20  # 8 MiB: conv out, norm out, relu out, their grads
    assert 3 * activation_mib < found["peak_mib"] < 100, found


def test_routing_by_max_over_the_last_dim_without_keepdim_is_balanced():
    """PhiMoE's sparsemixer routes with ``scores.max(dim=-1)[1]``: the indices lose the routed dim, which
    the balanced routing took as present (an IndexError inside the fake GPU)."""
    found = run('''
        torch.cuda.set_device(0)
        hidden = torch.randn(8, 16384, device="cuda")  # past the float shadows' 64K elements: values unknown
        scores = torch.nn.Linear(16384, 4).cuda()(hidden)
        chosen = scores.max(dim=-1)[1]
        print(json.dumps({"shape": list(chosen.shape), "values": chosen.tolist()}))
    ''')
    assert found == {"shape": [8], "values": [0, 1, 2, 3, 0, 1, 2, 3]}


def test_the_accelerator_api_answers_with_the_fake_gpus_streams():
    """FSDP2 waits on ``torch.accelerator.current_stream()`` at the end of backward; the device guard's
    stream carried no device on a fake GPU, and the wait failed at random ("Unknown device: 96")."""
    found = run('''
        torch.cuda.set_device(0)
        stream = torch.accelerator.current_stream()
        event = torch.cuda.Event()
        event.record()
        stream.wait_event(event)
        torch.accelerator.synchronize()
        print(json.dumps({"same": stream is torch.cuda.current_stream(), "capturing": stream.is_capturing()}))
    ''')
    assert found == {"same": True, "capturing": False}
