"""Peak sites: stacks folded to the user's line, grouped, compared; torch's allocator history
replayed to its peak. Plain data in, plain data out (the captures' own readers are exercised by
the launches in test_sites_launch.py and on the GPU machine)."""

from __future__ import annotations

import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

from pytest_gpumem.judging.growth import site_growth, steady, stored_sites
from pytest_gpumem.sampling import MiB
from pytest_gpumem.sampling.sites import NATIVE, Site, fold, from_dicts, group, is_internal, memray_sites, thin
from pytest_gpumem.sampling.torch_history import replay

ROOT = Path("/proj")
TORCH = sysconfig.get_paths()["purelib"] + "/torch/distributed/distributed_c10d.py"
STDLIB = sysconfig.get_paths()["stdlib"] + "/threading.py"


def test_a_stack_folds_to_its_innermost_user_frame_with_the_framework_call_under_it():
    stack = [("_all_gather_base", TORCH, 3000), ("wrapper", TORCH, 80), ("all_gather", TORCH, 2900),
             ("wrapper", TORCH, 80), ("_all_gather", "/proj/examples/test_ddp.py", 57),
             ("_train", "/proj/examples/test_ddp.py", 70)]
    site = fold(stack, ROOT)
    assert site == Site("examples/test_ddp.py:57", "_all_gather", "all_gather")
    assert site.label() == "examples/test_ddp.py:57 _all_gather (all_gather)"
    assert not site.internal


def test_a_call_intercepted_by_a_mode_is_not_named_after_the_mode():
    """Megatron's gathered gradients on a simulated rank read "(__torch_function__)": the stand-in's mode
    caught ``torch.empty``, a builtin with no frame of its own. Neither a mode nor the plugin is the call."""
    plugin = str(Path(fold.__code__.co_filename).resolve().parents[1] / "rankside" / "received.py")
    stack = [("__torch_function__", plugin, 201), ("megatron_job", "/proj/test_megatron.py", 51)]
    assert fold(stack, ROOT) == Site("test_megatron.py:51", "megatron_job", "")
    dtensor = [("__torch_dispatch__", TORCH, 10), ("redistribute", TORCH, 20), ("step", "/proj/t.py", 5)]
    assert fold(dtensor, ROOT).detail == "redistribute"


def test_a_comprehension_frame_is_named_after_the_function_around_it():
    stack = [("<listcomp>", "/proj/job.py", 7), ("small", "/proj/job.py", 7)]
    assert fold(stack, ROOT) == Site("job.py:7", "small", "")


def test_a_stack_without_user_code_is_internal_and_without_python_is_native():
    assert fold([("run", STDLIB, 10)], ROOT).internal
    native = fold([], ROOT, thread="_VM::Worker")
    assert native.where == NATIVE and native.internal and native.detail == "_VM::Worker"


def test_internal_means_installed_standard_or_the_plugin_itself():
    assert is_internal(TORCH) and is_internal(STDLIB) and is_internal("<frozen importlib._bootstrap>")
    assert is_internal(str(Path(__file__).parents[3] / "pytest_gpumem" / "plugin.py"))
    assert not is_internal("/proj/examples/test_ddp.py")


def test_sites_are_grouped_summed_ranked_and_the_framework_summarised():
    user = [("step", "/proj/t.py", 9)]
    records = [
        (user, 100 * MiB, 1, ""), (user, 28 * MiB, 3, ""),  # one site, two records
        ([("f", "/proj/t.py", 3)], 64 * MiB, 1, ""),
        ([("run", STDLIB, 1)], 5 * MiB, 2, ""), ([("run", STDLIB, 2)], 6 * MiB, 1, ""),
        ([], 7 * MiB, 4, "worker"),
        ([("tiny", "/proj/t.py", 1)], 0.1 * MiB, 1, ""),  # under MIN_SITE_MIB: dropped
    ]
    sites = group(records, ROOT)
    assert [(s.label(), round(s.mib), s.count) for s in sites] == [
        ("t.py:9 step", 128, 4), ("t.py:3 f", 64, 1), ("(framework internals)", 11, 3), (NATIVE, 7, 4)]
    assert [s.internal for s in sites] == [False, False, True, True]


def test_thinning_keeps_every_peak():
    points = [(float(i), float(i % 7)) for i in range(1000)] + [(1000.0, 99.0)]
    thinned = thin(points, 50)
    assert len(thinned) <= 51 and max(v for _, v in thinned) == 99.0


def test_a_real_memray_capture_names_the_lines(tmp_path):
    memray = pytest.importorskip("memray")
    path = tmp_path / "capture.bin"
    with memray.Tracker(path, native_traces=False, follow_fork=False,
                        file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
        held = _allocate_big()
        small = _allocate_small()
        del held, small
    sites = {s.function: s for s in memray_sites(path, Path(__file__).parent)}
    assert round(sites["_allocate_big"].mib) == 100 and sites["_allocate_big"].where.startswith("test_sites.py:")
    assert round(sites["_allocate_small"].mib) == 10 and sites["_allocate_small"].count == 10


def _allocate_big() -> bytearray:
    return bytearray(100 * MiB)


def _allocate_small() -> list[bytearray]:
    return [bytearray(MiB) for _ in range(10)]


# -------------------------------------------------------------------------------- growth


def site(where: str, mib: float, function: str = "f", internal: bool = False) -> Site:
    return Site(where, function, "", mib, 1, internal)


def test_growth_lists_what_grew_largest_first_and_sums_the_rest():
    one = [site("t.py:5", 128.0, "batch"), site("t.py:9", 20.0, "model"), site("t.py:12", 4.0, "tmp"),
           site("(framework internals)", 10.0, "", True)]
    eight = [site("t.py:57", 256.0, "gather"), site("t.py:5", 128.0, "batch"), site("t.py:9", 21.0, "model"),
             site("t.py:20", 3.0, "opt"), site("(framework internals)", 14.5, "", True)]
    grown = site_growth(one, eight, "nproc=1")
    assert grown.lines() == [
        "+256.0 MiB  t.py:57 gather  (new)",
        "+3.0 MiB  t.py:20 opt  (new)",
        "(1 smaller site +1.0 MiB; 1 site shrank by 4.0 MiB; framework internals and allocations under 4 KiB +4.5 MiB)",
    ]


def test_against_a_baseline_that_kept_only_its_top_sites_a_missing_site_is_not_called_new():
    stored = [site("t.py:5", 128.0), site("t.py:9", 40.0)]
    now = [site("t.py:5", 128.0), site("t.py:9", 40.0), site("t.py:30", 42.0, "g")]
    grown = site_growth(stored, now, "the baseline", old_complete=False)
    assert [c.line() for c in grown.grown] == ["+2.0 MiB  t.py:30 g"]  # it may have been just below 40


def test_a_site_whose_line_moved_with_an_edit_above_it_is_the_same_site():
    """A docstring grew by 9 lines after the baseline was recorded: the batch is still the batch,
    not a new site beside a shrunk one; a second candidate in the same function is ambiguous."""
    stored = [site("t.py:55", 258.0, "_train"), site("t.py:29", 11.8, "<module>")]
    now = [site("t.py:64", 258.4, "_train"), site("t.py:38", 11.8, "<module>")]
    assert site_growth(stored, now, "the baseline").lines() == ["(1 smaller site +0.4 MiB)"]
    grew = [site("t.py:64", 386.0, "_train"), site("t.py:38", 11.8, "<module>")]
    assert site_growth(stored, grew, "the baseline").lines()[0] == "+128.0 MiB  t.py:64 _train"
    two = [site("t.py:64", 258.0, "_train"), site("t.py:70", 64.0, "_train")]
    stored_two = [site("t.py:55", 258.0, "_train"), site("t.py:61", 64.0, "_train")]
    assert [c.line() for c in site_growth(stored_two, two, "the baseline").grown] == [
        "+258.0 MiB  t.py:64 _train  (new)", "+64.0 MiB  t.py:70 _train  (new)"]


def test_a_refresh_within_noise_rewrites_no_site():
    old = stored_sites([site("t.py:5", 128.04), site("t.py:9", 40.0)])
    rerun = stored_sites([site("t.py:5", 128.9), site("t.py:9", 47.0)])
    kept = steady(old, rerun)
    assert [s["mib"] for s in kept] == [128.0, 47.0]  # the first moved by noise, the second by 7 MiB


# -------------------------------------------------------------------------------- torch history


def frames(*names: str) -> list[dict]:
    return [{"filename": "/proj/job.py", "line": i + 1, "name": n} for i, n in enumerate(names)]


def snapshot(events: list[tuple[str, int, int, float, str]], live: list[tuple[int, int, str]]) -> dict:
    """torch's shape: ``segments[].blocks`` live now, ``device_traces[0]`` the events."""
    return {
        "segments": [{"device": 0, "blocks": [
            {"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
             "frames": frames(name)} for addr, size, name in live]
            + [{"address": 999, "size": 4096, "requested_size": 4096, "state": "inactive", "frames": []}]}],
        "device_traces": [[{"action": action, "addr": addr, "size": size, "time_us": t * 1e6,
                            "frames": frames(name)} for action, addr, size, t, name in events]],
    }


def test_replay_finds_the_allocators_peak_and_the_blocks_in_it():
    mib = MiB
    events = [
        ("alloc", 1, 100 * mib, 1.0, "weights"),
        ("alloc", 2, 300 * mib, 2.0, "activations"),
        ("free_requested", 2, 300 * mib, 3.0, "activations"),  # freed: the peak was before
        ("free_completed", 2, 300 * mib, 3.5, "activations"),  # not counted: allocated moves at request
        ("alloc", 3, 50 * mib, 4.0, "grads"),
    ]
    found = replay(snapshot(events, live=[(1, 100 * mib, "weights"), (3, 50 * mib, "grads")]))
    assert found.peak_bytes == 400 * mib and found.peak_time_s == 2.0
    assert sorted((f[0][0], size // mib) for f, size in found.blocks) == [("activations", 300), ("weights", 100)]
    assert [round(v) for _, v in found.timeline] == [100, 400, 100, 150]


def test_blocks_from_before_the_window_count_from_the_live_set_and_their_frees():
    mib = MiB
    # the ring kept only the last events: block 7 was allocated before the window and freed in it
    events = [("free_requested", 7, 200 * mib, 5.0, "old"), ("alloc", 8, 10 * mib, 6.0, "new")]
    found = replay(snapshot(events, live=[(5, 30 * mib, "resident"), (8, 10 * mib, "new")]))
    assert found.peak_bytes == 230 * mib
    assert sorted(f[0][0] for f, _ in found.blocks) == ["old", "resident"]


def test_what_happens_after_the_body_is_not_its_peak():
    mib = MiB
    events = [("alloc", 1, 100 * mib, 1.0, "body"), ("free_requested", 1, 100 * mib, 2.0, "body"),
              ("alloc", 2, 500 * mib, 3.0, "teardown")]
    found = replay(snapshot(events, live=[(2, 500 * mib, "teardown")]), until_s=2.5)
    assert found.peak_bytes == 100 * mib and [f[0][0] for f, _ in found.blocks] == ["body"]


def test_a_site_carries_the_user_frames_above_it_shown_never_compared():
    """The newcomer's case: ``return self.head(x)`` allocates the logits, the training loop's list
    keeps them. The site is the allocating line; its callers (framework frames skipped) come with it."""
    linear = sysconfig.get_paths()["purelib"] + "/torch/nn/modules/linear.py"
    module = sysconfig.get_paths()["purelib"] + "/torch/nn/modules/module.py"
    stack = [("forward", linear, 125), ("_call_impl", module, 1750), ("forward", "/proj/tinylm/model.py", 18),
             ("_call_impl", module, 1750), ("train", "/proj/train.py", 25), ("test_train", "/proj/test_lm.py", 9),
             ("pytest_pyfunc_call", STDLIB, 1)]
    site = fold(stack, ROOT)
    assert site == Site("tinylm/model.py:18", "forward", "forward")  # the identity of before
    assert site.callers == ("train.py:25 train", "test_lm.py:9 test_train")
    assert site.called_from() == ["called from train.py:25 train", "called from test_lm.py:9 test_train"]
    # one site, two chains: the larger one is shown, the other counted
    other = [*stack[:4], ("evaluate", "/proj/train.py", 40)]
    grouped = group([(stack, 64 * MiB, 4, ""), (other, 8 * MiB, 1, "")], ROOT)
    assert [(s.label(), s.callers, s.chains) for s in grouped] == [
        ("tinylm/model.py:18 forward (forward)", ("train.py:25 train", "test_lm.py:9 test_train"), 2)]
    assert grouped[0].called_from()[-1] == "called from test_lm.py:9 test_train (and 1 other call chain)"
    # the chain travels in a rank's report, not into a baseline; a baseline's site matches it as before
    assert from_dicts([grouped[0].as_dict()])[0].callers == grouped[0].callers
    stored = stored_sites(grouped)
    assert set(stored[0]) == {"where", "function", "detail", "mib", "count", "internal"}
    grown = site_growth(from_dicts(stored), [replace(grouped[0], mib=136.0)], "the baseline")
    assert grown.lines() == ["+64.0 MiB  tinylm/model.py:18 forward (forward)",
                             "             called from train.py:25 train",
                             "             called from test_lm.py:9 test_train (and 1 other call chain)"]


def test_a_comprehension_in_a_caller_is_named_once():
    stack = [("forward", "/proj/m.py", 5), ("<listcomp>", "/proj/t.py", 9), ("step", "/proj/t.py", 9),
             ("main", "/proj/t.py", 20)]
    assert fold(stack, ROOT).callers == ("t.py:9 step", "t.py:20 main")


def test_a_gpu_site_from_the_allocator_history_carries_its_callers_too():
    """torch's history gives each block its Python stack (innermost first): the same folding, so a GPU
    site shows the caller that keeps its blocks, as a host site does."""
    mib = MiB
    stack = [{"filename": sysconfig.get_paths()["purelib"] + "/torch/nn/modules/linear.py", "line": 125,
              "name": "forward"},
             {"filename": "/proj/tinylm/model.py", "line": 18, "name": "forward"},
             {"filename": "/proj/train.py", "line": 25, "name": "train"}]
    shot = {"segments": [{"device": 0, "blocks": [{"address": 1, "size": 64 * mib, "requested_size": 64 * mib,
                                                   "state": "active_allocated", "frames": stack}]}],
            "device_traces": [[]]}
    found = replay(shot)
    sites = group([(frames_, size, 1, "") for frames_, size in found.blocks], ROOT)
    assert [(s.label(), s.callers) for s in sites] == [("tinylm/model.py:18 forward (forward)", ("train.py:25 train",))]


def test_the_chain_stops_where_the_project_ends(tmp_path):
    """A rank forked from a pytest that runs pytest in-process (pytester) has the outer harness's
    frames above the test: they are not the user's chain, and their paths are not the project's."""
    project, harness = tmp_path / "project", tmp_path / "harness"
    stack = [("forward", str(project / "model.py"), 10), ("train", str(project / "test_lm.py"), 12),
             ("_run", str(harness / "test_outer.py"), 77), ("main", str(project / "test_lm.py"), 30)]
    site = fold(stack, project)
    assert site.where == "model.py:10" and site.callers == ("test_lm.py:12 train",)
