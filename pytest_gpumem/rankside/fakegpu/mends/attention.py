"""``scaled_dot_product_attention`` picks its kernel in C++ for the device, and the CPU build
has no CUDA choice: it would take the math path, which holds the seq x seq weights. On fake CUDA
tensors the kernel the model would run is called instead (its meta kernel gives its outputs), on
the arguments as autocast hands them over (it is on autocast's lower-precision list)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..models import GpuModel
from .base import Context, Mend

SDPA_MATH, SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN = 0, 1, 2, 3  # torch's SDPBackend


def sdp_choice(torch: ModuleType, model: GpuModel, query: Any, key: Any, value: Any, attn_mask: Any,
               dropout: float, is_causal: bool, enable_gqa: bool) -> int:
    """The attention kernel torch's CUDA build picks on the model (``sdp_utils.cpp`` of torch 2.11,
    checked against an H100's choices: benchmarks/results/sdpa_choice_gpu.json): on sm90 and sm10x
    cuDNN's first (torch >= 2.9 with cuDNN >= 9.15), then flash, then memory-efficient, then math,
    each as far as shapes, strides, dtypes and the switches decide it.
    A mask whose last dimension is strided (T5's position bias, a permuted view) sends every call to
    the math path, which keeps the seq x seq weights."""
    backends = torch.backends.cuda
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return SDPA_MATH
    batch, heads, s_q, d_qk = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    same_dtype = query.dtype == key.dtype == value.dtype
    sm = (model.major, model.minor)
    grouped = (enable_gqa and key.shape[-3] == value.shape[-3] and key.shape[-3] > 0
               and heads % key.shape[-3] == 0)
    batches = key.shape[0] == batch and value.shape[0] == batch and s_q > 0 and s_k > 0
    shared = batches and (grouped or key.shape[-3] == heads == value.shape[-3])
    unit_mask = attn_mask is None or attn_mask.stride(-1) == 1  # every fused kernel's condition on a GPU
    unit = all(t.stride(-1) == 1 for t in (query, key, value))

    def cudnn() -> bool:
        deterministic = torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled()
        limit = 256 if sm[0] in (9, 10) else 128
        trained_mask = attn_mask is not None and attn_mask.requires_grad  # Swin's bias: cuDNN has no gradient for it
        return (backends.cudnn_sdp_enabled() and not deterministic and half and same_dtype and not trained_mask
                and (8, 0) <= sm <= (12, 1) and shared and unit_mask and (unit or d_qk == 1)
                and max(batch, heads) <= 65535 and d_qk <= limit and d_v <= limit and d_qk % 8 == 0
                and d_v % 8 == 0 and s_k != 1 and not (dropout and s_q == 1))

    def flash() -> bool:  # a head size off a multiple of 8 is padded to one (scaled_dot_product_attention)
        return (backends.flash_sdp_enabled() and attn_mask is None and half and same_dtype
                and (8, 0) <= sm <= (12, 1) and d_qk == key.shape[-1] == d_v and d_qk <= 256
                and not (is_causal and s_q != s_k) and shared and (unit or d_qk == 1))

    def efficient() -> bool:
        align = 8 if half else 4  # the GEMM alignment on sm80+, in elements
        return (backends.mem_efficient_sdp_enabled() and (5, 0) <= sm <= (12, 1) and same_dtype
                and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and d_qk == key.shape[-1] and d_qk % align == 0 and d_v % align == 0
                and all(t.storage_offset() % align == 0 for t in (query, key, value))
                and batches and key.shape[-3] == heads == value.shape[-3] and unit and unit_mask)

    order = (SDPA_CUDNN, SDPA_FLASH, SDPA_EFFICIENT) if sm[0] in (9, 10) else (SDPA_FLASH, SDPA_EFFICIENT)
    usable = {SDPA_CUDNN: cudnn, SDPA_FLASH: flash, SDPA_EFFICIENT: efficient}
    return next((kernel for kernel in order if usable[kernel]()), SDPA_MATH)



def _patch(torch: ModuleType, context: Context) -> None:
    model, fake_type = context.model, context.fake_type
    cuda_build = torch.version.cuda is not None
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    aten = torch.ops.aten

    def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                     dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                                     enable_gqa: bool = False) -> Any:
        as_given = (query, key, value, attn_mask)
        fake_cuda = isinstance(query, fake_type) and query.device.type == "cuda"
        if fake_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            query, key, value, attn_mask = (t.to(dtype) if t is not None and t.is_floating_point() else t
                                            for t in as_given)
        choice = (sdp_choice(torch, model, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
                  if fake_cuda else SDPA_MATH)
        if choice == SDPA_MATH:
            query, key, value, attn_mask = as_given
            if fake_cuda and cuda_build:  # the math kernel itself: the build's own choice would ask the driver.
                # The CPU build's path is kept: T5's figure read 10% lower through this call (not explained)
                return aten._scaled_dot_product_attention_math(  # noqa: SLF001
                    query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if choice == SDPA_FLASH:
            head = query.shape[-1]
            pad = -head % 8  # padded to a multiple of 8, the output cut back
            if pad:
                scale = head ** -0.5 if scale is None else scale
                query, key, value = (functional.pad(t, (0, pad)) for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention(  # noqa: SLF001
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :head] if pad else out
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill_(
                bias.logical_not(), float("-inf"))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if choice == SDPA_CUDNN:
            return aten._scaled_dot_product_cudnn_attention(  # noqa: SLF001
                query, key, value, bias, grad, dropout_p, is_causal, False, scale=scale)[0]
        if bias is not None:
            if bias.stride(-1) != 1 or any(stride % 8 for stride in bias.stride()[:-1]):
                # padded to a multiple of 8 and viewed back (sdpa's pad_bias): the copy is what backward keeps
                columns = bias.shape[-1]
                bias = functional.pad(bias, (0, 8 - columns % 8))[..., :columns]
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(  # noqa: SLF001
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = scaled_dot_product_attention


MEND: Mend = Mend(
    name="attention's kernel as the GPU picks it",
    needed_by='idioms sdpa_flash_bf16, sdpa_with_mask_fp32, multihead_attention, transformer_encoder_layer;'
              ' the transformers sweep',
    on_import=(("torch", _patch),),
)
