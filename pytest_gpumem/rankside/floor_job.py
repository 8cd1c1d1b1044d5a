"""The floor of a rank's figure: what an empty job of the same framework costs at the same size.

A GPU figure includes the CUDA context (its size moves with the driver and CUDA versions), the
framework's start-up and, at N > 1, the communicator's buffers; none of that is the job's own.
Launched once per framework, launcher, device and world size, this probe does only that much,
measured the same way as the test, so a report can show floor and job apart and a reviewer sees
which part moved. Its figures are kept across sessions (``floor_cache``): a later session launches
no probe unless the machine, the driver, the framework, Python or the launch changed.

Run inside a rank: ``python -m pytest_gpumem.rankside.rank module pytest_gpumem.rankside.floor_job FRAMEWORK DEVICE``.
"""

from __future__ import annotations

import os
import sys

FRAMEWORKS = ("torch", "oneflow")
PROBE_VERSION = 1  # part of the floor cache's key: change it whenever what the probe does changes


def _torch(device: str, world: int) -> None:
    import torch

    if device == "gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        t = torch.zeros(1, device="cuda")  # the CUDA context
    else:
        t = torch.zeros(1)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device == "gpu" else "gloo")
        dist.all_reduce(t)  # the communicator is set up by the first collective
        dist.barrier()
        dist.destroy_process_group()
    if device == "gpu":
        torch.cuda.synchronize()


def _oneflow(device: str, world: int) -> None:
    import oneflow as flow

    placement = flow.placement("cuda" if device == "gpu" else "cpu", ranks=list(range(world)))
    t = flow.ones(1, placement=placement, sbp=flow.sbp.partial_sum)
    assert t.to_global(sbp=flow.sbp.broadcast).to_local().numpy()[0] == world  # P -> B: a collective


def main(argv: list[str]) -> None:
    framework, device = argv
    world = int(os.environ.get("WORLD_SIZE", "1"))
    {"torch": _torch, "oneflow": _oneflow}[framework](device, world)


if __name__ == "__main__":
    main(sys.argv[1:])
