"""Which attention kernel the CUDA build picks for the hub models' calls, why, and what each kernel
holds (issue 54: the fake GPU's kernel choice for ``scaled_dot_product_attention``).

One training step of ViT-B/16 and T5-small (tests/jobs.py HUB's shapes: bf16 autocast, 32 images,
16 x 512 tokens) records every ``scaled_dot_product_attention`` call: its arguments as the kernel sees
them (autocast's casts applied), ``torch._fused_sdp_choice``, and why each fused kernel refused. Then,
for each distinct call, the memory each kernel takes on the GPU: what the forward keeps (its output
and what it saves for backward) and the backward's peak above that, with the chosen kernel and each
kernel forced. And a grid of calls (dtypes, head sizes, masks and their strides, grouped heads,
causal, dropout, offsets) with the kernel the GPU chose for each, which tests/unit/rankside checks the
fake GPU's choice against.

    python3 benchmarks/gpu/sdpa_choice.py --out sdpa_choice_gpu.json

``--fake GPU_JSON`` measures the same calls on a fake GPU and prints them beside the GPU's:

    .venv-torch/bin/python benchmarks/gpu/sdpa_choice.py --fake benchmarks/results/sdpa_choice_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

if __name__ == "__main__" and "--fake" in sys.argv:  # before torch is imported: its CUDA is the fake GPU's
    from pytest_gpumem.rankside import fakegpu

    fakegpu.install("NVIDIA H200")

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable", -1: "error"}
FORCED = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
MiB = 1 << 20


def _spec(t: Any) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "requires_grad": t.requires_grad}


def _cast(args: list[Any]) -> list[Any]:
    """The arguments as autocast hands them to the kernel (scaled_dot_product_attention is on its
    lower-precision list: floating tensors cast, a boolean mask kept)."""
    if not torch.is_autocast_enabled("cuda"):
        return args
    dtype = torch.get_autocast_dtype("cuda")
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _reasons(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> dict[str, list[str]]:
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, causal, gqa)
    found = {}
    for name, check in (("flash", torch.backends.cuda.can_use_flash_attention),
                        ("efficient", torch.backends.cuda.can_use_efficient_attention),
                        ("cudnn", torch.backends.cuda.can_use_cudnn_attention)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = check(params, True)
        found[name] = ["ok"] if ok else [str(w.message)[:300] for w in caught]
    return found


CALLS: list[dict[str, Any]] = []


def _recording(original: Any) -> Any:
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        q, k, v, mask = _cast([query, key, value, attn_mask])
        choice = int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
        CALLS.append({"query": _spec(q), "key": _spec(k), "value": _spec(v), "mask": _spec(mask),
                      "dropout": dropout_p, "is_causal": is_causal, "enable_gqa": enable_gqa, "scale": scale,
                      "autocast": torch.is_autocast_enabled("cuda"), "choice": BACKENDS[choice],
                      "refusals": _reasons(q, k, v, mask, dropout_p, is_causal, enable_gqa)})
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
    return sdpa


def _vit() -> None:
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(num_labels=1000)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(pixel_values=torch.randn(32, 3, 224, 224, device="cuda"),
                     labels=torch.randint(0, 1000, (32,), device="cuda")).loss
    loss.backward()


def _t5() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=torch.randint(0, config.vocab_size, (16, 512), device="cuda"),
                     labels=torch.randint(0, config.vocab_size, (16, 128), device="cuda")).loss
    loss.backward()


def _tensor(spec: dict[str, Any] | None) -> Any:
    """A tensor of the call's shape, strides, dtype and grad requirement (a broadcast mask: its
    zero strides kept, as an expanded view)."""
    if spec is None:
        return None
    shape, stride = spec["shape"], spec["stride"]
    dtype = getattr(torch, spec["dtype"])
    base_shape = [1 if s == 0 else n for n, s in zip(shape, stride)]
    order = sorted(range(len(shape)), key=lambda i: -stride[i])
    base = torch.randn([base_shape[i] for i in order], device="cuda").to(dtype) if dtype != torch.bool else \
        torch.ones([base_shape[i] for i in order], device="cuda", dtype=torch.bool)
    base = base.permute([order.index(i) for i in range(len(shape))])
    leaf = base.detach().requires_grad_(spec["requires_grad"] and dtype.is_floating_point)
    return leaf.expand(shape) if shape != base_shape else leaf


def _measure(call: dict[str, Any], backend: str | None) -> dict[str, Any]:
    q, k, v, mask = (_tensor(call[n]) for n in ("query", "key", "value", "mask"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=call["dropout"],
                                                 is_causal=call["is_causal"], enable_gqa=call["enable_gqa"])
        else:
            with sdpa_kernel([FORCED[backend]]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=call["dropout"],
                                                     is_causal=call["is_causal"], enable_gqa=call["enable_gqa"])
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0][:200]}
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    forward_peak = torch.cuda.max_memory_allocated() - before
    grad = torch.randn_like(out)
    after_forward = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated() - after_forward
    return {"forward_kept_mib": round(kept / MiB, 3), "forward_peak_mib": round(forward_peak / MiB, 3),
            "backward_peak_mib": round(backward_peak / MiB, 3)}


def grid(device: str) -> dict[str, tuple[Any, ...]]:
    """Calls whose kernel the CUDA build decides by one condition each: name -> (query, key, value,
    mask, dropout, is_causal, enable_gqa), built on ``device`` (shapes and strides are what count)."""
    def t(*shape: int, dtype: Any = torch.bfloat16) -> Any:
        return torch.zeros(shape, dtype=dtype, device=device)

    f16, f32 = torch.float16, torch.float32
    q = t(2, 8, 128, 64)
    packed = t(2, 128, 3, 8, 64).permute(2, 0, 3, 1, 4)  # one projection's q, k, v, viewed apart
    cases: dict[str, tuple[Any, ...]] = {
        "bf16": (q, q, q, None, 0.0, False, False),
        "fp16": (t(2, 8, 128, 64, dtype=f16),) * 3 + (None, 0.0, False, False),
        "fp32": (t(2, 8, 128, 64, dtype=f32),) * 3 + (None, 0.0, False, False),
        "fp32_mask": (t(2, 8, 128, 64, dtype=f32),) * 3 + (t(128, 128, dtype=f32), 0.0, False, False),
        "bf16_mask": (q, q, q, t(128, 128), 0.0, False, False),
        "bf16_bool_mask": (q, q, q, t(128, 128, dtype=torch.bool), 0.0, False, False),
        "bf16_mask_broadcast": (q, q, q, t(1, 8, 128, 128), 0.0, False, False),
        "bf16_mask_strided": (q, q, q, t(1, 128, 128, 8).permute(0, 3, 1, 2), 0.0, False, False),
        "bf16_mask_fp32": (q, q, q, t(128, 128, dtype=f32), 0.0, False, False),
        "bf16_mask_requires_grad": (q, q, q, t(128, 128).requires_grad_(), 0.0, False, False),  # Swin's bias
        "bf16_mask_requires_grad_no_grad": (q, q, q, t(128, 128).requires_grad_(), 0.0, False, False),
        "fp32_mask_strided": (t(2, 8, 128, 64, dtype=f32),) * 3 + (t(1, 128, 128, 8, dtype=f32).permute(0, 3, 1, 2),
                                                                   0.0, False, False),
        "packed_qkv": (packed[0], packed[1], packed[2], None, 0.0, False, False),
        "transposed_last_dim": (t(2, 8, 64, 128).transpose(-1, -2), q, q, None, 0.0, False, False),
        "head_80": (t(2, 8, 128, 80),) * 3 + (None, 0.0, False, False),
        "head_96": (t(2, 8, 128, 96),) * 3 + (None, 0.0, False, False),
        "head_128": (t(2, 8, 128, 128),) * 3 + (None, 0.0, False, False),
        "head_160": (t(2, 8, 128, 160),) * 3 + (None, 0.0, False, False),
        "head_192_128": (t(2, 8, 128, 192), t(2, 8, 128, 192), t(2, 8, 128, 128), None, 0.0, False, False),
        "head_256": (t(2, 8, 128, 256),) * 3 + (None, 0.0, False, False),
        "head_130": (t(2, 8, 128, 130),) * 3 + (None, 0.0, False, False),
        "head_130_fp32": (t(2, 8, 128, 130, dtype=f32),) * 3 + (None, 0.0, False, False),
        "head_36_fp32": (t(2, 8, 128, 36, dtype=f32),) * 3 + (None, 0.0, False, False),
        "head_12": (t(2, 8, 128, 12),) * 3 + (None, 0.0, False, False),
        "gqa": (t(2, 16, 128, 64), t(2, 4, 128, 64), t(2, 4, 128, 64), None, 0.0, False, True),
        "gqa_mask": (t(2, 16, 128, 64), t(2, 4, 128, 64), t(2, 4, 128, 64), t(128, 128), 0.0, False, True),
        "gqa_fp32": (t(2, 16, 128, 64, dtype=f32), t(2, 4, 128, 64, dtype=f32), t(2, 4, 128, 64, dtype=f32),
                     None, 0.0, False, True),
        "causal": (q, q, q, None, 0.0, True, False),
        "causal_non_square": (t(2, 8, 64, 64), q, q, None, 0.0, True, False),
        "cross_lengths": (t(2, 8, 64, 64), q, q, None, 0.0, False, False),
        "key_length_1": (q, t(2, 8, 1, 64), t(2, 8, 1, 64), None, 0.0, False, False),
        "dropout_0.1": (q, q, q, None, 0.1, False, False),
        "dropout_0.125": (q, q, q, None, 0.125, False, False),
        "offset_query": (t(2 * 8 * 128 * 64 + 4)[4:].view(2, 8, 128, 64), q, q, None, 0.0, False, False),
        "three_dims": (t(16, 128, 64),) * 3 + (None, 0.0, False, False),
        "mixed_dtypes": (q, t(2, 8, 128, 64, dtype=f16), q, None, 0.0, False, False),
        "seq_1": (t(2, 8, 1, 64), q, q, None, 0.0, False, False),
    }
    return cases


def fake(gpu_json: str) -> None:
    """The GPU's calls measured on the fake GPU, its own choice and a fused kernel forced, beside the GPU's."""
    found = json.loads(open(gpu_json).read())
    # cuBLAS's workspace, held from the first product on (the GPU's calls came after the models' steps)
    torch.ones(8, 8, device="cuda").matmul(torch.ones(8, 8, device="cuda"))
    for name, calls in found["models"].items():
        for call in calls:
            print(name, call["query"]["shape"], "mask", call["mask"] and call["mask"]["stride"], "->", call["choice"])
            for kernel in ("chosen", "cudnn", "efficient"):  # the fused kernels whose scratch the fake GPU models
                gpu = call["memory"][kernel]
                if "error" in gpu or (kernel != "chosen" and kernel == call["choice"]):
                    continue
                with torch.autocast("cuda", enabled=False):
                    mine = _measure(call, None if kernel == "chosen" else kernel)
                print(f"    {kernel:9} gpu  {gpu}\n    {'':9} fake {mine}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="sdpa_choice_gpu.json")
    parser.add_argument("--fake", metavar="GPU_JSON", help="measure the GPU's calls on a fake GPU")
    args = parser.parse_args()
    if args.fake:
        fake(args.fake)
        return
    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(),
                             "capability": list(torch.cuda.get_device_capability()), "models": {}}
    found["grid"] = {}
    for name, (q, k, v, mask, dropout, causal, gqa) in grid("cuda").items():
        with torch.set_grad_enabled(not name.endswith("_no_grad")):
            found["grid"][name] = BACKENDS[int(torch._fused_sdp_choice(q, k, v, mask, dropout, causal,
                                                                        enable_gqa=gqa))]
    print("grid:", found["grid"])
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _recording(original)
    for name, step in (("vit", _vit), ("t5", _t5)):
        CALLS.clear()
        step()
        distinct: dict[str, dict[str, Any]] = {}
        for call in CALLS:
            key = json.dumps({n: call[n] for n in ("query", "key", "value", "mask", "dropout", "is_causal")},
                             sort_keys=True)
            distinct.setdefault(key, {**call, "count": 0})["count"] += 1
        found["models"][name] = list(distinct.values())
        torch.cuda.empty_cache()
    F.scaled_dot_product_attention = original
    for calls in found["models"].values():
        for call in calls:
            with torch.autocast("cuda", enabled=False):
                call["memory"] = {"chosen": _measure(call, None),
                                  **{name: _measure(call, name) for name in FORCED}}
    for name, calls in found["models"].items():
        for call in calls:
            print(name, call["count"], "x", call["query"]["shape"], call["query"]["dtype"],
                  "mask", call["mask"] and (call["mask"]["shape"], call["mask"]["dtype"], call["mask"]["stride"],
                                            call["mask"]["requires_grad"]),
                  "->", call["choice"])
            for kernel, why in call["refusals"].items():
                print("   ", kernel, "|".join(why)[:400])
            for kernel, figures in call["memory"].items():
                print("   ", f"{kernel:10}", figures)
    with open(args.out, "w") as out:
        json.dump(found, out, indent=1)
    print({k: found[k] for k in ("torch", "cuda", "cudnn", "device", "capability")})


if __name__ == "__main__":
    main()
