"""``gpumem calibrate``: record this machine's GPU model for the fake GPU, once, on the real GPU.

A fake GPU counts the job's tensors as the caching allocator does; what the model's libraries take
through the same allocator is measured here and stored beside the baselines
(``gpumem-calibration.json``), so that the CPU gate and the nightly GPU run agree:

- the device properties torch reports (name, compute capability, memory, multiprocessors);
- cuBLAS's workspace, taken by the first matrix product on each thread (a job's forward runs on its
  own thread, its backward on the autograd engine's);
- cuBLASLt's, taken by the first matrix product with a bias on each thread.

Each figure is the growth of ``torch.cuda.memory_allocated`` over the op, less the op's output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Callable

from .rankside.fakegpu.models import CALIBRATION_FILE, GpuModel, write_calibration


def probe() -> GpuModel:
    """The GPU model of device 0, measured (needs torch with CUDA and a GPU)."""
    import threading

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpumem calibrate: torch sees no GPU here (torch.cuda.is_available() is False): run it "
                         "on the GPU whose model the fake GPU is to emulate")
    torch.cuda.set_device(0)
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
        cublaslt_workspace=max(found["cublaslt"], 0), source=CALIBRATION_FILE,
        measured_with={"torch": torch.__version__, "cuda": str(torch.version.cuda or ""),
                       "date": datetime.date.today().isoformat()})


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
                      "measured_with": dict(found.measured_with)}, indent=2))
    if args.only_print:
        return 0
    out = args.out if args.out is not None else baselines() / CALIBRATION_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    write_calibration(out, found)
    print(f"gpumem calibrate: {found.name} written to {out}", file=sys.stderr)
    return 0
