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
