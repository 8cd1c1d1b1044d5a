"""What keeps the memory alive (issue 67, item 1): the walk to the variable that holds a storage and
the line that stored into it, in plain code; then the keep-logits twins on a fake GPU, one rank and an
FSDP2 rank of 2, failing against their baselines with the ``append`` line first and the allocation
line after it.
"""

from __future__ import annotations

import re
import textwrap
import weakref

import pytest

from pytest_gpumem.judging.record import SiteChange
from pytest_gpumem.sampling import holders
from pytest_gpumem.sampling.sites import Site, with_holders

torch = pytest.importorskip("torch")


def key_of(value):
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def line_of(source: str, needle: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if needle in text)


class Cache:
    def __init__(self):
        self.items = []

    def put(self, tensor):
        self.items.append(tensor)


BY_NAME: dict = {}


def test_a_list_an_attribute_a_global_and_a_saved_tensor_are_each_named_with_the_line_that_stored_them():
    import inspect

    source = inspect.getsource(__import__(__name__))
    kept, cache = [], Cache()
    w = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        kept.append(torch.randn(256, 64))
        cache.put(torch.randn(128, 128))
    BY_NAME["a"] = torch.randn(32, 32)
    x = torch.randn(16, 64)
    y = (x.sigmoid() @ w).sum()  # sigmoid's output is saved by the product's backward, reached from y
    saved = key_of(y.grad_fn.next_functions[0][0]._saved_self)  # the product's input (autograd's alone)
    keys = {key_of(t) for t in [*kept, *cache.items, BY_NAME["a"]]} | {saved}
    found = {key: h.label() for key, h in holders.walk(keys, key_of).items()}
    assert found[key_of(kept[0])].endswith(f"test_holders.py:{line_of(source, 'kept.append(torch')} "
                                           "(list 'kept', append)")
    assert found[key_of(cache.items[1])].endswith(f"test_holders.py:{line_of(source, 'self.items.append')} "
                                                  "(list 'cache.items', append)")
    assert found[key_of(BY_NAME["a"])] == "global dict 'BY_NAME'", found
    assert found[saved] in ("saved for backward by MmBackward0", "saved for backward by SigmoidBackward0"), found
    assert len(found) == 6, found


def test_an_optimizers_states_are_named_by_the_optimizer_and_the_states():
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    keys = {key_of(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0}  # no list holds them
    found = holders.walk(keys, key_of)
    assert {h.label() for h in found.values()} == {"AdamW's state (exp_avg, exp_avg_sq)"}, found
    assert len(found) == 4  # exp_avg and exp_avg_sq of the weight and of the bias


def test_a_storage_nothing_of_the_users_holds_is_not_named():
    lost = [torch.randn(8, 8)]
    key = key_of(lost[0])
    holder = lost.pop()  # noqa: F841 - held by a local: named
    assert holders.walk({key}, key_of)[key].what == "local 'holder'"
    del holder
    assert holders.walk({key}, key_of) == {}


class _Placeholder(type):
    """As transformers' placeholder classes for a library not installed (``DummyObject``): any public
    attribute asked of them raises ImportError."""

    def __getattribute__(cls, key):
        if not key.startswith("_"):
            raise ImportError(f"{type.__getattribute__(cls, '__name__')} requires a library not installed")
        return super().__getattribute__(key)


class NeedsALibrary(metaclass=_Placeholder):
    pass


def test_an_object_whose_attributes_raise_is_passed_over_and_the_rest_still_named():
    """transformers' placeholders in a user's globals crashed the fake GPU's walk at the job's first
    CUDA tensor (ImportError from ``getattr(value, "state")``): GPT-2, Llama, BERT from transformers 5."""
    held = [torch.randn(8, 8)]
    placeholder = NeedsALibrary  # noqa: F841 - a local of the user's frame, as a module's global would be
    key = key_of(held[0])
    assert holders.walk({key}, key_of)[key].what == "list 'held'"


def test_a_walk_reads_what_a_node_holds_without_running_the_saved_tensor_hooks():
    """Activation checkpointing packs a node's saved tensors with hooks whose unpacking recomputes the
    forward: a walk that unpacked them ran the recomputation mid-step (BERT under FSDP1 crashed, its
    flat parameters' storage of another unit's size). Unhooked saved tensors are still named."""
    from torch.utils.checkpoint import checkpoint

    calls = []
    lin = torch.nn.Linear(64, 64)

    def block(t):
        calls.append(1)
        return lin(t).sigmoid()

    x = torch.randn(16, 64, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    plain = lin(x).exp().sum()  # unhooked: exp's output is held by ExpBackward0 alone
    held = key_of(plain.grad_fn.next_functions[0][0]._raw_saved_result.data)  # no local keeps it
    found = holders.walk({key_of(y), held}, key_of)
    assert calls == [1], "the walk recomputed the checkpointed forward"
    assert found[held].what == "saved for backward by ExpBackward0", found
    y.sum().backward()  # the checkpoint still recomputes in backward, once
    assert calls == [1, 1]


def test_a_walk_leaves_nothing_alive_that_the_job_dropped():
    tensor = torch.randn(8, 8)
    key, gone = key_of(tensor), weakref.ref(tensor)
    assert holders.walk({key}, key_of)[key].what == "local 'tensor'"
    tensor = None  # a frame's f_locals snapshot (Python < 3.13) kept it alive: a fake-GPU peak 1 GiB high
    assert gone() is None


def test_the_largest_holder_of_a_site_reads_first_and_a_growth_line_names_it_before_the_allocation():
    stack = [("forward", "/proj/model.py", 59), ("train", "/proj/train.py", 60)]
    other = [("forward", "/proj/model.py", 59), ("evaluate", "/proj/train.py", 80)]
    (site,) = with_holders([Site("/proj/model.py:59", "forward", mib=200.0, count=5)],
                           [(stack, 100 << 20, "train.py:63 (list 'kept', append)")] * 4
                           + [(other, 50 << 20, "train.py:81 (dict 'seen', setitem)")])
    assert site.kept_alive_by() == "train.py:63 (list 'kept', append; 4 tensors)"
    change = SiteChange(site.label(), 0.0, 450.0, kept_alive_by=site.kept_alive_by())
    assert change.line() == ("+450.0 MiB  kept alive by train.py:63 (list 'kept', append; 4 tensors), "
                             "allocated at /proj/model.py:59 forward  (new)")
    assert SiteChange(site.label(), 0.0, 450.0).line() == "+450.0 MiB  /proj/model.py:59 forward  (new)"


def test_a_walk_is_taken_as_the_peak_grows_by_a_step_and_within_its_share_of_the_time():
    live = {1: 4 << 20}
    watch = holders.PeakWatch(1 << 20, lambda: live, lambda value: None)
    watch.grew(1000)
    watch.grew(1005)  # under the step: no walk
    assert watch.walks == 1
    watch.spent_s = 1e9  # over its share of the time: no walk however far the peak moves
    watch.grew(10_000)
    assert watch.walks == 1


KEEP_JOB = '''
import os

import pytest
import torch
import torch.distributed as dist

MiB = 2**20


def steps(model, keep):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = []
    for _ in range(4):
        x = torch.randn(256, 512, device=torch.cuda.current_device())
        logits = model(x)
        loss = logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if keep:
            kept.append(logits.detach())
    return kept


def fsdp_rank():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    return device


@pytest.mark.gpumem(nproc=1, device="gpu", fake_gpu="on")
def test_one_rank():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16384)).cuda()
    steps(model, os.environ.get("KEEP") == "1")


@pytest.mark.gpumem(nproc=2, device="gpu", fake_gpu="on")
def test_fsdp2():
    from torch.distributed.fsdp import fully_shard

    device = fsdp_rank()
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16384))
    model.to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    steps(model, os.environ.get("KEEP") == "1")
    dist.destroy_process_group()


@pytest.mark.gpumem(nproc=2, device="gpu", fake_gpu="on")
def test_reshard():
    from torch.distributed.fsdp import fully_shard

    device = fsdp_rank()
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).to(device)
    for layer in model:
        fully_shard(layer, reshard_after_forward=os.environ.get("KEEP") != "1")
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        model(torch.randn(64, 2048, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.torch
def test_the_keep_logits_twins_fail_naming_the_append_and_a_kept_unsharded_fsdp_names_its_setting(pytester,
                                                                                                 monkeypatch):
    path = pytester.makepyfile(test_keep=textwrap.dedent(KEEP_JOB))
    job = path.read_text()
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("KEEP", "0")
    pytester.runpytest_subprocess("--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider",
                                  timeout=600).assert_outcomes(passed=3)
    monkeypatch.setenv("KEEP", "1")
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(failed=3)
    text = result.stdout.str()
    # 4 steps' logits of 256 x 16384 fp32, 16 MiB each: beyond the allocator's tolerance (max(0.5%, 16 MiB))
    append, forward = line_of(job, "kept.append("), line_of(job, "logits = model(x)")
    for test in ("test_one_rank", "test_fsdp2"):
        block = text[text.index(f"_ {test} _"):]
        first = next(line.strip() for line in block.splitlines() if " MiB  " in line)
        wanted = (rf"\+\d+\.\d MiB  kept alive by test_keep.py:{append} \(list 'kept', append; [2-4] tensors\), "
                  rf"allocated at test_keep.py:{forward} steps \(forward\)")  # the list's length at the walk
        assert re.fullmatch(wanted, first), block[:3000]
    # reshard_after_forward=False: six 16 MiB layers' unsharded parameters live together after forward
    block = text[text.index("_ test_reshard _"):]
    wanted = "kept alive by FSDP2's unsharded parameters kept after forward (reshard_after_forward=False on '0'"
    assert wanted in block, block[:3000]
