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


# What every CUDA job module below starts with: set_device + NCCL, and the EXTRA_MIB tensor.
_CUDA_JOB = '''
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
'''

# The GPU tier's jobs (tests/test_gpu.py) as one module, for the fake GPU (tests/test_fake_gpu.py,
# benchmarks/fake_gpu_figures.py): each is a function of the world the rank is in, written for CUDA
# as a user writes it (set_device, init_process_group("nccl"), .cuda()). EXTRA_MIB keeps one more
# tensor alive (the 1% regression); SHARDING switches FULL_SHARD to NO_SHARD (declared config).
GPU_TIER = _CUDA_JOB + '''

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

# Jobs written by others, as their users run them (issue 34): Hugging Face transformers' models, built
# from a config (no download), trained with torch's own wrappers the way their recipes do. Each
# returns what EXTRA_MIB kept alive; they run on a real GPU and on a fake one unchanged.
FOREIGN = _CUDA_JOB + '''
import itertools


def _steps(model, batches, steps=3, autocast=False, clip=None, log=False):
    """AdamW over ``steps`` batches: one batch (a dict) every step, or an iterator of them. As the
    recipes do when asked: the forward and loss under bf16 autocast, the gradients' norm clipped, the
    loss logged each step (``loss.item()``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = _extra()
    batches = itertools.repeat(batches) if isinstance(batches, dict) else batches
    for step, batch in zip(range(steps), batches):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    return kept


def _materialise(model, config):
    """A model built on meta and sharded, made real on the GPU and initialised as torchtitan does: each
    matrix (linear, embedding, experts, router) N(0, 0.02), each norm's weight 1, RoPE's frequencies
    the config's."""
    model.to_empty(device="cuda")
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                param.normal_(0.0, 0.02) if param.ndim > 1 else param.fill_(1.0)
        rotary = model.model.rotary_emb
        inv_freq, _ = type(rotary).compute_default_rope_parameters(config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)


def _fsdp2_on_meta(model_type, config):
    """torchtitan's way: built on meta, each block and the root fully_shard-ed with bf16 parameters and
    fp32 gradient reduction, then materialised on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    with torch.device("meta"):
        model = model_type(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    _materialise(model, config)
    return model


def gpt2_ddp():
    """GPT-2 small (124M) with DDP, as the transformers language-modelling example trains it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _start()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    ids = torch.randint(0, 50257, (4, 512), device="cuda")
    kept = _steps(model, {"input_ids": ids, "labels": ids})
    dist.destroy_process_group()
    return kept


def llama_fsdp2():
    """A Llama decoder trained torchtitan's way: built on meta, each block and the root fully_shard-ed
    with bf16 parameters and fp32 gradient reduction, then materialised on the GPU and initialised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _start()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
    model = _fsdp2_on_meta(LlamaForCausalLM, config)
    ids = torch.randint(0, config.vocab_size, (4, 1024), device="cuda")
    kept = _steps(model, {"input_ids": ids, "labels": ids})
    dist.destroy_process_group()
    return kept


def bert_fsdp1():
    """BERT-large masked-LM with FSDP1, one unit per encoder layer, bf16 mixed precision and
    activation checkpointing: the Accelerate/Trainer FSDP recipe's settings."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import BertConfig, BertForMaskedLM
    from transformers.models.bert.modeling_bert import BertLayer

    _start()
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                       intermediate_size=4096))
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={BertLayer}),
                 mixed_precision=bf16, device_id=torch.cuda.current_device())
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, BertLayer))
    ids = torch.randint(0, 30522, (8, 512), device="cuda")
    kept = _steps(model, {"input_ids": ids, "labels": ids})
    dist.destroy_process_group()
    return kept


JOBS = {"gpt2_ddp": gpt2_ddp, "llama_fsdp2": llama_fsdp2, "bert_fsdp1": bert_fsdp1}
'''

# Models nobody here wrote (issue 54), FOREIGN's three and HUB_JOBS: transformers' conv nets, vision
# transformers, an encoder-decoder and a mixture of experts, built from their configs and trained as
# their users train them (a pinned DataLoader, channels_last, bf16 autocast or FSDP2's bf16 parameters,
# AdamW, clipping, the loss logged with .item()). One module: FOREIGN's helpers and jobs are HUB's too.
# FORCE_BALANCED_ROUTING=1 forces the MoE's routing to the one a fake GPU assumes, so a real GPU's
# figure is the same routing's: HUB_REAL_ENV is what a run on a real GPU sets.
HUB = FOREIGN + '''

def _images(batch, steps=3, channels_last=True, size=224, classes=1000):
    """The batches a torchvision-style loader hands over: from pinned host memory, copied without
    blocking, in channels_last for a conv net."""
    data = torch.utils.data.TensorDataset(torch.randn(batch * steps, 3, size, size),
                                          torch.randint(0, classes, (batch * steps,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, pin_memory=True, drop_last=True)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for images, labels in loader:
        yield {"pixel_values": images.cuda(non_blocking=True).contiguous(memory_format=layout),
               "labels": labels.cuda(non_blocking=True)}


def _vision_ddp(build, batch, channels_last):
    """An image classifier with DDP as the torchvision recipe trains it: bf16 autocast, clipping at 1,
    the loss logged each step."""
    _start()
    torch.manual_seed(0)
    model = build().cuda()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    kept = _steps(model, _images(batch, channels_last=channels_last), autocast=True, clip=1.0, log=True)
    dist.destroy_process_group()
    return kept


def resnet50_ddp():
    """ResNet-50 (25.6M parameters), channels_last, 32 images of 224x224 a rank."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return _vision_ddp(lambda: ResNetForImageClassification(ResNetConfig(num_labels=1000)), 32, channels_last=True)


def vit_ddp():
    """ViT-B/16 (86.6M parameters, SDPA attention), 32 images of 224x224 a rank."""
    from transformers import ViTConfig, ViTForImageClassification

    return _vision_ddp(lambda: ViTForImageClassification(ViTConfig(num_labels=1000)), 32, channels_last=False)


def swin_ddp():
    """Swin-T (28.3M parameters), 32 images of 224x224 a rank."""
    from transformers import SwinConfig, SwinForImageClassification

    return _vision_ddp(lambda: SwinForImageClassification(SwinConfig(num_labels=1000)), 32, channels_last=False)


def convnext_ddp():
    """ConvNeXt-T (28.6M parameters), channels_last, 64 images of 224x224 a rank. (FSDP2 refuses
    channels_last parameters: "FSDP does not support non-contiguous parameters yet".)"""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return _vision_ddp(lambda: ConvNextForImageClassification(ConvNextConfig(num_labels=1000)), 64, channels_last=True)


def t5_ddp():
    """T5-small (60.5M parameters, an encoder-decoder) with DDP, as transformers' summarization example
    trains it under the Trainer (bf16 autocast, gradients clipped at 1, the loss logged): 16 inputs of
    512 tokens, targets of 128."""
    from transformers import T5Config, T5ForConditionalGeneration

    _start()
    torch.manual_seed(0)
    config = T5Config(decoder_start_token_id=0)  # t5-small's, as its hub config says
    model = torch.nn.parallel.DistributedDataParallel(T5ForConditionalGeneration(config).cuda(),
                                                      device_ids=[torch.cuda.current_device()])
    inputs = torch.randint(0, config.vocab_size, (16, 512), device="cuda")
    labels = torch.randint(0, config.vocab_size, (16, 128), device="cuda")
    kept = _steps(model, {"input_ids": inputs, "labels": labels}, autocast=True, clip=1.0, log=True)
    dist.destroy_process_group()
    return kept


def _balanced_topk(experts):
    """torch.topk, except over a router's ``experts`` scores: token t's j-th expert is (t*k + j) mod
    experts (a fake GPU's balanced routing), its weight the score there. What it allocates is what topk
    allocates: the indices and the values."""
    topk = torch.topk

    def forced(input, k, dim=-1, largest=True, sorted=True):
        if input.shape[-1] != experts or dim not in (-1, input.ndim - 1):
            return topk(input, k, dim, largest, sorted)
        indices = torch.empty(*input.shape[:-1], k, dtype=torch.long, device=input.device)
        torch.arange(indices.numel(), out=indices.view(-1))
        indices.remainder_(experts)
        return torch.return_types.topk((input.gather(-1, indices), indices))

    return forced


def mixtral_fsdp2():
    """A Mixtral (8 experts, top-2, 4 layers of 1024, 277M parameters, transformers' grouped_mm experts)
    trained as the llama job is (meta, FSDP2 per block, bf16 parameters, fp32 reduction), with the
    router's auxiliary loss on, clipping and the loss logged."""
    from transformers import MixtralConfig, MixtralForCausalLM

    _start()
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
                           num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                           max_position_embeddings=2048, output_router_logits=True, router_aux_loss_coef=0.02)
    if os.environ.get("FORCE_BALANCED_ROUTING") == "1":
        torch.topk = _balanced_topk(config.num_local_experts)
    model = _fsdp2_on_meta(MixtralForCausalLM, config)
    ids = torch.randint(0, config.vocab_size, (4, 1024), device="cuda")
    kept = _steps(model, {"input_ids": ids, "labels": ids}, clip=1.0, log=True)
    dist.destroy_process_group()
    return kept


JOBS = {**JOBS, "resnet50_ddp": resnet50_ddp, "vit_ddp": vit_ddp, "swin_ddp": swin_ddp,
        "convnext_ddp": convnext_ddp, "t5_ddp": t5_ddp, "mixtral_fsdp2": mixtral_fsdp2}
'''
HUB_JOBS = ("resnet50_ddp", "vit_ddp", "swin_ddp", "convnext_ddp", "t5_ddp", "mixtral_fsdp2")
HUB_REAL_ENV = {"mixtral_fsdp2": {"FORCE_BALANCED_ROUTING": "1"}}

# A small FSDP2 job on the host (gloo): fully_shard over a 4-layer TransformerEncoder, the job on which
# a new user's reshard_after_forward=False (+9 MiB of ~340) passed the old default tolerance (issue 36).
# RESHARD_AFTER_FORWARD=0 is that change. Used by tests/test_tolerance.py and benchmarks/tolerance_power.py.
HOST_FSDP2 = '''
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def group():
    dist.init_process_group("gloo")
    yield
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=[1, 2])
def test_fsdp2(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4)
    reshard = os.environ.get("RESHARD_AFTER_FORWARD", "1") == "1"
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128, 256)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


# A job whose memory should shrink with N (issue 55): a small language model sharded with FSDP2 on the
# host (gloo; every size above 1 simulated), gated by a cap per size that `gpumem refresh` suggested from
# the healthy job (its ratio + 0.02). FSDP2_BUG switches on one of four regressions, each of which keeps
# the ratio at 8 above its cap with no baseline stored: the logits all-gathered, reshard_after_forward=False,
# an EMA of the full (unsharded) parameters, an optimizer built before fully_shard (it keeps the full
# parameters and their state). Figures: benchmarks/results/shrinking_ratio.txt.
HOST_FSDP2_SHRINK = '''
import os

import pytest
import torch
import torch.distributed as dist

VOCAB, WIDTH, LAYERS = 8192, 512, 6


@pytest.fixture
def group():
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 8, 4 * WIDTH, batch_first=True) for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.gpumem(nproc=[2, 8], device="cpu", simulate="on", max_ratio={2: 0.79, 8: 0.61})
def test_fsdp2_shrinks(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bug = os.environ.get("FSDP2_BUG", "")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = LM()
    stale = torch.optim.Adam(model.parameters(), lr=1e-3) if bug == "optimizer_before_shard" else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=bug != "no_reshard")
    fully_shard(model, mesh=mesh, reshard_after_forward=bug != "no_reshard")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ema = [p.full_tensor().detach().clone() for p in model.parameters()] if bug == "ema_full" else None
    ids = torch.randint(0, VOCAB, (4, 128))
    for _ in range(3):
        logits = model(ids)
        if bug == "gather_logits":
            logits = torch.cat(torch.distributed.nn.functional.all_gather(logits))
        loss = logits.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stale is not None:
            stale.step()
        if ema is not None:
            for kept, p in zip(ema, model.parameters()):
                kept.lerp_(p.full_tensor(), 0.01)
'''


# A tensor-parallel job whose smallest world is 2: a (dp, tp=2) mesh, ColwiseParallel/RowwiseParallel
# on "tp", fully_shard on "dp"; its ratio is taken against nproc=2 (reference=2), dp scaling with tp
# fixed. The inflated twin gathers every dp rank's 32 MiB activation (grows with dp, as boxing did).
TORCH_TP = '''
import pytest
import torch
import torch.distributed as dist

MiB = 1024 * 1024
TP = 2


def tp_job(gather_over_dp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                         "2": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(net, mesh=mesh["dp"])
    local = torch.ones(32 * MiB // 4)                    # this rank's activation
    kept = []
    if gather_over_dp:                                    # the regression: every dp rank keeps them all
        kept = [torch.empty_like(local) for _ in range(mesh["dp"].size())]
        dist.all_gather(kept, local, group=mesh["dp"].get_group())
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(3):
        net(torch.ones(64, 1024)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(kept) == (mesh["dp"].size() if gather_over_dp else 0)
    dist.destroy_process_group()
'''


# A mixture-of-experts layer, one expert per rank, routed the way expert parallel jobs route: the
# token counts go out with all_to_all_single, the received counts (.tolist()) size the second
# all_to_all_single and the expert's work. Its buffers depend on values other ranks send, so a
# simulated rank measures it only under a declared assumption (assume="alike"). The regression is a
# collapsed router: every token to expert 0, whose rank then receives every rank's tokens.
TORCH_MOE = '''
import os
import pytest
import torch
import torch.distributed as dist

MiB = 1024 * 1024
SCALE = 16 if torch.cuda.is_available() else 1
TOKENS, WIDTH = 4096 * SCALE, 1024                       # 16 MiB x SCALE of tokens per rank


def moe_job(router="balanced"):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = dist.get_world_size()
    torch.manual_seed(0)
    expert = torch.nn.Linear(WIDTH, WIDTH).to(device)
    tokens = torch.randn(TOKENS, WIDTH, device=device)
    if router == "collapsed":                             # the regression: every token to expert 0
        choice = torch.zeros(TOKENS, dtype=torch.int64, device=device)
    else:
        choice = torch.arange(TOKENS, device=device) % world
    order = torch.argsort(choice, stable=True)
    sent = torch.bincount(choice, minlength=world)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)                # how many tokens each rank sends this one
    send_splits, receive_splits = sent.tolist(), received.tolist()
    arrived = tokens.new_empty(sum(receive_splits), WIDTH)
    dist.all_to_all_single(arrived, tokens[order], receive_splits, send_splits)
    out = expert(arrived.requires_grad_())                # the expert's work: what arrived
    out.pow(2).mean().backward()
    back = tokens.new_empty(TOKENS, WIDTH)
    dist.all_to_all_single(back, out.detach(), send_splits, receive_splits)
    collapsed_here = TOKENS * world if dist.get_rank() == 0 else 0
    assert sum(receive_splits) == (collapsed_here if router == "collapsed" else TOKENS)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.destroy_process_group()
'''


def moe_expert_lines() -> set[str]:
    """``test_moe.py:N`` of TORCH_MOE's lines whose buffers the received tokens size, from the tokens
    that arrive to the expert's backward: where a collapsed router's growth must be named."""
    lines = TORCH_MOE.lstrip("\n").splitlines()
    first = next(n for n, text in enumerate(lines, 1) if "arrived = " in text)
    last = next(n for n, text in enumerate(lines, 1) if ".backward()" in text)
    return {f"test_moe.py:{n}" for n in range(first, last + 1)}


# Context parallel (torch.distributed.tensor.experimental.context_parallel): one attention layer whose
# input sequence is sharded over the world, ring attention passing the keys and values round; 64 MiB
# of bf16 input. The regression leaves the input out of context_parallel's buffers (the positions alone
# sharded): every rank keeps the whole sequence, and gathers every rank's keys and values of it. Needs
# CUDA: torch 2.13's CPU flash attention has no sharding strategy, so on CPU it does not run at all.
TORCH_CP = '''
import os
import pytest
import torch
import torch.distributed as dist

HEADS, HEAD_DIM, SEQ = 16, 64, 32768


def cp_job(shard=True):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    width = HEADS * HEAD_DIM
    proj = torch.nn.Linear(width, 3 * width, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, SEQ, width, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0)
    buffers = [x, positions] if shard else [positions]    # the regression: x left whole on every rank
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        q, k, v = (t.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in proj(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    dist.destroy_process_group()
'''


# A pipeline: LAYERS blocks split over the world's stages (PipelineStage with its shapes declared),
# MICROBATCHES microbatches a step under 1F1B or GPipe; 0.25 MiB of activation per microbatch and
# layer (x SCALE on a GPU). A stage after the first declares an input that requires grad: otherwise it
# sends no gradient back and the stage before it waits forever. The regression keeps every
# microbatch's output past its backward. On CPU gloo, on a GPU NCCL with a device per rank.
TORCH_PP = '''
import os
import pytest
import torch
import torch.distributed as dist

MiB = 1024 * 1024
LAYERS, WIDTH, MICROBATCHES = 8, 1024, 32
SCALE = 64 if torch.cuda.is_available() else 1
BATCH = 2048 * SCALE                                      # 0.25 MiB x SCALE per microbatch and layer
KEPT = []


class Block(torch.nn.Module):
    def __init__(self, keep_outputs):
        super().__init__()
        self.linear, self.keep_outputs = torch.nn.Linear(WIDTH, WIDTH), keep_outputs

    def forward(self, x):
        y = self.linear(x)
        if self.keep_outputs:                             # the regression: kept past its backward
            KEPT.append(y)
        return y


def pp_job(schedule="1f1b", keep_outputs=False, declared=True):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    blocks = torch.nn.Sequential(*[Block(keep_outputs) for _ in range(LAYERS // world)]).to(device)
    example = torch.empty(BATCH // MICROBATCHES, WIDTH, device=device)  # shapes declared: no exchange
    shapes = dict(input_args=example.clone().requires_grad_(rank > 0), output_args=example.requires_grad_())
    stage = PipelineStage(blocks, rank, world, device, **(shapes if declared else {}))
    pipeline = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        stage, n_microbatches=MICROBATCHES, loss_fn=lambda out, target: out.pow(2).mean())
    batch = torch.randn(BATCH, WIDTH, device=device)
    for _ in range(2):
        KEPT.clear()
        if world == 1:
            pipeline.step(batch, target=batch)
        elif rank == 0:
            pipeline.step(batch)
        elif rank == world - 1:
            pipeline.step(target=batch)
        else:
            pipeline.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.destroy_process_group()
'''


# DeepSpeed ZeRO over a stack of 8 Linear(2048, 2048) (128 MiB of fp32 weights, 256 MiB of Adam state a
# replica), built under deepspeed.zero.Init at stage 3 so no rank ever holds the whole model. The
# regression is ZeRO-3 -> ZeRO-1 in the config (every rank keeps the whole model and its gradients;
# only Adam's state stays sharded), declared on the marker as config={"zero_stage": ...}. On CPU
# DeepSpeed's CPU accelerator with gloo; on a GPU its CUDA accelerator with NCCL.
TORCH_ZERO = '''
import os
import pytest
import torch
import torch.distributed as dist

WIDTH, LAYERS = 2048, 8
STAGE = int(os.environ.get("ZERO_STAGE", "3"))


def zero_job(stage=STAGE):
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              # Buckets sized for this model (DeepSpeed's default reduce bucket is 5e8 elements: 1.9 GiB).
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20,
                                    "stage3_prefetch_bucket_size": 2**20},
              "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                      config=config)
    batch = torch.randn(8, WIDTH, device=engine.device)
    for _ in range(3):
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.destroy_process_group()
'''


# A job written with Hugging Face accelerate: Accelerator(), prepare() (DDP over gloo on CPU, NCCL on
# a GPU), accelerator.backward. The regression gathers every rank's 64 MiB of outputs (accelerator.gather,
# e.g. for a metric) and keeps them: it grows with the world, as boxing did. The training batch is
# small (4 MiB): the figure is the model's, not three steps of CPU matmuls.
TORCH_ACCELERATE = '''
import pytest
import torch

MiB = 1024 * 1024


def accelerate_job(gather=False):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    batch = torch.randn(1024, 1024, device=accelerator.device)
    outputs = torch.randn(64 * MiB // 4 // 1024, 1024, device=accelerator.device)
    kept = accelerator.gather(outputs) if gather else None  # the regression: every rank's outputs on every rank
    for _ in range(3):
        accelerator.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    assert kept is None or kept.shape[0] == outputs.shape[0] * accelerator.num_processes
    accelerator.end_training()
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
'''


# A Megatron-Core GPT (8 layers, hidden 2048, vocabulary 32768) at TP=2 x PP=2 with its own 1F1B
# schedule (get_forward_backward_func), data parallel over what is left of the world: 4 ranks are one
# model, 8 are two replicas. The smallest world is 4, so the ratio is taken against reference=4. The
# regression keeps every data-parallel rank's gradients on every rank (an all_gather over the
# data-parallel group per step), which grows with dp. Needs CUDA (Megatron's RNG tracker is CUDA's).
TORCH_MEGATRON = '''
import datetime
import os

import pytest

TP, PP = 2, 2


def megatron_job(gather=False, steps=2, microbatches=4, layers=8, hidden=2048, heads=16, tp=TP, pp=PP):
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               pipeline_dtype=torch.float32,
                               params_dtype=torch.float32, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32768,
                     max_sequence_length=1024, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).cuda()
    seq, mbs = 1024, 4
    tokens = torch.randint(0, 32768, (mbs, seq), device="cuda")
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, device="cuda", dtype=torch.bool), diagonal=1)
    kept = []

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(tokens, position_ids, mask, labels=tokens)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}
        return output, loss_func

    forward_backward = get_forward_backward_func()
    for _ in range(steps):
        forward_backward(forward_step_func=forward_step, data_iterator=iter(range(microbatches)), model=model,
                         num_microbatches=microbatches, seq_length=seq, micro_batch_size=mbs, forward_only=False)
        if gather:  # the regression: every data-parallel rank's gradients kept on every rank
            group = parallel_state.get_data_parallel_group()
            for p in model.parameters():
                out = torch.empty((group.size(),) + tuple(p.grad.shape), device="cuda")
                torch.distributed.all_gather_into_tensor(out, p.grad.contiguous(), group=group)
                kept.append(out)
        model.zero_grad()
    torch.cuda.synchronize()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
'''


# torchtitan's Llama 3 (torchtitan 0.2.2, the release that runs on the GPU machine's torch 2.11; 0.3.0
# imports torch.distributed.fsdp.DataParallelMeshDims, which 2.11 lacks), built torchtitan's way: on meta,
# parallelize_llama (TP with sequence parallel on "tp", FSDP2 on "dp_shard", bf16 parameters), then
# to_empty and init_weights. The loss is computed under loss_parallel, as torchtitan's trainer does; the
# regression is one config flag, parallelism.disable_loss_parallel: the output projection then returns
# its logits replicated on every TP rank instead of sharded over the vocabulary. Needs CUDA: torchtitan's
# import needs triton, and its FSDP2 (gradient_divide_factor=1.0) reduce-scatters with PREMUL_SUM,
# which gloo refuses.
TORCH_TITAN = '''
import contextlib
import dataclasses
import datetime
import os

import pytest

LOSS_PARALLEL = os.environ.get("TITAN_LOSS_PARALLEL", "1") == "1"


def titan_job(tp=2, loss_parallel=LOSS_PARALLEL, steps=2, dim=2048, layers=8, heads=16, vocab=32768,
              seq=2048, batch=4):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel as sharded_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args, parallelize_llama

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    job = JobConfig()
    job.parallelism.tensor_parallel_degree = tp
    job.parallelism.disable_loss_parallel = not loss_parallel
    job.training.seq_len, job.training.local_batch_size = seq, batch
    job.activation_checkpoint.mode = "none"
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=dist.get_world_size())
    dims.build_mesh()
    args = dataclasses.replace(llama3_args["debugmodel"], dim=dim, n_layers=layers, n_heads=heads,
                               vocab_size=vocab)
    args.update_from_config(job)
    with torch.device("meta"):
        model = Transformer(args)
    model = parallelize_llama(model, dims, job)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    for _ in range(steps):
        logits = model(tokens)
        with sharded_loss() if tp > 1 and loss_parallel else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    dist.destroy_process_group()
'''
