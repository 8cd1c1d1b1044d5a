"""Job sources shared by the launch tests (local launchers and srun): real frameworks, 150 MiB of
activations per rank, and an inflating variant that keeps the global batch on every rank."""

TORCH_DDP = '''
import os
import pytest
import torch
import torch.distributed as dist

MiB = 1024 * 1024


def step(world_keeps_global_batch):
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    local = torch.ones(150 * MiB // 4)                   # 150 MiB of activations per rank
    if world_keeps_global_batch:                          # the bug: every rank gathers every batch
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        kept = torch.cat(parts)
        assert kept.numel() == world * local.numel()
    grad = torch.ones(1024)
    dist.all_reduce(grad)
    assert grad[0].item() == world
    dist.destroy_process_group()
'''


ONEFLOW_WORKLOAD = '''
import os
import pytest
import oneflow as flow

MiB = 1024 * 1024


def step(every_rank_keeps_global_batch):
    world = flow.env.get_world_size()
    placement = flow.placement("cpu", ranks=list(range(world)))
    rows = 150 * MiB // 4 // 1024                          # 150 MiB of activations per rank
    batch = flow.ones(rows * world, 1024, placement=placement, sbp=flow.sbp.split(0))
    if every_rank_keeps_global_batch:                     # the bug: S(0) -> B boxing
        batch = batch.to_global(sbp=flow.sbp.broadcast)
    total = batch.sum().to_global(sbp=flow.sbp.broadcast).to_local().numpy()
    assert abs(total - rows * world * 1024) < 1e-3 * total
'''


# torch jobs a simulated world is checked with (test_simulate.py, benchmarks/simulate_validation.py):
# DDP, FSDP2 (fully_shard per layer and on the model; it runs on CPU with gloo) and the twin of the
# DDP job that keeps every rank's 16 MiB activation through training (grows with the world).
TORCH_SIMULATE = '''
import pytest
import torch
import torch.distributed as dist

MiB = 1024 * 1024


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])


def train(net, steps=3):
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(steps):
        net(torch.ones(64, 1024)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def ddp(gather=False):
    dist.init_process_group("gloo")
    local = torch.ones(16 * MiB // 4)                 # this rank's activation
    kept = []
    if gather:                                              # the regression: every rank keeps every rank's
        kept = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(kept, local)
    train(torch.nn.parallel.DistributedDataParallel(model()))
    assert len(kept) == (dist.get_world_size() if gather else 0)
    dist.destroy_process_group()


def fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model()
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    train(net)
    dist.destroy_process_group()


JOBS = {"ddp": ddp, "fsdp2": fsdp2, "twin": lambda: ddp(gather=True)}
'''


# The GPU tier's jobs (tests/test_gpu.py) as one module, for the fake GPU (tests/test_fake_gpu.py,
# benchmarks/fake_gpu_figures.py): each is a function of the world the rank is in, written for CUDA
# as a user writes it (set_device, init_process_group("nccl"), .cuda()). EXTRA_MIB keeps one more
# tensor alive (the 1% regression); SHARDING switches FULL_SHARD to NO_SHARD (declared config).
GPU_TIER = '''
import os

import torch
import torch.distributed as dist

MiB = 2**20


def _start():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")


def _extra():
    extra = float(os.environ.get("EXTRA_MIB", "0"))
    return torch.empty(int(extra * MiB), dtype=torch.uint8, device="cuda") if extra else None


def _train(model, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, 2048, device="cuda")
    kept = _extra()
    for _ in range(steps):
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return kept


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 8)


def fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    _start()
    sharding = getattr(ShardingStrategy, os.environ.get("SHARDING", "FULL_SHARD"))
    model = FSDP(_encoder().cuda(), device_id=torch.cuda.current_device(), sharding_strategy=sharding)
    kept = _train(model)
    dist.destroy_process_group()
    return kept


def fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _start()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = _encoder().cuda()
    reshard = os.environ.get("SHARDING", "FULL_SHARD") != "NO_SHARD"  # NO_SHARD's twin: keep it unsharded
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    kept = _train(model)
    dist.destroy_process_group()
    return kept


def ddp(gather=False):
    _start()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda())
    x = torch.randn(65536, 4096, device="cuda")  # 1 GiB of batch per rank
    kept = _extra()
    if gather:  # the bug: every rank keeps every rank's batch
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        x = torch.cat(parts)
    for _ in range(3):
        model(x).sum().backward()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return kept


JOBS = {"fsdp1": fsdp1, "fsdp2": fsdp2, "ddp": ddp, "ddp_gather": lambda: ddp(gather=True)}
'''
