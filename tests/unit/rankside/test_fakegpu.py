"""The fake GPU's plain parts, on real torch CPU objects: the allocator's accounting, the GPU models
and their calibration file, the rules that say where a CUDA kernel allocates what a meta kernel
does not, and the shim's build inputs. Whole fake-GPU launches are tests/test_fake_gpu.py."""

from __future__ import annotations

import gc
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from pytest_gpumem.rankside.fakegpu import models, shim
from pytest_gpumem.rankside.fakegpu.accounting import BLOCK, FakeAllocator, block_bytes
from pytest_gpumem.sampling.torch_history import replay

torch = pytest.importorskip("torch")
MiB = 2**20


def test_blocks_are_rounded_up_to_512_bytes_and_nothing_is_allocated_for_0():
    assert [block_bytes(n) for n in (0, 1, 511, 512, 513, 4 * MiB)] == [0, BLOCK, BLOCK, BLOCK, 2 * BLOCK, 4 * MiB]


def _allocator() -> FakeAllocator:
    return FakeAllocator(cublas_workspace=32 * MiB, cublaslt_workspace=MiB)


def test_a_storage_is_counted_once_whatever_its_views_and_freed_with_its_last_view():
    alloc = _allocator()
    base = torch.empty(1000)  # 4000 bytes -> 4096
    view = base[10:20]
    for tensor in (base, view, base[:5]):
        alloc.track(tensor.untyped_storage(), 0)
    del tensor
    assert alloc.stats(0)["allocated_bytes.all.current"] == 4096
    del base
    gc.collect()
    assert alloc.stats(0)["allocated_bytes.all.current"] == 4096  # the view keeps the block
    del view
    gc.collect()
    assert alloc.stats(0)["allocated_bytes.all.current"] == 0
    assert alloc.stats(0)["allocated_bytes.all.peak"] == 4096


def test_a_storage_resized_in_place_moves_the_figure_as_fsdp_frees_and_regrows_parameters():
    alloc = _allocator()
    tensor = torch.empty(MiB // 4)
    storage = tensor.untyped_storage()
    alloc.track(storage, 0)
    storage.resize_(0)
    alloc.resized(storage)
    assert alloc.stats(0)["allocated_bytes.all.current"] == 0
    storage.resize_(2 * MiB)
    alloc.resized(storage)
    assert alloc.stats(0)["allocated_bytes.all.current"] == 2 * MiB
    assert alloc.stats(0)["allocated_bytes.all.peak"] == 2 * MiB


def test_scratch_inside_an_op_counts_at_the_peak_and_is_gone_after_it():
    alloc = _allocator()
    kept = torch.empty(MiB // 4)
    alloc.track(kept.untyped_storage(), 0)
    alloc.transient(0, 3 * MiB)
    assert alloc.stats(0)["allocated_bytes.all.current"] == MiB
    assert alloc.stats(0)["allocated_bytes.all.peak"] == 4 * MiB


def test_each_thread_takes_the_cublas_workspace_once_and_cublaslt_its_own():
    alloc = _allocator()
    for _ in range(3):
        alloc.workspace("cublas", 0)
    alloc.workspace("cublaslt", 0)
    other = threading.Thread(target=lambda: [alloc.workspace("cublas", 0) for _ in range(2)])
    other.start()
    other.join()
    alloc.workspace("cublas", 1)  # another device, another handle
    assert alloc.stats(0)["allocated_bytes.all.current"] == (32 + 1 + 32) * MiB
    assert alloc.stats(1)["allocated_bytes.all.current"] == 32 * MiB


def test_a_peak_reset_starts_from_what_is_live():
    alloc = _allocator()
    first = torch.empty(MiB)
    alloc.track(first.untyped_storage(), 0)
    del first
    gc.collect()
    alloc.reset_peak(0)
    assert alloc.stats(0)["allocated_bytes.all.peak"] == 0


def test_what_is_reserved_is_the_caching_allocators_segments_per_stream_and_empty_cache_returns_them():
    """The caching allocator's policy, replayed as the fake storages come and go (sampling.caching_allocator):
    small requests share a 2 MiB segment, 1-10 MiB ones take 20 MiB, a freed block is cached, another
    stream's block comes from that stream's pool, ``empty_cache`` releases what is cached."""
    alloc = _allocator()
    small = [torch.empty(1024) for _ in range(3)]  # 4 KiB each
    for tensor in small:
        alloc.track(tensor.untyped_storage(), 0)
    assert alloc.stats(0)["reserved_bytes.all.current"] == 2 * MiB
    mid = torch.empty(MiB)  # 4 MiB
    alloc.track(mid.untyped_storage(), 0)
    assert alloc.stats(0)["reserved_bytes.all.current"] == 22 * MiB
    del mid
    gc.collect()
    assert alloc.stats(0)["reserved_bytes.all.current"] == 22 * MiB  # cached, not returned
    alloc.stream_of = lambda: 7  # another stream's pool: the cached 20 MiB segment is not its
    other = torch.empty(MiB)
    alloc.track(other.untyped_storage(), 0)
    assert alloc.stats(0)["reserved_bytes.all.current"] == 42 * MiB
    assert alloc.stats(0)["reserved_bytes.all.peak"] == 42 * MiB
    assert alloc.stats(0)["allocated_bytes.all.current"] == 4 * MiB + 3 * 4096
    alloc.empty_cache()
    assert alloc.stats(0)["reserved_bytes.all.current"] == 22 * MiB  # the first 20 MiB returned
    alloc.reset_peak(0)
    assert alloc.stats(0)["reserved_bytes.all.peak"] == 22 * MiB


def test_the_fake_gpus_reserved_figure_runs_with_the_jobs_allocator_settings():
    from pytest_gpumem.sampling.alloc_conf import parse_alloc_conf

    tensor = torch.empty(11 * MiB // 4)  # 11 MiB: a segment of its size rounded to 2 MiB, or a 20 MiB page
    for conf, reserved in (("", 12 * MiB), ("expandable_segments:True", 20 * MiB)):
        alloc = FakeAllocator(32 * MiB, MiB, parse_alloc_conf(conf))
        alloc.track(tensor.untyped_storage(), 0)
        assert alloc.stats(0)["reserved_bytes.all.current"] == reserved, conf


def test_the_history_replays_to_the_allocator_peak_with_the_allocating_lines():
    """The plugin's own reader of torch's history (sampling.torch_history) takes the fake's unchanged."""
    alloc = _allocator()
    alloc.start_history()
    kept = torch.empty(MiB // 4)
    alloc.track(kept.untyped_storage(), 0)
    alloc.workspace("cublas", 0)
    spike = torch.empty(2 * MiB // 4)
    alloc.track(spike.untyped_storage(), 0)
    del spike
    gc.collect()
    found = replay(alloc.snapshot(), 0)
    assert found.peak_bytes == alloc.stats(0)["allocated_bytes.all.peak"] == (1 + 32 + 2) * MiB
    lines = {frame[2] for frames, size in found.blocks for frame in frames[:1] if size == 2 * MiB}
    assert lines, found.blocks  # the spike's block carries the Python stack that made it


# ------------------------------------------------------------------------------------ GPU models


def test_the_built_in_h200_is_what_gpumem_calibrate_measured_on_the_lent_h200():
    h200 = models.model("NVIDIA H200")
    assert (h200.major, h200.minor, h200.multi_processor_count) == (9, 0, 132)
    assert (h200.cublas_workspace, h200.cublaslt_workspace) == (32 * MiB, MiB)
    assert h200.properties()["total_memory"] == h200.total_memory


def test_the_built_in_h100_is_what_gpumem_calibrate_measured_on_the_lent_h100():
    root = Path(__file__).resolve().parents[3]
    measured = models.read_calibration(root / "benchmarks" / "results" / "device_figure" / models.CALIBRATION_FILE)
    h100, built_in = measured["NVIDIA H100 80GB HBM3"], models.model("NVIDIA H100 80GB HBM3")
    for field in ("major", "minor", "total_memory", "multi_processor_count", "cublas_workspace", "cublaslt_workspace",
                  "outside"):
        assert getattr(built_in, field) == getattr(h100, field), field


def test_an_unknown_model_names_the_known_ones_and_the_command_that_adds_one(tmp_path: Path):
    with pytest.raises(models.CalibrationError) as raised:
        models.model("NVIDIA B300", tmp_path / models.CALIBRATION_FILE)
    text = str(raised.value)
    assert "'NVIDIA B300'" in text and "'NVIDIA H200'" in text and "gpumem calibrate" in text


def test_a_calibrated_model_is_written_beside_the_others_and_wins_over_the_built_in(tmp_path: Path):
    path = tmp_path / models.CALIBRATION_FILE
    h100 = models.GpuModel("NVIDIA H100 80GB HBM3", 9, 0, 85_000_000_000, 132, 32 * MiB, MiB,
                           measured_with={"torch": "2.11.0+cu130"})
    own_h200 = models.GpuModel("NVIDIA H200", 9, 0, 150_000_000_000, 132, 16 * MiB, 0)
    models.write_calibration(path, h100)
    models.write_calibration(path, own_h200)
    assert sorted(json.loads(path.read_text())["models"]) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    found = models.model("NVIDIA H200", path)
    assert (found.cublas_workspace, found.source) == (16 * MiB, models.CALIBRATION_FILE)
    assert models.model("NVIDIA H100 80GB HBM3", path).measured_with == {"torch": "2.11.0+cu130"}


@pytest.mark.parametrize(("text", "says"), [
    ("{", "not a readable JSON calibration file"),
    ('{"schema": 9, "models": {}}', '"schema": 1'),
    ('{"schema": 1, "models": {"X": {"major": "9"}}}', "models['X'].major = '9': expected an integer >= 0"),
    ('{"schema": 1, "models": {"X": {"major": 9, "minor": 0, "total_memory": 1, "multi_processor_count": 1, '
     '"cublas_workspace": -1}}}', "models['X'].cublas_workspace = -1"),
    ('{"schema": 1, "models": {"X": {"major": 9, "minor": 0, "total_memory": 1, "multi_processor_count": 1, '
     '"cublas_workspace": 1, "cublaslt_workspace": 1, "outside": {"kernels": 5}}}}',
     "models['X'].outside = {'kernels': 5}: expected an object from context, cublas, cudnn, attention, nccl"),
])
def test_a_broken_calibration_file_names_itself_and_the_field(tmp_path: Path, text: str, says: str):
    path = tmp_path / models.CALIBRATION_FILE
    path.write_text(text)
    with pytest.raises(models.CalibrationError) as raised:
        models.model("NVIDIA H200", path)
    assert str(path) in str(raised.value) and says in str(raised.value)


def test_the_device_figure_adds_to_the_reserved_peak_the_calibrated_parts_the_job_used(tmp_path: Path):
    from pytest_gpumem.rankside.fakegpu.device import predict_device

    outside = {"context": 500 * MiB, "cublas": 100 * MiB, "cudnn": 200 * MiB, "attention": 30 * MiB,
               "nccl": 300 * MiB}
    h100 = models.GpuModel("NVIDIA H100 80GB HBM3", 9, 0, 80 * 1024 * MiB, 132, 32 * MiB, MiB, outside=outside)
    path = tmp_path / models.CALIBRATION_FILE
    models.write_calibration(path, h100)
    h100 = models.model("NVIDIA H100 80GB HBM3", path)  # the parts outside survive the file
    assert h100.outside == outside
    found = predict_device(h100, 1000.0, {"cublas", "nccl"})
    assert found == {"gpu": "NVIDIA H100 80GB HBM3", "capacity_mib": 81920.0,
                     "parts_mib": {"reserved": 1000.0, "context": 500.0, "cublas": 100.0, "nccl": 300.0}}
    assert predict_device(h100, 1000.0, {"cudnn"})["parts_mib"] == {
        "reserved": 1000.0, "context": 500.0, "cudnn": 200.0}  # no collective, no communicator
    assert predict_device(models.GpuModel("X", 9, 0, 1, 1, 0, 0), 1000.0, {"cublas"}) is None


def test_a_predicted_device_figure_says_whether_it_fits_and_by_how_much():
    from pytest_gpumem.sampling import DeviceEstimate

    fits = DeviceEstimate((("reserved", 61440.0), ("context", 1228.8)), "NVIDIA H100 80GB HBM3", 81510.4)
    assert fits.fit() == "fits NVIDIA H100 80GB HBM3: 61.2 of 79.6 GiB, margin 18.4 GiB"
    assert fits.sum_text() == "reserved 61440.0 + context 1228.8 MiB"
    over = DeviceEstimate((("reserved", 81000.0), ("context", 1024.0)), "NVIDIA H100 80GB HBM3", 81510.4)
    assert over.fit() == "does not fit NVIDIA H100 80GB HBM3: 80.1 of 79.6 GiB, 0.5 GiB over"


# ------------------------------------------------------------------------------------ CUDA's own allocations


def test_cublas_copies_an_operand_it_cannot_read_in_place():
    from pytest_gpumem.rankside.fakegpu.mends.cublas import _cublas_copies

    matrix = torch.empty(64, 32)
    assert not _cublas_copies(matrix)
    assert not _cublas_copies(matrix.t())  # a transpose is read as is
    assert not _cublas_copies(matrix[:, :16])  # a strided view with a leading stride
    assert _cublas_copies(torch.ones(()).expand(64, 32))  # an expanded gradient (the sum's): cloned
    assert _cublas_copies(matrix[::2, ::2])


def _sdpa_grid() -> tuple[Any, dict[str, str]]:
    """The grid of attention calls (benchmarks/gpu/sdpa_choice.py) and the kernel an H100 with torch
    2.11 chose for each (benchmarks/results/sdpa_choice_gpu.json)."""
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("sdpa_choice", root / "benchmarks" / "gpu" / "sdpa_choice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chosen = json.loads((root / "benchmarks" / "results" / "sdpa_choice_gpu.json").read_text())["grid"]
    return module, chosen


SDPA_GRID, SDPA_CHOSEN = _sdpa_grid()


@pytest.mark.parametrize("case", sorted(SDPA_CHOSEN))
def test_attention_takes_the_kernel_the_gpu_took(case: str):
    from pytest_gpumem.rankside.fakegpu.mends.attention import sdp_choice as _sdp_choice

    query, key, value, mask, dropout, causal, gqa = SDPA_GRID.grid("cpu")[case]
    choice = _sdp_choice(torch, models.model("NVIDIA H200"), query, key, value, mask, dropout, causal, gqa)
    assert SDPA_GRID.BACKENDS[choice] == SDPA_CHOSEN[case]


@pytest.mark.parametrize(("shape", "dims", "mib"), [
    ((1024, 2048), [0], 16.0),  # the MoE's bias gradient: the H100's 16 MiB staging block (fake_gpu_peak_stacks.txt)
    ((1024, 512), [0], 4.0),
    ((1024, 2048), [1], 0.0),  # along the innermost dimension: a value per output and block, not counted
    ((1024, 2048), None, 0.0),  # to one value: the same
    ((8, 2048), [0], 0.0),  # few inputs a thread: no split across blocks
])
def test_a_reduction_that_splits_its_inputs_across_blocks_stages_them_as_the_gpu_does(shape, dims, mib):
    from pytest_gpumem.rankside.fakegpu.mends.kernel_scratch import KERNEL_SCRATCH

    h100 = models.GpuModel(name="H100", major=9, minor=0, total_memory=80 << 30, multi_processor_count=132,
                           cublas_workspace=32 * MiB, cublaslt_workspace=MiB)
    staged = KERNEL_SCRATCH["sum"](h100, (torch.empty(shape), dims), {})
    assert staged // MiB == mib and staged % MiB < 4096  # and the semaphores: 4 bytes a block of outputs


@pytest.mark.parametrize(("kernel", "mib"), [("cudnn", 18.76), ("efficient", 24.29)])
def test_attention_backward_keeps_dq_in_float32_as_the_h100_did(kernel: str, mib: float):
    """ViT-B/16's call: 18.76 and 24.31 MiB above its gradients on the H100 (sdpa_choice.txt)."""
    from pytest_gpumem.rankside.fakegpu.mends.kernel_scratch import KERNEL_SCRATCH

    query = torch.empty(32, 12, 197, 64, dtype=torch.bfloat16)
    rule = KERNEL_SCRATCH[f"_scaled_dot_product_{kernel}_attention_backward"]
    assert round(rule(models.model("NVIDIA H200"), (query, query), {}) / MiB, 2) == mib
    assert KERNEL_SCRATCH["_scaled_dot_product_efficient_attention_backward"](
        models.model("NVIDIA H200"), (query.float(), query.float()), {}) == 0  # float32's: not modelled


# ------------------------------------------------------------------------------------ the shim


def test_the_shim_is_built_for_torch_cpu_builds_and_for_cuda_builds_without_a_driver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert shim.torch_build(tmp_path) == ("2.13.0+cpu", None) and shim.needed(tmp_path)
    (tmp_path / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    assert shim.torch_build(tmp_path) == ("2.11.0+cu130", "13.0")
    monkeypatch.setattr(shim, "driver_present", lambda: True)
    assert not shim.needed(tmp_path)  # the CUDA build's own guard and hooks
    monkeypatch.setattr(shim, "driver_present", lambda: False)
    assert shim.needed(tmp_path)  # they would ask a driver that is not there


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU node: the driver is there")
def test_a_machine_without_a_gpu_node_has_no_driver_for_the_shim():
    assert not shim.driver_present()


def test_the_shim_is_compiled_for_the_cxx_standard_torch_says(tmp_path: Path):
    cmake = tmp_path / "share" / "cmake" / "Torch"
    cmake.mkdir(parents=True)
    assert shim._config_flags(tmp_path) == ["-std=c++17"]  # noqa: SLF001 - no config: the default
    (cmake / "TorchConfig.cmake").write_text("set_property(TARGET torch PROPERTY\n    CXX_STANDARD 20\n)\n"
                                             'set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")\n')
    assert shim._config_flags(tmp_path) == ["-std=c++20", "-D_GLIBCXX_USE_CXX11_ABI=1"]  # noqa: SLF001


def test_without_a_compiler_the_shim_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(shim.ShimError, match=r"no C\+\+ compiler was found: install one \(apt-get install g\+\+\)"):
        shim.compiler()


def test_each_mend_is_registered_once_acts_somewhere_and_names_what_needs_it_as_it_exists():
    """The registry is the list of the fake GPU's mends: a mend that arms nothing, or that names an
    idiom or a test that is gone, says nothing true."""
    import re

    from pytest_gpumem.rankside.fakegpu.mends import MENDS

    tests_dir = Path(__file__).resolve().parents[2]
    idioms = set(re.findall(r"^def ([a-z0-9_]+)\(\) -> None:", (tests_dir / "idioms.py").read_text(), re.M))
    names = [mend.name for mend in MENDS]
    assert len(names) == len(set(names)), names
    for mend in MENDS:
        assert mend.on_import or mend.after_op, mend.name
        named = re.findall(r"\bidioms? ((?:[a-z0-9_]+(?:, )?)+)", mend.needed_by)
        for idiom in (n.strip() for group in named for n in group.split(",")):
            assert idiom in idioms, f"{mend.name}: needed by idiom {idiom!r}, which tests/idioms.py does not have"
        for test_file in re.findall(r"tests/[a-z_/]+\.py", mend.needed_by):
            assert (tests_dir.parent / test_file).is_file(), f"{mend.name}: {test_file} is gone"
        assert "idiom" in mend.needed_by or "tests/" in mend.needed_by, f"{mend.name}: needed by what?"
