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


def run(body: str) -> dict:
    """The last JSON line ``body`` printed, run after the prelude in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=300)
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
