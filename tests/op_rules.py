"""The fake GPU's shape rules against the CUDA build's kernels, on torch's own op database.

``torch.testing._internal.common_methods_invocations.op_db`` (shipped in the wheel) lists each op
with sample inputs. On a GPU (``--real``) each sample is run on CUDA and what the kernel accepted is
written with its outputs' shapes, dtypes and strides; here (a fake GPU) the same samples run on fake
CUDA tensors, and a sample CUDA accepted that the fake GPU refuses is a rule **stricter than CUDA**
(a team would meet it as a crash), one whose outputs differ is a **different** rule.
``tests/test_fake_gpu_rules.py`` runs it against the GPU's table committed in
``benchmarks/results/op_rules_gpu.json``.

    python3 tests/op_rules.py --real --out op_rules_gpu.json     # on a GPU
    python tests/op_rules.py --against op_rules_gpu.json          # here: the comparison, on one line

Samples are made on the CPU (same seed, same shapes on both sides) and moved to the device, so the
small integer ones (indices, sizes) carry their values onto the fake GPU as they do onto a real one.
A sample is keyed by op, dtype, index and its tensors' shapes: a key found on one side only (another
torch's op database) is not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
PER_OP = 6  # samples per op and dtype: the first ones (op_db's simplest and most common shapes)


def _meta(value: Any, torch: Any) -> Any:
    from torch.utils._pytree import tree_leaves

    return [[list(t.shape), str(t.dtype).removeprefix("torch."), list(t.stride())]
            for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _key(op: Any, dtype: str, index: int, sample: Any, torch: Any) -> str:
    from torch.utils._pytree import tree_leaves

    shapes = [tuple(t.shape) for t in tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor)]
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    return f"{name}|{dtype}|{index}|{shapes}"


def samples(torch: Any, only: set[str], stride: int, offset: int) -> Any:
    """(key, op, sample) for every op of op_db that CUDA supports in each dtype (every ``stride``-th op
    from ``offset``, or those named)."""
    from torch.testing._internal.common_methods_invocations import op_db

    for position, op in enumerate(op_db):
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if only and op.name not in only and name not in only:
            continue
        if not only and position % stride != offset:
            continue
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            try:
                if dtype not in op.supported_dtypes("cuda"):
                    continue
                torch.manual_seed(0)
                made = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:PER_OP]
            except Exception:  # noqa: BLE001 - op_db's own sample maker failed on this build: not compared
                continue
            for index, sample in enumerate(made):
                yield _key(op, dtype_name, index, sample, torch), op, sample


def _on_cuda(sample: Any, torch: Any) -> Any:
    return sample.transform(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t)


def run(torch: Any, only: set[str], stride: int, offset: int) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, op, on_cpu in samples(torch, only, stride, offset):
        try:
            sample = _on_cuda(on_cpu, torch)  # a sparse sample's move is the device's answer too
            out = op(sample.input, *sample.args, **sample.kwargs)
            table[key] = {"ok": True, "out": _meta(out, torch)}
        except Exception as exc:  # noqa: BLE001 - what refused it, in one line
            text = str(exc).strip().splitlines()
            table[key] = {"ok": False, "error": f"{type(exc).__name__}: {text[0][:200] if text else ''}"}
    return table


COMPARISON = "comparison: "  # the line that carries --against's result
DATA_DEPENDENT = "a fake tensor has no values"  # the fake GPU's word for an op it cannot size without values


def compare(gpu: dict[str, Any], fake: dict[str, Any]) -> dict[str, list[str]]:
    """Each sample CUDA accepted, as the fake GPU answered it: stricter (refused), different (other
    output shapes or dtypes), strides (the same bytes, laid out otherwise), data-dependent (named: the
    fake GPU's documented limit), same."""
    found: dict[str, list[str]] = {"stricter": [], "different": [], "strides": [], "data_dependent": [], "same": []}
    # op_db makes some samples by iterating over a set of strings (meshgrid's indexing): their order
    # follows each process's string hashing, so a sample may sit at another index with the same shapes
    alike: dict[str, list[Any]] = {}
    refused = {_without_index(key) for key, real in gpu.items() if not real["ok"]}
    for key, real in gpu.items():
        if real["ok"]:
            alike.setdefault(_without_index(key), []).append(real["out"])
    for key, real in gpu.items():
        mine = fake.get(key)
        if mine is None or not real["ok"]:
            continue
        if not mine["ok"] and _without_index(key) in refused:
            continue  # CUDA refused a sample of these shapes too: perhaps this one
        if not mine["ok"]:
            kind = "data_dependent" if DATA_DEPENDENT in mine["error"] else "stricter"
            found[kind].append(f"{key}: {mine['error']}")
        elif all([m[:2] for m in mine["out"]] != [r[:2] for r in out] for out in alike[_without_index(key)]):
            found["different"].append(f"{key}: gpu {real['out']} fake {mine['out']}")
        elif mine["out"] not in alike[_without_index(key)]:  # same shapes and dtypes, other strides: the same bytes
            found["strides"].append(f"{key}: gpu {real['out']} fake {mine['out']}")
        else:
            found["same"].append(key)
    return found


def _without_index(key: str) -> str:
    name, dtype, _, shapes = key.split("|", 3)
    return f"{name}|{dtype}|{shapes}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="on this machine's GPU (else a fake one)")
    parser.add_argument("--only", default="", help="comma-separated op names")
    parser.add_argument("--stride", type=int, default=1, help="every N-th op of op_db (a sample of the database)")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--against", type=Path, help="the GPU's table: print the comparison")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if not args.real:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        from pytest_gpumem.rankside import fakegpu, simulate

        simulate.install_world(simulate.World(0, 1))
        fakegpu.install("NVIDIA H200")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    started = time.perf_counter()
    table = run(torch, {n for n in args.only.split(",") if n}, args.stride, args.offset)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "fake": not args.real,
           "seconds": round(time.perf_counter() - started, 1), "samples": table}
    if args.out:
        args.out.write_text(json.dumps(doc, sort_keys=True) + "\n")
    if args.against:
        found = compare(json.loads(args.against.read_text())["samples"], table)
        summary = {kind: (lines if kind not in ("same", "strides") else len(lines)) for kind, lines in found.items()}
        print(COMPARISON + json.dumps(summary))  # one line: what an op printed stays apart
    print(f"{len(table)} samples in {doc['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
