"""The fake GPU over whole families of models nobody here wrote: every causal-LM and image-classification
architecture ``transformers`` ships, each built from its config shrunk to a tiny size (no weights), and
(in the vision venv) torchvision's classification, segmentation and detection models and each timm
family's smallest model as they ship; each trained two steps as its users train it (AdamW), on one rank,
as rank 0 of a world of 2 under DDP, and under FSDP2 (``fully_shard`` per block, as
``_no_split_modules`` or the model's block lists name them), in fp32 and under bf16 autocast.

    python benchmarks/fake_gpu_sweep.py --cpu  --out cpu.json    # the denominator: trains on plain CPU torch
    python benchmarks/fake_gpu_sweep.py        --out fake.json   # on a fake GPU (here)
    python3 benchmarks/fake_gpu_sweep.py --real --out real.json  # on a GPU machine: rank 0's real figure
    python benchmarks/fake_gpu_sweep.py --table cpu.json fake.json [real.json]
    python benchmarks/fake_gpu_sweep.py --merge fake.json rerun.json --out fake.json  # a rerun's rows win

The denominator is what trains on plain CPU torch (world 1, fp32); a model that does not build
or train there is listed apart with its error. Worlds of 2 are simulated (``rankside.simulate``: rank 0
with a stand-in group, every collective's sizes kept), on a fake GPU and on a real one alike. Each model
runs in a process forked from one that imported torch and ``transformers`` once, as a rank would; each
figure is rank 0's ``torch.cuda.max_memory_allocated()`` after the two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
MODES = ("single", "ddp", "fsdp2")  # one rank; rank 0 of 2 under DDP; rank 0 of 2 under FSDP2
DTYPES = ("fp32", "bf16")  # fp32 weights; bf16 autocast over fp32 weights
FAMILIES = ("causal_lm", "image_classification")  # transformers' (the torch venv)
# torchvision's and timm's: a venv of their own (make's .venv-vision: torchvision needs the torch it was
# built with, a CUDA build), named with --families
VISION_FAMILIES = ("tv_classification", "tv_segmentation", "tv_detection", "timm")
MODEL_TIMEOUT_S = 120
ROWS_ENV = "SWEEP_ROWS"  # a file to append each row to, as JSON lines
LEVELS_ENV = "SWEEP_LEVELS"  # the levels chosen by the denominator's run, as JSON, for the workers
# A tiny config: set where the architecture's config has the key (its own default otherwise).
SHRINK: dict[str, Any] = {
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 512, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 512,
    "n_embd": 256, "n_layer": 2, "n_head": 4, "n_inner": 512, "d_model": 256, "num_layers": 2, "n_layers": 2,
    "num_heads": 4, "d_ff": 512, "ffn_dim": 512, "d_kv": 64, "n_positions": 512,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 64, "q_lora_rank": 128, "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32, "v_head_dim": 64, "image_size": 64, "num_channels": 3, "num_labels": 10,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "n_embed": 256,
    "depths": "ones",
}
SEQ, BATCH = 128, 4


# How far a config is shrunk: all sizes; all but the attention heads' (a model that derives its head
# size from its own head count, or checks it). The denominator's run (--cpu) takes the first level that
# trains on plain CPU torch, and the other runs read it from there (--levels): each side builds the same model.
LEVELS = ("tiny", "tiny-heads")
# torchvision's and timm's models are built as they ship (their own sizes; a timm family's smallest
# variant): what is chosen is the input's side, the first that trains on plain CPU torch ("native": the
# size the model's pretrained config names).
VISION_LEVELS = {"tv_classification": ("64", "224", "299"), "tv_segmentation": ("128",), "tv_detection": ("128",),
                 "timm": ("native",)}


def levels_of(family: str) -> tuple[str, ...]:
    return VISION_LEVELS.get(family, LEVELS)
HEAD_KEYS = {"num_attention_heads", "num_key_value_heads", "head_dim", "n_head", "num_heads", "d_kv",
             "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
             "encoder_attention_heads", "decoder_attention_heads"}


def shrunk_config(auto_config: Any, model_type: str, level: str = "tiny") -> Any:
    """The architecture's default config with its sizes made tiny, passed to its ``__init__`` so that
    what it derives (layer types, head dims) follows; a composite config's parts (text, vision,
    encoder, patcher) are shrunk alike."""
    return auto_config.for_model(model_type, **_shrunk(auto_config.for_model(model_type).to_dict(), level))


def _shrunk(keys: dict[str, Any], level: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for key, value in keys.items():
        if isinstance(value, dict) and "model_type" in value:  # a part of a composite config
            kwargs[key] = {**value, **_shrunk(value, level)}
    wanted = {k for k in SHRINK if level == "tiny" or k not in HEAD_KEYS}
    staged = isinstance(keys.get("hidden_sizes"), list)  # a vision backbone's widths per stage: kept as they are
    for key, value in SHRINK.items():
        if key not in wanted or key not in keys or keys[key] is None or (staged and key == "hidden_size"):
            continue
        if key == "image_size" and "window_size" in keys:  # windows tile the image at its own size
            continue
        if value == "ones":
            if isinstance(keys[key], list):
                kwargs[key] = [1] * len(keys[key])
            continue
        if isinstance(keys[key], bool) or not isinstance(keys[key], int):
            continue
        kwargs[key] = value
    if isinstance(keys.get("layer_types"), list):  # one layer of each kind, in the order they come
        kinds = list(dict.fromkeys(keys["layer_types"]))
        layers = max(kwargs.get("num_hidden_layers", 2), len(kinds))
        kwargs["layer_types"] = (kinds * layers)[:layers]
        if "num_hidden_layers" in keys:
            kwargs["num_hidden_layers"] = layers
    vocab = kwargs.get("vocab_size")
    if vocab:  # special tokens inside the smaller vocabulary
        for key, value in keys.items():
            if key.endswith("token_id") and isinstance(value, int) and value >= vocab:
                kwargs[key] = vocab - 1
    return kwargs


def architectures(family: str) -> list[str]:
    if family in VISION_FAMILIES:
        return _vision_architectures(family)
    from transformers.models.auto import modeling_auto

    names = {"causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "image_classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[family]
    return sorted(names)


def _vision_architectures(family: str) -> list[str]:
    """Every model torchvision lists for the task; of each family (module) timm lists, its smallest model
    (fewest parameters, built on the meta device; about 2.5 minutes for timm's 1371)."""
    if family == "timm":
        import timm
        import torch

        chosen = []
        for module in sorted(timm.list_modules()):
            sizes = {}
            for name in timm.list_models(module=module):
                with torch.device("meta"):
                    sizes[name] = sum(p.numel() for p in timm.create_model(name, pretrained=False).parameters())
            if sizes:
                chosen.append(min(sizes, key=lambda name: (sizes[name], name)))
        return sorted(set(chosen))
    import torchvision.models as tv

    module = {"tv_classification": tv, "tv_segmentation": tv.segmentation, "tv_detection": tv.detection}[family]
    return sorted(tv.list_models(module=module))


def build(family: str, model_type: str, device: str, level: str) -> tuple[Any, Callable[[], Any]]:
    """The model on ``device`` and a function giving one step's loss."""
    import torch

    torch.manual_seed(0)
    if family in VISION_FAMILIES:
        return _build_vision(family, model_type, device, level)
    import transformers

    config = shrunk_config(transformers.AutoConfig, model_type, level)
    if family == "causal_lm":
        model = transformers.AutoModelForCausalLM.from_config(config)
        vocab = min(int(getattr(config, "vocab_size", 0) or getattr(getattr(config, "text_config", None),
                                                                      "vocab_size", 2048) or 2048), 2048)
        ids = torch.randint(0, vocab, (BATCH, SEQ))
        return model.to(device), lambda: model(input_ids=ids.to(device), labels=ids.to(device)).loss
    model = transformers.AutoModelForImageClassification.from_config(config)
    size = getattr(config, "image_size", 64)
    size = size if isinstance(size, int) else 64
    channels = getattr(config, "num_channels", 3) or 3
    pixels = torch.randn(BATCH, channels, size, size)
    labels = torch.randint(0, int(getattr(config, "num_labels", 2) or 2), (BATCH,))
    return model.to(device), lambda: model(pixel_values=pixels.to(device), labels=labels.to(device)).loss


def _build_vision(family: str, name: str, device: str, level: str) -> tuple[Any, Callable[[], Any]]:
    """A torchvision or timm model as its users train it: no weights, 10 classes, a batch of ``BATCH``;
    classification on cross-entropy (an auxiliary head's loss added, as torchvision's reference scripts
    do), segmentation on the pixels' cross-entropy, detection on the sum of its losses."""
    import torch
    import torch.nn.functional as F

    if family == "timm":
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10)
        size: tuple[int, ...] = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    else:
        import torchvision.models as tv

        extra: dict[str, Any] = {"weights": None, "num_classes": 10}
        if family != "tv_classification":
            extra["weights_backbone"] = None
        if family == "tv_detection" and not name.startswith("ssd"):
            extra.update(min_size=int(level), max_size=int(level))
        if name in ("googlenet", "inception_v3"):
            extra["init_weights"] = True
        model = tv.get_model(name, **extra)
        size = (3, int(level), int(level))
    model = model.to(device)
    if family == "tv_detection":
        images = [torch.rand(*size) for _ in range(BATCH)]
        targets = [_target(name, size[-1], index) for index in range(BATCH)]

        def detection_loss() -> Any:
            losses = model([image.to(device) for image in images],
                           [{key: value.to(device) for key, value in target.items()} for target in targets])
            return sum(losses.values())
        return model, detection_loss
    pixels = torch.randn(BATCH, *size)
    if family == "tv_segmentation":
        masks = torch.randint(0, 10, (BATCH, size[-2], size[-1]))

        def segmentation_loss() -> Any:
            out = model(pixels.to(device))
            target = masks.to(device)
            return sum(F.cross_entropy(out[key], target) * (1.0 if key == "out" else 0.5) for key in out)
        return model, segmentation_loss
    labels = torch.randint(0, 10, (BATCH,))

    def classification_loss() -> Any:
        out = model(pixels.to(device))
        target = labels.to(device)
        if isinstance(out, tuple):  # GoogLeNet's and Inception's auxiliary heads
            return F.cross_entropy(out[0], target) + sum(0.3 * F.cross_entropy(aux, target)
                                                         for aux in out[1:] if aux is not None)
        return F.cross_entropy(out, target)
    return model, classification_loss


def _target(name: str, side: int, index: int) -> dict[str, Any]:
    """Two boxes with labels; masks and keypoints for the models that learn them."""
    import torch

    boxes = torch.tensor([[4.0 + index, 6.0, side / 2, side / 2 + 3], [side / 4, side / 3, side - 5.0, side - 2.0]])
    target = {"boxes": boxes, "labels": torch.tensor([1, 2 + index % 3])}
    if name.startswith("maskrcnn"):
        masks = torch.zeros(2, side, side, dtype=torch.uint8)
        for k, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        target["masks"] = masks
    if name.startswith("keypointrcnn"):
        points = torch.rand(2, 17, 3) * (side / 2) + side / 4
        points[..., 2] = 1
        target["keypoints"] = points
    return target


def wrap(model: Any, mode: str, family: str) -> Any:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[0], find_unused_parameters=True)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        owners: dict[int, int] = {}  # a parameter -> how many modules hold it (tied weights: two)
        for module in model.modules():
            for param in module.parameters(recurse=False):
                owners[id(param)] = owners.get(id(param), 0) + 1
        chosen = [module for module in _blocks(model, family)
                  if not any(owners[id(p)] > 1 for p in module.parameters())]  # a tied weight: the root's
        for module in reversed(chosen):  # chosen first (sharding replaces the parameters), then inner blocks first
            fully_shard(module)
        fully_shard(model)
    return model


# Where a vision model keeps its blocks (timm's and torchvision's names), when it names none to keep whole.
BLOCK_LISTS = ("blocks", "stages", "layers", "features", "layer1", "layer2", "layer3", "layer4", "backbone.body")


def _blocks(model: Any, family: str) -> list[Any]:
    """The modules FSDP2 shards one by one: those ``_no_split_modules`` names (transformers'; none: the
    root alone); a vision model's, the entries of its block lists (timm's ``blocks``/``stages``,
    torchvision's ``features``, ResNet's ``layerN``), else each child of the root that holds parameters."""
    if family not in VISION_FAMILIES:
        named = set(getattr(model, "_no_split_modules", None) or ())
        return [module for module in list(model.modules())[1:] if type(module).__name__ in named]
    found = []
    for path in BLOCK_LISTS:
        holder = model
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if holder is not None and hasattr(holder, "children"):
            found += [child for child in holder.children() if any(True for _ in child.parameters())]
    return found or [child for child in model.children() if any(True for _ in child.parameters())]


def train(family: str, model_type: str, mode: str, dtype: str, device: str, level: str) -> dict[str, Any]:
    """Two AdamW steps; rank 0's allocator peak (on a GPU) or nothing (on the CPU)."""
    import torch

    started = time.perf_counter()
    model, loss_of = build(family, model_type, device, level)
    model.train()
    wrapped = wrap(model, mode, family)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    for _ in range(2):
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    figure: dict[str, Any] = {"s": round(time.perf_counter() - started, 2), "level": level}
    if device != "cpu":
        torch.cuda.synchronize()
        figure["mib"] = round(torch.cuda.max_memory_allocated() / MiB, 2)
        from pytest_gpumem.rankside import fakegpu

        if fakegpu.active:
            figure["supplied"] = sorted({line.split(" at ")[0] for line in fakegpu.supplied()})
    return figure


def _error(exc: BaseException) -> dict[str, Any]:
    text = str(exc).strip().splitlines()
    return {"error": f"{type(exc).__name__}: {text[0][:300] if text else ''}"}


def worker(family: str, mode: str, dtype: str, names: list[str], where: str, levels: dict[str, str]) -> None:
    """One process per (family, mode, dtype): the fake GPU and the simulated world installed, torch and
    transformers imported once, each model in a forked child; one JSON line per model on stdout."""
    world = 1 if mode == "single" else 2
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 3000))
    sys.path.insert(0, str(ROOT))
    if where != "cpu":
        from pytest_gpumem.rankside import simulate

        if world > 1:
            os.environ[simulate.SIMULATE_ENV] = f"0/{world}"
            simulate.install_world(simulate.World(0, world))
    if where == "fake":
        from pytest_gpumem.rankside import fakegpu

        fakegpu.install(os.environ.get("SWEEP_FAKE_MODEL", "NVIDIA H200"), os.environ.get("SWEEP_CALIBRATION"))
    import torch

    if family in VISION_FAMILIES:
        import torchvision  # noqa: F401 - imported once, before the forks
        if family == "timm":
            import timm  # noqa: F401
    else:
        import transformers  # imported once, before the forks

        transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in names:
        tries = [levels[name]] if name in levels else list(levels_of(family))
        for level in tries:
            figure = _forked(lambda: _one(family, name, mode, dtype, where, world, level))
            if "error" not in figure:
                break
        print(json.dumps({"family": family, "model": name, "case": f"{mode}/{dtype}", **figure}), flush=True)


def _one(family: str, name: str, mode: str, dtype: str, where: str, world: int, level: str) -> dict[str, Any]:
    import torch

    if world > 1:  # one rank trains without a process group, as a single-GPU job does
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=world)
    return train(family, name, mode, dtype, "cpu" if where == "cpu" else "cuda", level)


def _forked(job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``job`` in a child forked from this process (its imports done): its figure, or how it ended."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            figure = job()
        except BaseException as exc:  # noqa: BLE001 - the table lists what stopped it
            figure = _error(exc)
        os.write(write, json.dumps(figure).encode())
        os._exit(0)
    os.close(write)
    return _collect(read, pid)


def _collect(read: int, pid: int) -> dict[str, Any]:
    """The child's figure, or how it ended: killed past ``MODEL_TIMEOUT_S``, or died without a word."""
    chunks, deadline = [], time.monotonic() + MODEL_TIMEOUT_S
    while True:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return {"error": f"Timeout: no figure in {MODEL_TIMEOUT_S} s"}
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    return json.loads(text) if text else {"error": f"Died: wait status {status}"}


def _frameworks_env() -> dict[str, str]:
    frameworks = Path(sys.prefix) / "frameworks"
    paths = [str(frameworks)] if frameworks.is_dir() else []
    path = os.pathsep.join(filter(None, [*paths, str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path,
            "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def sweep(where: str, families: list[str], modes: list[str], dtypes: list[str], only: list[str],
          parallel: int, levels: dict[str, str], chunk: int = 0) -> list[dict[str, Any]]:
    """Every (family, mode, dtype) group in workers of their own, ``chunk`` models a worker (0: the whole
    group), ``parallel`` at a time; with ``levels`` (the denominator's), only the models that trained on
    plain CPU torch, built as they were there."""
    import subprocess

    def listed(family: str) -> list[str]:  # the denominator's models, else the family's (timm's: minutes)
        chosen = sorted(key.split("/", 1)[1] for key in levels if key.startswith(family + "/"))
        return chosen if levels else _names(family)

    names = {f: [n for n in listed(f) if (not only or n in only) and (not levels or f"{f}/{n}" in levels)]
             for f in families}
    size = {f: chunk or max(1, len(names[f])) for f in families}
    groups = [(f, m, d, names[f][i:i + size[f]]) for f in families for m in modes for d in dtypes
              for i in range(0, len(names[f]), size[f])]
    os.environ[LEVELS_ENV] = json.dumps(levels)
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run_group(family: str, mode: str, dtype: str, chosen: list[str]) -> None:
        command = [sys.executable, __file__, "--worker", family, mode, dtype, ",".join(chosen), where]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_frameworks_env())
        for line in process.stdout or ():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            with lock:
                rows.append(row)
                if ROWS_ENV in os.environ:  # each row as it comes: a run cut short keeps what it measured
                    with open(os.environ[ROWS_ENV], "a") as rows_file:
                        rows_file.write(line)
                shown = row.get("mib", row.get("error", ""))
                print(f"{row['family']:20s} {row['model']:28s} {row['case']:12s} {shown}", flush=True)
        process.wait()

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(lambda group: run_group(*group), groups))
    return rows


def _names(family: str) -> list[str]:
    import subprocess

    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import fake_gpu_sweep as s; " \
           f"print(','.join(s.architectures({family!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_frameworks_env(),
                          check=True)
    return done.stdout.strip().split(",")


def op_of(error: str) -> str | None:
    """The op an error names (``aten::x``), if it is the fake GPU's own word on an op."""
    import re

    found = re.search(r"(aten::[\w.]+)", error)
    return found.group(1) if found and "fake GPU" in error else None


def table(cpu: dict[str, Any], fake: dict[str, Any], real: dict[str, Any] | None) -> str:
    """Per family and case: the denominator (trains on plain CPU), runs on the fake GPU, stops naming an
    op, crashes; with a GPU run, how many read within 1% of it. Then every model that did not run, with
    its error, and every figure beyond 1%."""
    def index(doc: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {(r["family"], r["model"], r["case"]): r for r in doc["rows"]}

    cpu_rows, fake_rows = index(cpu), index(fake)
    real_rows = index(real) if real else {}
    libraries = "; ".join(f"{name} {fake[name]}" for name in ("transformers", "torchvision", "timm") if name in fake)
    lines = [f"torch {fake['torch']} (fake, {fake['device']}); {libraries}"
             + (f"; real: {real['device']}, torch {real['torch']}" if real else ""),
             "", "| family | case | built + trained on CPU | runs on the fake GPU | stops naming an op | crashes |"
             + (" stops as on the GPU | GPU ran | within 1% |" if real else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if real else "")]
    notes, apart, beyond, same, cut = [], [], [], [], []
    for family in sorted({k[0] for k in fake_rows}):
        for case in [f"{m}/{d}" for m in MODES for d in DTYPES]:
            keys = [k for k in fake_rows if k[0] == family and k[2] == case]
            if not keys:
                continue
            on_cpu = {k: cpu_rows.get((family, k[1], "single/fp32"), {"error": ""}) for k in keys}
            denominator = [k for k in keys if "error" not in on_cpu[k]]
            trained = sum(1 for k, r in cpu_rows.items() if k[0] == family and "error" not in r)
            if len(denominator) < trained:  # a run cut short: the rest of the family has no row yet
                cut.append(f"{family} {case}: {len(denominator)} of the {trained} the denominator holds")
            ran = [k for k in denominator if "error" not in fake_rows[k]]
            # stopped by what the GPU stops at too (the wrapper's or the model's own error): not the fake GPU's
            alike = [k for k in denominator if "error" in fake_rows[k]
                     and _same_error(fake_rows[k]["error"], real_rows.get(k, {}).get("error"))]
            named = [k for k in denominator if "error" in fake_rows[k] and k not in alike
                     and op_of(fake_rows[k]["error"])]
            crashed = [k for k in denominator if k not in ran and k not in named and k not in alike]
            row = f"| {family} | {case} | {len(denominator)} | {len(ran)} | {len(named)} | {len(crashed)} |"
            row += f" {len(alike)} |" if real else ""
            if real:
                both = [k for k in ran if "mib" in real_rows.get(k, {})]
                both = [k for k in both if real_rows[k].get("level") == fake_rows[k].get("level")]  # the same model
                near = [k for k in both if _near(fake_rows[k]["mib"], real_rows[k]["mib"])]
                row += f" {len(both)} | {len(near)} ({100 * len(near) / max(1, len(both)):.0f}%) |"
                beyond += [_beyond(k, real_rows[k]["mib"], fake_rows[k]["mib"]) for k in both if k not in near]
            lines.append(row)
            notes += [f"{k[0]} {k[1]} {k[2]}: {fake_rows[k]['error']}" for k in named + crashed]
            same += [f"{k[0]} {k[1]} {k[2]}: {fake_rows[k]['error']}" for k in alike]
        apart += sorted({f"{family} {k[1]}: {cpu_rows[k]['error']}" for k in cpu_rows
                         if k[0] == family and "error" in cpu_rows[k]})
    if cut:
        lines += ["", "Cases with rows for part of the family only (a run cut short):", *cut]
    lines += ["", "Did not run on the fake GPU (of the denominator):", *(notes or ["(none)"])]
    if real:
        lines += ["", "Stopped on the GPU too, with the same error (not the fake GPU's):", *(same or ["(none)"])]
    if real:
        lines += ["", "Beyond 1% of the GPU:", *(beyond or ["(none)"])]
    lines += ["", "Not in the denominator (did not build or train on plain CPU torch):", *(apart or ["(none)"])]
    return "\n".join(lines)


def _same_error(fake: str, real: str | None) -> bool:
    """The same exception with the same start of its message (a repr of a module differs after it)."""
    return real is not None and fake.split("(")[0] == real.split("(")[0]


def _beyond(key: tuple[str, str, str], real: float, fake: float) -> str:
    return f"{' '.join(key)}: gpu {real:.2f} fake {fake:.2f} ({100 * (fake / real - 1):+.2f}%)"


def _near(fake: float, real: float) -> bool:
    return abs(fake - real) <= max(0.01 * real, 0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="on this machine's GPU")
    parser.add_argument("--cpu", action="store_true", help="on plain CPU torch, world 1 (the denominator)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--only", default="", help="comma-separated model types (default: the whole family)")
    parser.add_argument("--parallel", type=int, default=2, help="workers at a time")
    parser.add_argument("--chunk", type=int, default=0, help="models a worker (default: a whole group)")
    parser.add_argument("--model", help="the GPU model a fake GPU emulates (default NVIDIA H200)")
    parser.add_argument("--calibration", type=Path, help="a gpumem-calibration.json for --model")
    parser.add_argument("--levels", type=Path, metavar="CPU_JSON",
                        help="the denominator's run: only its models, each shrunk as it trained there")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", nargs="+", type=Path, metavar="JSON", help="cpu.json fake.json [real.json]")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="runs of one side, later ones replacing earlier rows of the same model and case (--out)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        family, mode, dtype, names, where = args.worker
        chosen = json.loads(os.environ.get(LEVELS_ENV) or "{}")
        worker(family, mode, dtype, names.split(","), where,
               {key.split("/", 1)[1]: level for key, level in chosen.items() if key.startswith(family + "/")})
        return 0
    if args.merge:
        docs = [_document(path) for path in args.merge]
        merged = {(r["family"], r["model"], r["case"]): r for doc in docs for r in doc["rows"]}
        out = {**docs[0], "rows": list(merged.values()), "seconds": sum(doc["seconds"] for doc in docs),
               "command": " && ".join(doc["command"] for doc in docs)}
        (args.out or args.merge[0]).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    if args.table:
        docs = [json.loads(path.read_text()) for path in args.table]
        print(table(docs[0], docs[1], docs[2] if len(docs) > 2 else None))
        return 0
    where = "real" if args.real else "cpu" if args.cpu else "fake"
    if args.model:
        os.environ["SWEEP_FAKE_MODEL"] = args.model
    if args.calibration:
        os.environ["SWEEP_CALIBRATION"] = str(args.calibration.resolve())
    modes = ["single"] if where == "cpu" else args.modes.split(",")
    dtypes = ["fp32"] if where == "cpu" else args.dtypes.split(",")  # the denominator: trains in fp32
    started = time.perf_counter()
    levels = {}
    if args.levels:
        levels = {f"{r['family']}/{r['model']}": r["level"] for r in json.loads(args.levels.read_text())["rows"]
                  if r["case"] == "single/fp32" and "error" not in r}
    libraries = ("torchvision", "timm") if set(args.families.split(",")) <= set(VISION_FAMILIES) else ("transformers",)
    head = {"where": where, "torch": _version("torch"), **{name: _version(name) for name in libraries},
            "device": _device(where), "command": " ".join(["python", "benchmarks/fake_gpu_sweep.py",
                                                           *(argv or sys.argv[1:])])}
    if ROWS_ENV in os.environ:  # the rows file's first line: what --merge needs to make it a run's document
        with open(os.environ[ROWS_ENV], "a") as rows_file:
            rows_file.write(json.dumps({"head": head}) + "\n")
    rows = sweep(where, args.families.split(","), modes, dtypes,
                 [n for n in args.only.split(",") if n], args.parallel, levels, args.chunk)
    doc = {**head, "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(rows)} runs in {doc['seconds']} s")
    return 0


def _document(path: Path) -> dict[str, Any]:
    """A run's document: its JSON, or the rows file (SWEEP_ROWS) of a run cut short, whose first line is its
    head and whose seconds are unknown (0)."""
    if path.suffix != ".jsonl":
        return json.loads(path.read_text())
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {**lines[0]["head"], "seconds": 0, "rows": [line for line in lines[1:] if "head" not in line]}


def _version(name: str) -> str:
    import subprocess

    done = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__version__)"], capture_output=True,
                          text=True, env=_frameworks_env())
    return done.stdout.strip() or "?"


def _device(where: str) -> str:
    if where == "cpu":
        return "cpu"
    if where == "fake":
        return f"fake {os.environ.get('SWEEP_FAKE_MODEL', 'NVIDIA H200')}"
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
