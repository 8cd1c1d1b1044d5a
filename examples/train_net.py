#!/usr/bin/env python
"""A small data-parallel training entry point shaped like LiBai's tools/train_net.py (torch DDP, gloo, CPU).

    python examples/train_net.py --steps 3
    torchrun --standalone --nproc-per-node 2 examples/train_net.py --steps 3 --batch-size 256

World size and rank come from the launcher's env (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK);
without them the script runs as a world of one.
"""
import argparse
import os
import resource
import runpy

import torch
import torch.distributed as dist

DEFAULTS = dict(features=8192, hidden=256, classes=10, batch_size=512, lr=0.01)


def default_argument_parser():
    parser = argparse.ArgumentParser(description="Train a small MLP with data parallelism.")
    parser.add_argument("--config-file", default="", metavar="FILE",
                        help="Python file that may set features, hidden, classes, batch_size, lr")
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch size (overrides the config)")
    parser.add_argument("--gather-batch", action="store_true",
                        help="the bug of the inflating twin: every rank trains on the all-gathered global batch")
    return parser


def gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def setup(args):
    cfg = dict(DEFAULTS)
    if args.config_file:
        cfg.update((k, v) for k, v in runpy.run_path(args.config_file).items() if k in DEFAULTS)
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return cfg


def main(args):
    cfg = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(cfg["features"], cfg["hidden"]), torch.nn.ReLU(), torch.nn.Linear(cfg["hidden"], cfg["classes"])
    ))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(rank)  # each rank draws its own shard of the global batch
    for step in range(1, args.steps + 1):
        x = torch.randn(cfg["batch_size"], cfg["features"], generator=gen)
        y = torch.randint(0, cfg["classes"], (cfg["batch_size"],), generator=gen)
        if args.gather_batch:  # the bug: each rank holds world_size x its share
            x, y = gather(x), gather(y)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the loss averaged over the global batch, for the log
        if rank == 0:
            print(f"step {step}/{args.steps} world {world} loss {mean_loss.item() / world:.4f}", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"rank {rank}/{world} peak RSS {peak_mib:.0f} MiB", flush=True)
    dist.barrier()  # let every rank finish its gloo traffic before tearing the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(default_argument_parser().parse_args())
