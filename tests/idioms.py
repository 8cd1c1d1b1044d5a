"""The everyday idioms of a CUDA training loop, each a small job, for the fake GPU's coverage matrix.

Each idiom is written as a team writes it for a real GPU (``.cuda()``, ``device="cuda"``, NCCL) and
is measured alone: the allocator's peak over the idiom, above what was live when it started
(``torch.cuda.max_memory_allocated`` after a reset, as a job reads it). The same module runs on a
real GPU (``--real``) and on a fake one; ``tests/test_fake_gpu_idioms.py`` compares the two against
the GPU figures committed in ``benchmarks/results/fake_gpu_idioms_gpu.json``.

    python tests/idioms.py --real --out idioms_gpu.json      # on a GPU (one process, NCCL world of 1)
    python tests/idioms.py --out idioms_fake.json            # here: a fake GPU, a simulated world of 1
    python tests/idioms.py --world 2 --rank 1 --out r1.json  # rank 1 of a simulated world of 2 (--real too)

A world above 1 is simulated on both sides (``rankside.simulate``: this rank with a stand-in group,
every collective's sizes kept), so each idiom's paths that exist only there run: SyncBatchNorm's
statistics gathering, DDP's buckets and their all-reduce, FSDP's sharding, the collectives' splits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

MiB = 2**20
IDIOMS: dict[str, Callable[[], Any]] = {}
# torch, imported by main() after the fake GPU is installed (it must come before torch): the idioms' globals
torch: Any = None
nn: Any = None
F: Any = None


def idiom(fn: Callable[[], Any]) -> Callable[[], Any]:
    IDIOMS[fn.__name__] = fn
    return fn


def _mlp(width: int = 1024, depth: int = 4) -> Any:
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _convnet(channels: int = 64) -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def _train(model: Any, make_input: Callable[[], Any], steps: int = 2, opt: Any = None,
           loss_fn: Callable[[Any], Any] | None = None) -> None:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        out = model(make_input())
        loss = loss_fn(out) if loss_fn else out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# -- module conversions after .cuda() ---------------------------------------------------------------

@idiom
def cuda_then_bfloat16() -> None:
    model = _mlp().cuda().bfloat16()
    _train(model, lambda: torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16))


@idiom
def cuda_then_half() -> None:
    model = _mlp().cuda().half()
    _train(model, lambda: torch.randn(256, 1024, device="cuda", dtype=torch.float16),
           opt=torch.optim.SGD(_params(model), lr=1e-3))


def _params(model: Any) -> Any:
    return list(model.parameters())


@idiom
def to_device_and_dtype() -> None:
    model = _mlp().to("cuda", dtype=torch.bfloat16)
    _train(model, lambda: torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16))


@idiom
def half_model_float_norm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.Linear(1024, 1024)).cuda().half()
    model[1].float()  # a norm kept in fp32, as mixed-precision recipes do
    x = torch.randn(256, 1024, device="cuda", dtype=torch.float16)
    out = model[2](model[1](model[0](x).float()).half())
    out.float().pow(2).mean().backward()


@idiom
def channels_last_convnet() -> None:
    model = _convnet().cuda().to(memory_format=torch.channels_last)
    _train(model, lambda: torch.randn(32, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last),
           opt=torch.optim.SGD(_params(model), lr=0.1, momentum=0.9))


@idiom
def buffers_moved_with_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1024, 1024)
            self.register_buffer("scale", torch.ones(1024))

        def forward(self, x: Any) -> Any:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Scaled().cuda()
    _train(model, lambda: torch.randn(256, 1024, device="cuda"))


# -- data to the GPU ---------------------------------------------------------------------------------

@idiom
def pinned_dataloader_non_blocking() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(512, 1024), torch.randint(0, 10, (512,)))
    loader = torch.utils.data.DataLoader(data, batch_size=128, pin_memory=True)
    model = nn.Linear(1024, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@idiom
def pin_memory_tensor_copy() -> None:
    host = torch.randn(4096, 1024).pin_memory()
    gpu = host.to("cuda", non_blocking=True)
    back = gpu.mul(2).to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert back.shape == host.shape


# -- values read for logging and control -------------------------------------------------------------

@idiom
def loss_item_for_logging() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    logged = []
    for _ in range(2):
        loss = model(torch.randn(256, 1024, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged.append(loss.item())
        if torch.isnan(loss):  # a loop's guard: a Python bool of a CUDA tensor
            raise RuntimeError("nan")
    assert len(logged) == 2


@idiom
def grad_scaler_fp16() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(256, 1024, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


@idiom
def autocast_bf16_clip_grad_norm() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.randn(256, 1024, device="cuda")).float().pow(2).mean()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    float(norm)  # logged


@idiom
def clip_grad_value() -> None:
    model = _mlp().cuda()
    model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
    nn.utils.clip_grad_value_(model.parameters(), 0.5)


# -- layers and losses --------------------------------------------------------------------------------

def _layer(module: Any, make_input: Callable[[], Any]) -> None:
    torch.manual_seed(0)
    module = module.cuda()
    _train(module, make_input, opt=torch.optim.SGD(_params(module), lr=1e-3),
           loss_fn=lambda out: (out[0] if isinstance(out, tuple) else out).float().pow(2).mean())


@idiom
def conv1d() -> None:
    _layer(nn.Sequential(nn.Conv1d(64, 128, 5, padding=2), nn.ReLU(), nn.Conv1d(128, 64, 5, padding=2)),
           lambda: torch.randn(16, 64, 4096, device="cuda"))


@idiom
def conv2d_nchw() -> None:
    _layer(_convnet(), lambda: torch.randn(32, 3, 64, 64, device="cuda"))


@idiom
def conv3d() -> None:
    _layer(nn.Sequential(nn.Conv3d(4, 32, 3, padding=1), nn.ReLU(), nn.Conv3d(32, 4, 3, padding=1)),
           lambda: torch.randn(4, 4, 32, 32, 32, device="cuda"))


@idiom
def conv_transpose2d() -> None:
    _layer(nn.Sequential(nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU()),
           lambda: torch.randn(16, 64, 32, 32, device="cuda"))


@idiom
def norms() -> None:
    _layer(nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.Linear(1024, 1024), nn.RMSNorm(1024)),
           lambda: torch.randn(512, 1024, device="cuda"))


@idiom
def group_and_instance_norm() -> None:
    _layer(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.InstanceNorm2d(64, affine=True)),
           lambda: torch.randn(16, 3, 64, 64, device="cuda"))


@idiom
def pooling() -> None:
    _layer(nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.MaxPool2d(2), nn.AvgPool2d(2),
                         nn.AdaptiveMaxPool2d(4), nn.Flatten(), nn.Linear(512, 10)),
           lambda: torch.randn(32, 3, 64, 64, device="cuda"))


@idiom
def embedding_bag() -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(100_000, 128, mode="mean").cuda()
    opt = torch.optim.SGD(bag.parameters(), lr=0.1)
    for _ in range(2):
        ids = torch.randint(0, 100_000, (4096,), device="cuda")
        offsets = torch.arange(0, 4096, 16, device="cuda")
        bag(ids, offsets).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@idiom
def embedding_cross_entropy_ignore_index() -> None:
    torch.manual_seed(0)
    emb, head = nn.Embedding(32000, 512).cuda(), nn.Linear(512, 32000).cuda()
    ids = torch.randint(0, 32000, (8, 256), device="cuda")
    labels = ids.clone()
    labels[:, :16] = -100
    logits = head(emb(ids))
    F.cross_entropy(logits.view(-1, 32000), labels.view(-1), ignore_index=-100).backward()


@idiom
def lstm() -> None:
    _layer(nn.LSTM(256, 512, num_layers=2, batch_first=True), lambda: torch.randn(16, 128, 256, device="cuda"))


@idiom
def gru() -> None:
    _layer(nn.GRU(256, 512, batch_first=True), lambda: torch.randn(16, 128, 256, device="cuda"))


@idiom
def rnn_tanh() -> None:
    _layer(nn.RNN(256, 512, batch_first=True), lambda: torch.randn(16, 128, 256, device="cuda"))


@idiom
def transformer_encoder_layer() -> None:
    _layer(nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 2),
           lambda: torch.randn(8, 256, 512, device="cuda"))


@idiom
def transformer_decoder() -> None:
    torch.manual_seed(0)
    model = nn.Transformer(256, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=1024,
                           batch_first=True).cuda()
    src, tgt = torch.randn(8, 128, 256, device="cuda"), torch.randn(8, 64, 256, device="cuda")
    mask = nn.Transformer.generate_square_subsequent_mask(64, device="cuda")
    model(src, tgt, tgt_mask=mask).pow(2).mean().backward()


@idiom
def multihead_attention() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(512, 8, batch_first=True).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    out, _ = mha(x, x, x, need_weights=False)
    out.pow(2).mean().backward()


@idiom
def losses() -> None:
    logits = torch.randn(4096, 100, device="cuda", requires_grad=True)
    target = torch.randint(0, 100, (4096,), device="cuda")
    total = (F.mse_loss(logits, torch.zeros_like(logits)) + F.smooth_l1_loss(logits, torch.ones_like(logits))
             + F.binary_cross_entropy_with_logits(logits, torch.rand_like(logits))
             + F.nll_loss(F.log_softmax(logits, -1), target)
             + F.kl_div(F.log_softmax(logits, -1), F.softmax(torch.randn_like(logits), -1), reduction="batchmean"))
    total.backward()


@idiom
def dropout_activations() -> None:
    _layer(nn.Sequential(nn.Linear(1024, 4096), nn.SiLU(), nn.Dropout(0.1), nn.Linear(4096, 1024), nn.Mish()),
           lambda: torch.randn(512, 1024, device="cuda"))


# -- optimizers and schedules -----------------------------------------------------------------------

def _optimizer(make: Callable[[Any], Any]) -> None:
    model = _mlp().cuda()
    opt = make(model.parameters())
    for _ in range(2):
        model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@idiom
def adamw_foreach() -> None:
    _optimizer(lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True))


@idiom
def adamw_fused() -> None:
    _optimizer(lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True))


@idiom
def adam_per_tensor() -> None:
    _optimizer(lambda p: torch.optim.Adam(p, lr=1e-4, foreach=False))


@idiom
def sgd_momentum_nesterov() -> None:
    _optimizer(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))


@idiom
def sgd_fused() -> None:
    _optimizer(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True))


@idiom
def other_optimizers() -> None:
    for make in (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Adamax,
                 torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop):
        _optimizer(lambda p, make=make: make(p, lr=1e-3))
        gc.collect()


@idiom
def lbfgs() -> None:
    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    x = torch.randn(256, 1024, device="cuda")

    def closure() -> Any:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)


@idiom
def lr_schedulers() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])
    for _ in range(3):
        model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@idiom
def gradient_accumulation() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for micro in range(4):
        (model(torch.randn(128, 1024, device="cuda")).pow(2).mean() / 4).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


@idiom
def ema_copy() -> None:
    import copy

    model = _mlp().cuda()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)


@idiom
def inference_mode_eval() -> None:
    model = _mlp().cuda().eval()
    with torch.inference_mode():
        model(torch.randn(4096, 1024, device="cuda"))
    with torch.no_grad():
        model(torch.randn(4096, 1024, device="cuda"))


# -- checkpointing and attention ----------------------------------------------------------------------

def _checkpointed(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                           for _ in range(4)).cuda()
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=reentrant)
    x.pow(2).mean().backward()


@idiom
def checkpoint_reentrant() -> None:
    _checkpointed(True)


@idiom
def checkpoint_non_reentrant() -> None:
    _checkpointed(False)


@idiom
def sdpa_flash_bf16() -> None:
    q, k, v = (torch.randn(4, 16, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).float().pow(2).mean().backward()


@idiom
def sdpa_with_mask_fp32() -> None:
    q, k, v = (torch.randn(4, 8, 512, 64, device="cuda", requires_grad=True) for _ in range(3))
    mask = torch.ones(512, 512, device="cuda", dtype=torch.bool).tril()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).pow(2).mean().backward()


@idiom
def flex_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    block = create_block_mask(causal, None, None, 1024, 1024, device="cuda")
    torch.compile(flex)(q, k, v, block_mask=block).float().pow(2).mean().backward()  # as its docs run it


# -- the allocator's own calls, made by the job ------------------------------------------------------

@idiom
def memory_calls_in_the_job() -> None:
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.set_per_process_memory_fraction(0.9)
    for _ in range(2):
        model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        assert stats["allocated_bytes.all.current"] > 0 and 0 < free <= total
        torch.cuda.memory_allocated()
        torch.cuda.empty_cache()


@idiom
def state_dict_save() -> None:
    model = _mlp().cuda()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert buffer.tell() > 0


# -- data-dependent sizes ------------------------------------------------------------------------------

@idiom
def moe_topk_router() -> None:
    """A torch-only top-2 router over 8 experts, dispatching with nonzero, bincount and .tolist()."""
    torch.manual_seed(0)
    experts, dim, tokens = 8, 512, 4096
    gate = nn.Linear(dim, experts, bias=False).cuda()
    ffn = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2048), nn.GELU(), nn.Linear(2048, dim))
                        for _ in range(experts)).cuda()
    x = torch.randn(tokens, dim, device="cuda", requires_grad=True)
    weights, chosen = torch.topk(gate(x).softmax(-1), 2, dim=-1)
    counts = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    out = torch.zeros_like(x)
    for e in range(experts):
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        if token.numel() == 0:
            continue
        out = out.index_add(0, token, ffn[e](x[token]) * weights[token, slot, None])
    assert sum(counts) == tokens * 2
    out.pow(2).mean().backward()


@idiom
def boolean_mask_select() -> None:
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    keep = x[:, 0] > 0
    picked = x[keep]
    also = torch.masked_select(x, x > 0)
    (picked.sum() + also.sum()).backward()


@idiom
def unique_and_sort() -> None:
    ids = torch.randint(0, 1000, (1 << 20,), device="cuda")
    values, counts = torch.unique(ids, return_counts=True)
    order = torch.argsort(ids)
    assert values.numel() <= 1000 and order.numel() == ids.numel()


# -- distributed ---------------------------------------------------------------------------------------

@idiom
def collectives() -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    x = torch.randn(16 * MiB // 4, device="cuda")
    dist.all_reduce(x)
    out = torch.empty(world * x.numel(), device="cuda")
    dist.all_gather_into_tensor(out, x)
    part = torch.empty(x.numel() // world, device="cuda")
    dist.reduce_scatter_tensor(part, x)
    dist.broadcast(x, 0)
    moved = torch.empty_like(x)
    dist.all_to_all_single(moved, x)
    dist.barrier()


@idiom
def object_collectives() -> None:
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, {"rank": dist.get_rank(), "loss": 1.5})
    box = [{"step": 3}]
    dist.broadcast_object_list(box, src=0)
    assert found[0]["rank"] == 0 and box[0]["step"] == 3


@idiom
def all_to_all_split_sizes() -> None:
    """Expert parallelism's exchange: split sizes from a count tensor, read with .tolist()."""
    import torch.distributed as dist

    world = dist.get_world_size()
    tokens = torch.randn(4096, 512, device="cuda")
    dest = torch.randint(0, world, (4096,), device="cuda")
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    out = tokens.new_empty(int(recv.sum().item()), 512)
    dist.all_to_all_single(out, tokens[torch.argsort(dest)], recv.tolist(), send.tolist())


def _ddp(model: Any, **kwargs: Any) -> Any:
    return nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()], **kwargs)


@idiom
def ddp_no_sync_accumulation() -> None:
    model = _ddp(_mlp().cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with model.no_sync():
        model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
    model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
    opt.step()


@idiom
def ddp_static_graph_bucket_view() -> None:
    model = _ddp(_mlp().cuda(), static_graph=True, gradient_as_bucket_view=True)
    _train(model, lambda: torch.randn(256, 1024, device="cuda"))


@idiom
def sync_batch_norm_ddp() -> None:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_convnet()).cuda()
    model = _ddp(model)
    _train(model, lambda: torch.randn(16, 3, 64, 64, device="cuda"),
           opt=torch.optim.SGD(model.parameters(), lr=0.1))


@idiom
def fsdp1_options() -> None:
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_mlp(), device_id=torch.cuda.current_device(), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 limit_all_gathers=True)
    _train(model, lambda: torch.randn(256, 1024, device="cuda"))


@idiom
def fsdp2_options() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = _mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.cuda()
    _train(model, lambda: torch.randn(256, 1024, device="cuda"))


# -- compiled ------------------------------------------------------------------------------------------

@idiom
def torch_compile() -> None:
    model = _mlp().cuda()
    compiled = torch.compile(model)
    _train(compiled, lambda: torch.randn(256, 1024, device="cuda"))


# -- the harness ---------------------------------------------------------------------------------------

def _route_as_the_fake_gpu_assumes() -> None:
    """On the GPU, top-k routing forced to what the fake GPU assumes (balanced: row t's j-th choice is
    (t*k + j) mod E), so that both figures are of the same routing; the weights are the scores there."""
    from pytest_gpumem.rankside.fakegpu.values import balanced_indices

    real_topk = torch.topk

    def topk(scores: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:  # noqa: A002
        dim = dim % scores.dim()
        shape = list(scores.shape)
        shape[dim] = k
        indices = balanced_indices(torch, tuple(shape), k, scores.shape[dim], dim).to(scores.device)
        return torch.return_types.topk((scores.gather(dim, indices), indices))

    topk.__wrapped__ = real_topk  # type: ignore[attr-defined]
    torch.topk = topk


def measure(names: list[str]) -> dict[str, Any]:
    """Each idiom's peak in a process of its own (forked before CUDA starts, as a rank starts): the
    allocator's peak from a new process's start, the libraries' workspaces included, or the error
    that stopped it."""
    out: dict[str, Any] = {}
    port = int(os.environ["MASTER_PORT"])
    for index, name in enumerate(names):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the idiom's process
            os.close(read)
            os.environ["MASTER_PORT"] = str(port + 1 + index)
            with os.fdopen(write, "w") as pipe:
                pipe.write(json.dumps(_one(name)))
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        _, status = os.waitpid(pid, 0)
        out[name] = json.loads(text) if text else {"error": f"its process died (wait status {status})"}
    return out


def _one(name: str) -> dict[str, Any]:
    import torch.distributed as dist

    started = time.perf_counter()
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        IDIOMS[name]()
        torch.cuda.synchronize()
        figure: dict[str, Any] = {"mib": round(torch.cuda.max_memory_allocated() / MiB, 2),
                                  "s": round(time.perf_counter() - started, 2)}
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the matrix lists what stopped
        if os.environ.get("IDIOMS_RAISE"):
            raise
        figure = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    if not torch.cuda.is_available() or "error" in figure:
        return figure
    from pytest_gpumem.rankside import fakegpu

    if fakegpu.active:
        figure["supplied"] = fakegpu.supplied()
    return figure


def main(argv: list[str] | None = None) -> int:
    global torch, nn, F
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="run on this machine's GPU (else a fake one)")
    parser.add_argument("--model", default=None, help="the GPU model the fake GPU emulates")
    parser.add_argument("--calibration", default=None, help="a gpumem-calibration.json for --model")
    parser.add_argument("--only", default="", help="comma-separated idiom names")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--world", type=int, default=1, help="the world's size (above 1: simulated, --real too)")
    parser.add_argument("--rank", type=int, default=0, help="this process's rank in --world")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world:
        parser.error(f"--rank {args.rank} is not a rank of a world of {args.world} (0 to {args.world - 1})")
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29531"),
                      GPUMEM_SIMULATE_ASSUME="alike")  # expert parallelism's split sizes: what this rank sends
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if not args.real or args.world > 1:
        from pytest_gpumem.rankside import simulate

        if args.world > 1:
            os.environ[simulate.SIMULATE_ENV] = f"{args.rank}/{args.world}"
        simulate.install_world(simulate.World(args.rank, args.world))
    if not args.real:
        from pytest_gpumem.rankside import fakegpu

        fakegpu.install(args.model or "NVIDIA H200", args.calibration)
    import torch as _torch

    torch, nn, F = _torch, _torch.nn, _torch.nn.functional
    if args.real:
        _route_as_the_fake_gpu_assumes()
    names = [n for n in args.only.split(",") if n] or list(IDIOMS)
    figures = measure(names)
    doc = {"device": torch.cuda.get_device_name(0), "fake": not args.real, "torch": torch.__version__,
           "world": args.world, "rank": args.rank,
           "idioms": {name: {k: v for k, v in figure.items() if k != "supplied"} for name, figure in figures.items()}}
    if not args.real:
        doc["supplied"] = [line for figure in figures.values() for line in figure.get("supplied", ())]
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for name, figure in figures.items():
        print(f"{name:40s} {figure.get('mib', figure.get('error'))}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
