"""``gpumem calibrate``: record this machine's GPU model for the fake GPU, once, on the real GPU.

A fake GPU counts the job's tensors as the caching allocator does; what the model's libraries take
through the same allocator is measured here and stored beside the baselines
(``gpumem-calibration.json``), so that the CPU gate and the nightly GPU run agree:

- the device properties torch reports (name, compute capability, memory, multiprocessors);
- cuBLAS's workspace, taken by the first matrix product on each thread (a job's forward runs on its
  own thread, its backward on the autograd engine's);
- cuBLASLt's, taken by the first matrix product with a bias on each thread;
- what lives outside the allocator, part by part (``models.OUTSIDE``): the context, the kernels of
  cuBLAS, cuDNN and fused attention as the first call of each loads them, an NCCL communicator of one
  rank. A fake GPU adds the parts a job used to its reserved peak: the device figure, predicted.

A workspace is the growth of ``torch.cuda.memory_allocated`` over the op, less the op's output; a
part outside is the growth of NVML's figure for this process less ``torch.cuda.memory_reserved``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Callable

from .rankside.fakegpu.models import CALIBRATION_FILE, OUTSIDE, GpuModel, write_calibration


def probe() -> GpuModel:
    """The GPU model of device 0, measured (needs torch with CUDA and a GPU)."""
    import threading

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpumem calibrate: torch sees no GPU here (torch.cuda.is_available() is False): run it "
                         "on the GPU whose model the fake GPU is to emulate")
    torch.cuda.set_device(0)
    outside = _outside(torch)
    props = torch.cuda.get_device_properties(0)
    x = torch.randn(64, 64, device="cuda")
    bias = torch.randn(64, device="cuda")
    torch.cuda.synchronize()

    def held(op: Any) -> int:
        before = torch.cuda.memory_allocated()
        out = op()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()

    found: dict[str, int] = {}

    def on_a_thread() -> None:  # a thread of its own, as the autograd engine's is
        found["cublas"] = held(lambda: torch.mm(x, x))
        found["cublaslt"] = held(lambda: torch.addmm(bias, x, x))
        found["again"] = held(lambda: torch.mm(x, x))

    worker = threading.Thread(target=on_a_thread)
    worker.start()
    worker.join()
    if found["again"] != 0:
        raise SystemExit(f"gpumem calibrate: a second matrix product on the same thread took {found['again']} "
                         "more bytes: the workspaces are not what the fake GPU models")
    return GpuModel(
        name=props.name, major=props.major, minor=props.minor, total_memory=props.total_memory,
        multi_processor_count=props.multi_processor_count, cublas_workspace=max(found["cublas"], 0),
        cublaslt_workspace=max(found["cublaslt"], 0), outside=outside, source=CALIBRATION_FILE,
        measured_with={"torch": torch.__version__, "cuda": str(torch.version.cuda or ""),
                       "date": datetime.date.today().isoformat()})


def _outside(torch: Any) -> dict[str, int]:
    """Each part of ``OUTSIDE``: how much NVML's figure for this process, less what the allocator
    reserved, grew over the first use of what loads it (run in OUTSIDE's order, each on top of the last)."""
    import os

    import torch.distributed as dist
    import torch.nn.functional as F

    from .sampling.nvml import process_bytes

    index = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))

    def beyond() -> int:
        torch.cuda.synchronize()
        used = process_bytes(os.getpid(), _nvml_index(uuid, index))
        if used is None:
            raise SystemExit("gpumem calibrate: NVML gives no figure for this process (no nvidia-ml-py, or a "
                             "container without the host's pid namespace): run it where nvidia-smi lists it")
        return used - torch.cuda.memory_reserved()

    def step() -> None:  # torch's own kernels of a small training step: no matrix product, no library
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        weight = torch.ones(256, device="cuda", requires_grad=True)
        loss = F.cross_entropy(F.layer_norm(F.gelu(x * weight), (256,)).softmax(-1), torch.zeros(64, dtype=torch.long,
                                                                                               device="cuda"))
        loss.backward()
        torch.optim.AdamW([x, weight]).step()

    def gemm() -> None:
        linear = torch.nn.Linear(256, 256).cuda()
        linear(torch.randn(64, 256, device="cuda")).sum().backward()
        torch.mm(linear.weight, linear.weight).sum().item()

    def conv() -> None:
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16)).cuda()
        net(torch.randn(8, 3, 32, 32, device="cuda", requires_grad=True)).sum().backward()

    def attention() -> None:
        q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    def nccl() -> None:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", index))
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty_like(t), t)
        dist.reduce_scatter_tensor(torch.empty_like(t), t)
        dist.broadcast(t, 0)

    torch.zeros(1, device="cuda")
    last, parts = 0, {}
    for part, run in (("context", step), ("cublas", gemm), ("cudnn", conv), ("attention", attention),
                      ("nccl", nccl)):
        run()
        now = beyond()
        parts[part], last = max(now - last, 0), now
    if dist.is_initialized():
        dist.destroy_process_group()
    assert set(parts) == set(OUTSIDE)
    return parts


def _nvml_index(uuid: str, cuda_index: int) -> int:
    """NVML's index of the GPU torch calls ``cuda_index`` (they differ under CUDA_VISIBLE_DEVICES)."""
    from .sampling.nvml import visible_gpus

    for gpu in visible_gpus(env={}):
        if uuid and gpu.uuid.endswith(uuid.removeprefix("GPU-")):
            return gpu.index
    return cuda_index


def main(argv: list[str], baselines: Callable[[], Path]) -> int:
    """``baselines``: the folder pytest --gpumem keeps its baselines in here (asked only when needed)."""
    parser = argparse.ArgumentParser(prog="gpumem calibrate", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"the calibration file (default: {CALIBRATION_FILE} in the "
                                                 "baselines folder pytest --gpumem uses here)")
    parser.add_argument("--print", action="store_true", dest="only_print", help="print the figures, write nothing")
    args = parser.parse_args(argv)
    found = probe()
    print(json.dumps({"name": found.name, "major": found.major, "minor": found.minor,
                      "total_memory": found.total_memory, "multi_processor_count": found.multi_processor_count,
                      "cublas_workspace_mib": found.cublas_workspace / 2**20,
                      "cublaslt_workspace_mib": found.cublaslt_workspace / 2**20,
                      "outside_mib": {k: v / 2**20 for k, v in found.outside.items()},
                      "measured_with": dict(found.measured_with)}, indent=2))
    if args.only_print:
        return 0
    out = args.out if args.out is not None else baselines() / CALIBRATION_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    write_calibration(out, found)
    print(f"gpumem calibrate: {found.name} written to {out}", file=sys.stderr)
    return 0
