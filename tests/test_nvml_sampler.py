"""The NVML sampler against a scripted fake driver: each scenario is a failure seen in the wild."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_nvml import RAW_NOT_AVAILABLE, Acct, FakeGpu, FakeNvml, NVMLError_NotSupported, Snap, uuid

from pytest_gpumem.sampling import Peak
from pytest_gpumem.sampling import nvml as nvml_module
from pytest_gpumem.sampling.nvml import GpuDevice, NvmlSampler, foreign_processes, visible_gpus

FAST = 0.0005  # seconds between ticks: each scripted snapshot is served once whatever the pace
NA = Peak(None, "not available")
V3 = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v3")


def run(fake: FakeNvml, pids: dict[int, int], devices: list[GpuDevice] | None = None,
        env: dict[str, str] | None = None) -> NvmlSampler:
    """Sample the whole script: ranks registered, start, wait for the last snapshot, stop."""
    if devices is None:
        devices = visible_gpus(env={} if env is None else env, nvml=fake)
    sampler = NvmlSampler(devices, interval_s=FAST, nvml=fake)
    for rank, pid in pids.items():
        sampler.add_process(rank, pid)
    sampler.start()
    wait_until_script_done(fake, devices)
    sampler.stop()
    assert fake.init_count == 0, "nvmlInit / nvmlShutdown are not balanced"
    return sampler


def wait_until_script_done(fake: FakeNvml, devices: list[GpuDevice]) -> None:
    used = [g for g in fake.gpus if g.uuid in {d.uuid for d in devices}]
    deadline = time.monotonic() + 3
    while not all(g.done for g in used):
        assert time.monotonic() < deadline, "the sampler stopped walking through the script"
        time.sleep(0.001)


def series(sampler: NvmlSampler, rank: int) -> list[float]:
    return [row[rank] for _, row in sampler.timeline() if rank in row]


def test_pid_vanished_between_samples_keeps_its_peak():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(520, {100: 512}), Snap(910, {100: 900}), Snap(8)])
    sampler = run(FakeNvml([gpu]), {0: 100})
    assert sampler.peaks() == {0: Peak(900.0, "per-pid sampled")}
    assert series(sampler, 0) == [512.0, 900.0]
    assert sampler.problems == []


def test_metric_not_supported_is_not_available_not_zero():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(700, {100: 690})],
                  fail={"processes": NVMLError_NotSupported, "memory": NVMLError_NotSupported})
    sampler = run(FakeNvml([gpu]), {0: 100})
    assert sampler.peaks() == {0: NA}
    assert sampler.timeline() == []
    assert any("process list not available: NotSupported" in p for p in sampler.problems)
    assert any("device memory not available: NotSupported" in p for p in sampler.problems)


def test_device_memory_not_supported_still_samples_per_pid():
    """MIG containers refuse memory info (NoPermission); the process list may still work."""
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(700, {100: 690})], fail={"memory": NVMLError_NotSupported})
    fake = FakeNvml([gpu])
    (device,) = visible_gpus(env={}, nvml=fake)
    assert math.isnan(device.total_mib)
    assert run(fake, {0: 100}, devices=[device]).peaks() == {0: Peak(690.0, "per-pid sampled")}


def test_process_list_v3_missing_falls_back_to_v2():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(300, {100: 300}), Snap(900, {100: 900}), Snap(0)])
    fake = FakeNvml([gpu], missing=V3)
    sampler = run(fake, {0: 100})
    assert sampler.peaks() == {0: Peak(900.0, "per-pid sampled")}
    assert fake.calls.count("nvmlDeviceGetComputeRunningProcesses") == 1, "v3 probed more than once"
    assert fake.calls.count("nvmlDeviceGetComputeRunningProcesses_v2") >= 4


def test_process_list_v2_missing_falls_back_to_the_v1_struct():
    snaps = [Snap(0), Snap(1000, {100: 640, 101: None}), Snap(1000, {100: 700}), Snap(0)]
    fake = FakeNvml([FakeGpu(uuid(1), snaps), FakeGpu(uuid(2))],
                    missing=V3 + ("nvmlDeviceGetComputeRunningProcesses_v2",))
    sampler = run(fake, {0: 100, 1: 101})
    assert sampler.peaks() == {0: Peak(700.0, "per-pid sampled"), 1: NA}
    assert "nvmlDeviceGetComputeRunningProcesses(v1 C)" in fake.calls
    assert fake.calls.count("nvmlDeviceGetComputeRunningProcesses_v2") == 1  # once per launch


def test_no_process_list_at_all_is_reported_not_hidden():
    fake = FakeNvml([FakeGpu(uuid(1), [Snap(0), Snap(900, {100: 900})])],
                    missing=V3 + ("nvmlDeviceGetComputeRunningProcesses_v2",
                                  "nvmlDeviceGetComputeRunningProcesses"))
    sampler = NvmlSampler(visible_gpus(env={}, nvml=fake), interval_s=FAST, nvml=fake)
    sampler.add_process(0, 100)
    sampler.start()
    time.sleep(0.02)
    sampler.stop()
    assert any("no compute process list" in p for p in sampler.problems)


def test_device_lost_mid_run():
    keeps_going = FakeGpu(uuid(1), [Snap(0), Snap(500, {100: 500}), Snap(800, {100: 800}),
                                    Snap(800, {100: 800})])
    lost_after_data = FakeGpu(uuid(2), [Snap(0), Snap(600, {101: 600}), Snap(900, {101: 900})],
                              lost_at=2)
    lost_before_data = FakeGpu(uuid(3), [Snap(0), Snap(3000, {102: 3000})], lost_at=1)
    fake = FakeNvml([keeps_going, lost_after_data, lost_before_data])
    sampler = run(fake, {0: 100, 1: 101, 2: 102})
    assert sampler.peaks() == {0: Peak(800.0, "per-pid sampled"), 1: Peak(600.0, "per-pid sampled"),
                               2: NA}
    lost = [p for p in sampler.problems if "was lost mid-run" in p]
    assert len(lost) == 2 and uuid(2) in lost[0] + lost[1] and uuid(3) in lost[0] + lost[1]


def test_no_driver_at_all_gives_no_gpus_and_no_crash():
    """The real nvidia-ml-py on this machine: the module imports, nvmlInit fails."""
    real = nvml_module._pynvml
    if real is not None:
        try:
            real.nvmlInit()
        except Exception:  # noqa: BLE001 - the case under test
            pass
        else:
            real.nvmlShutdown()
            pytest.skip("an NVIDIA driver is present on this machine")
    device = GpuDevice(0, uuid(1), "NVIDIA H200", 143771.0, False)
    assert visible_gpus() == []
    assert visible_gpus(env={"CUDA_VISIBLE_DEVICES": "0"}) == []
    assert foreign_processes(device) == []
    sampler = NvmlSampler([device])
    sampler.add_process(0, os.getpid())
    sampler.start()
    sampler.stop()
    assert sampler.peaks() == {0: NA}
    assert sampler.timeline() == []
    assert "NVML cannot start" in sampler.problems[0]

    fake = FakeNvml([FakeGpu(uuid(1))], driver=False)  # same through the fake
    assert visible_gpus(env={}, nvml=fake) == []
    assert foreign_processes(device, nvml=fake) == []


def test_nvidia_ml_py_not_installed_still_imports_and_gives_no_gpus():
    code = ("import sys; sys.modules['pynvml'] = None\n"
            "from pytest_gpumem.sampling import nvml\n"
            "assert nvml._pynvml is None and nvml.visible_gpus() == []\n"
            "s = nvml.NvmlSampler([]); s.start(); s.stop(); print(s.problems)\n"
            "assert 'pytest' not in sys.modules, 'the sampler must not import pytest'\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cannot be imported" in done.stdout


def test_accounting_mode_gives_exact_peak_after_exit():
    """A spike between two ticks: accounting's maxMemoryUsage has it, sampling does not."""
    snaps = [Snap(0), Snap(900, {100: 900}), Snap(0)]
    with_acct = FakeGpu(uuid(1), snaps, accounting=True, acct={100: Acct(1234.0)})
    without = FakeGpu(uuid(2), [Snap(0), Snap(700, {101: 700}), Snap(0)], acct={101: Acct(999.0)})
    below_sampled = FakeGpu(uuid(3), [Snap(0), Snap(900, {102: 900})], accounting=True,
                            acct={102: Acct(850.0)})
    fake = FakeNvml([with_acct, without, below_sampled])
    devices = visible_gpus(env={}, nvml=fake)
    assert [d.accounting for d in devices] == [True, False, True]
    sampler = run(fake, {0: 100, 1: 101, 2: 102}, devices=devices)
    assert sampler.peaks() == {0: Peak(1234.0, "accounting"), 1: Peak(700.0, "per-pid sampled"),
                               2: Peak(900.0, "accounting")}


def test_stale_accounting_record_from_reused_pid_is_ignored():
    an_hour_ago = time.time() * 1e6 - 3600e6
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(900, {100: 900})], accounting=True,
                  acct={100: Acct(50000.0, start_us=an_hour_ago)})
    assert run(FakeNvml([gpu]), {0: 100}).peaks() == {0: Peak(900.0, "per-pid sampled")}


def test_pid_namespace_mismatch_uses_device_used_minus_idle():
    """In a container NVML reports host pids (40001), never the ones we launched (100)."""
    gpu = FakeGpu(uuid(1), [Snap(8), Snap(1200, {40001: 1190}), Snap(2208, {40001: 2200}), Snap(8)])
    untouched = FakeGpu(uuid(2), [Snap(8)])
    sampler = run(FakeNvml([gpu, untouched]), {0: 100, 1: 101})
    assert sampler.peaks() == {0: Peak(2200.0, "device sampled"), 1: NA}
    assert series(sampler, 0)[1:3] == [1192.0, 2200.0]
    assert series(sampler, 1) == []


def test_memory_info_v2_missing_falls_back_to_v1_and_still_subtracts_idle():
    gpu = FakeGpu(uuid(1), [Snap(8), Snap(2208, {40001: 2200}), Snap(8)], reserved_mib=615.0)
    fake = FakeNvml([gpu], missing=("nvmlDeviceGetMemoryInfo_v2",))
    sampler = run(fake, {0: 100})
    assert sampler.peaks() == {0: Peak(2200.0, "device sampled")}
    assert fake.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1, "v2 probed more than once"
    assert any("memory-info v2 is missing" in p for p in sampler.problems)


def test_device_fallback_refused_when_two_ranks_share_the_gpu():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(4000, {40001: 2000, 40002: 2000}), Snap(0)])
    fake = FakeNvml([gpu])
    shared = visible_gpus(env={}, nvml=fake) * 2
    assert run(fake, {0: 100, 1: 101}, devices=shared).peaks() == {0: NA, 1: NA}


def test_other_ranks_stray_context_is_not_charged_to_a_rank_by_device_fallback():
    """Rank 1 never used its GPU, but rank 0 opened a context there (the classic cuda:0 bug)."""
    gpu0 = FakeGpu(uuid(1), [Snap(0), Snap(2000, {100: 2000}), Snap(0)])
    gpu1 = FakeGpu(uuid(2), [Snap(0), Snap(600, {100: 600}), Snap(0)])
    sampler = run(FakeNvml([gpu0, gpu1]), {0: 100, 1: 101})
    assert sampler.peaks() == {0: Peak(2600.0, "per-pid sampled"), 1: NA}


def test_two_ranks_on_one_gpu_are_not_double_counted():
    busy = Snap(1500, {100: 1000, 101: 500})
    gpu = FakeGpu(uuid(1), [Snap(0), busy, busy, busy, busy])
    fake = FakeNvml([gpu])
    shared = visible_gpus(env={}, nvml=fake) * 2
    sampler = run(fake, {0: 100, 1: 101}, devices=shared)
    assert sampler.peaks() == {0: Peak(1000.0, "per-pid sampled"), 1: Peak(500.0, "per-pid sampled")}


def test_usage_value_not_available_is_none():
    """WDDM-style NOT_AVAILABLE, converted (None) or raw (ULONGLONG_MAX): never 0, never 16 EiB."""
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(1500, {100: None, 101: RAW_NOT_AVAILABLE}), Snap(0)])
    fake = FakeNvml([gpu, FakeGpu(uuid(2))])
    sampler = run(fake, {0: 100, 1: 101})
    assert sampler.peaks() == {0: NA, 1: NA}
    assert series(sampler, 0) == series(sampler, 1) == []


def test_mps_clients_are_counted():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(800)], mps={100: 760})
    assert run(FakeNvml([gpu]), {0: 100}).peaks() == {0: Peak(760.0, "per-pid sampled")}


def test_pid_registered_mid_run_is_picked_up():
    gpu = FakeGpu(uuid(1), [Snap(0), Snap(700, {100: 700})])
    fake = FakeNvml([gpu])
    devices = visible_gpus(env={}, nvml=fake)
    sampler = NvmlSampler(devices, interval_s=FAST, nvml=fake)
    sampler.start()
    wait_until_script_done(fake, devices)
    threading.Thread(target=sampler.add_process, args=(0, 100)).start()
    deadline = time.monotonic() + 3
    while not series(sampler, 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    sampler.stop()
    assert sampler.peaks() == {0: Peak(700.0, "per-pid sampled")}


def test_cuda_visible_devices_uuid_order_differs_from_pci_order():
    pci_order = [FakeGpu(uuid(1), [Snap(0), Snap(300, {101: 300})]), FakeGpu(uuid(2)),
                 FakeGpu(uuid(3), [Snap(0), Snap(700, {100: 700})])]
    fake = FakeNvml(pci_order)
    devices = visible_gpus(env={"CUDA_VISIBLE_DEVICES": f"{uuid(3)},{uuid(1)}"}, nvml=fake)
    assert [(d.index, d.uuid) for d in devices] == [(2, uuid(3)), (0, uuid(1))]
    sampler = run(fake, {0: 100, 1: 101}, devices=devices)
    assert sampler.peaks() == {0: Peak(700.0, "per-pid sampled"), 1: Peak(300.0, "per-pid sampled")}


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3]),
    ("2,0", [2, 0]),
    (" 3 , 1", [3, 1]),
    ("", []),
    ("-1", []),
    ("1,foo,2", [1]),  # the first invalid entry ends the list
    ("0,7,1", [0]),  # so does an ordinal that does not exist
    ("1,1", []),  # a repeated one empties it
    ("1gpu,2", [1, 2]),  # parsed like strtoul
    (uuid(2)[:8], [1]),  # an unambiguous GPU- prefix
    ("GPU-", []),  # an ambiguous one ends the list
    (f"{uuid(4)},GPU-ffff,{uuid(1)}", [3]),
    (f"{uuid(4)},1", [3]),  # no mixing of UUIDs and ordinals
    ("MIG-0a1b2c3d-1111-2222-3333-444455556666", []),  # MIG instances are not supported
])
def test_outer_cuda_visible_devices_is_respected(value, expected):
    fake = FakeNvml([FakeGpu(uuid(n)) for n in (1, 2, 3, 4)])
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert [d.index for d in visible_gpus(env=env, nvml=fake)] == expected
    assert fake.init_count == 0


def test_foreign_processes_lists_pids_already_on_the_gpu():
    gpu = FakeGpu(uuid(1), [Snap(900, {555: 400, 777: None})], mps={888: 10})
    fake = FakeNvml([gpu])
    (device,) = visible_gpus(env={}, nvml=fake)
    assert foreign_processes(device, nvml=fake) == [555, 777, 888]
    gpu.lost_at = 0
    assert foreign_processes(device, nvml=fake) == []
    assert fake.init_count == 0


class SteppingClock:
    """Every read costs 15% of a tick, one tick stalls 3.5 ticks, waiting lands on the deadline."""

    def __init__(self, interval: float, stall_at_read: int) -> None:
        self.t, self.last, self.reads = 100.0, 100.0, 0
        self.interval, self.stall_at_read, self.waits = interval, stall_at_read, 0

    def __call__(self) -> float:
        self.reads += 1
        self.last = self.t
        self.t += 0.15 * self.interval + (3.5 * self.interval if self.reads == self.stall_at_read else 0)
        return self.last

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        self.t = max(self.t, self.last + timeout)
        return self.waits >= 60  # "stop" after 60 waits


def run_on_clock(fake: FakeNvml, clock: SteppingClock, interval: float) -> NvmlSampler:
    """Sample pid 100 as rank 0 on the fake clock until it says stop."""
    sampler = NvmlSampler(visible_gpus(env={}, nvml=fake), interval_s=interval, nvml=fake, clock=clock)
    sampler.add_process(0, 100)
    sampler._wait = clock.wait
    sampler.start()
    sampler._thread.join(5)
    sampler.stop()
    return sampler


def test_schedule_does_not_drift():
    interval = 0.002
    clock = SteppingClock(interval, stall_at_read=20)
    gpu = FakeGpu(uuid(1), [Snap(i, {100: i}) for i in range(100)])  # values change every tick
    fake = FakeNvml([gpu])
    sampler = run_on_clock(fake, clock, interval)
    times = [t for t, _ in sampler.timeline()][1:-1]  # drop the first tick and stop()'s extra one
    slots = [t / interval for t in times]
    assert all(abs(s - round(s)) < 1e-6 for s in slots), "ticks left the start + k*interval grid"
    gaps = [round(b) - round(a) for a, b in zip(slots, slots[1:])]
    assert gaps.count(4) == 1 and set(gaps) == {1, 4}, "a late tick must skip slots, not burst"
    assert round(slots[-1]) - round(slots[0]) == len(slots) - 1 + 3


def test_plugin_never_sets_gpu_modes():
    fake = FakeNvml([FakeGpu(uuid(1), [Snap(0), Snap(900, {100: 900})], acct={100: Acct(950.0)}),
                     FakeGpu(uuid(2), [Snap(0), Snap(900, {101: 900})], accounting=True,
                             acct={101: Acct(950.0)})])
    devices = visible_gpus(env={}, nvml=fake)
    foreign_processes(devices[0], nvml=fake)
    sampler = run(fake, {0: 100, 1: 101}, devices=devices)
    assert sampler.peaks()[0].method == "per-pid sampled"  # accounting left off where it was off
    assert fake.forbidden_calls == []
    with pytest.raises(RuntimeError):  # the guard itself works
        fake.nvmlDeviceSetAccountingMode(fake.gpus[0], 1)
    source = Path(nvml_module.__file__).read_text()
    assert not re.search(r"nvml\w*(Set|Clear|Reset)\w*\(", source)


def test_every_nvml_name_the_sampler_uses_exists_in_the_real_binding():
    """A typo in an error class (NVMLError_GPUIsLost) would silently never match: check the names."""
    real = pytest.importorskip("pynvml")
    source = Path(nvml_module.__file__).read_text()
    names = set(re.findall(r"\bnvml\.(\w+)", source)) | set(re.findall(r'"((?:nvml|NVML)\w+)"', source))
    assert len(names) > 15
    assert sorted(n for n in names if not hasattr(real, n)) == []
    assert sorted(n for n in names if not hasattr(FakeNvml, n)) == [
        "nvmlDeviceGetMPSComputeRunningProcesses_v2"]  # absent from the fake on purpose: a scenario


def test_steady_gpu_does_not_pay_for_a_process_list_every_tick():
    """The process list holds the driver's lock for ~62 us: read it when ``used`` moves, else every 100 ms."""
    interval = 0.002
    clock = SteppingClock(interval, stall_at_read=10**9)
    gpu = FakeGpu(uuid(1), [Snap(600, {100: 600})] * 100)  # a steady job: nothing moves
    fake = FakeNvml([gpu])
    sampler = run_on_clock(fake, clock, interval)
    lists = [c for c in fake.calls if "RunningProcesses" in c and "MPS" not in c]
    assert 2 <= len(lists) <= 4, lists  # 60 ticks over ~120 ms of clock
    assert sampler.peaks()[0] == Peak(600.0, "per-pid sampled")


def test_driver_versions_go_to_provenance():
    """The CUDA context's size moves with the driver: its version travels with every GPU figure."""
    from pytest_gpumem.sampling.nvml import driver_versions

    nvml = FakeNvml([FakeGpu(0)])
    assert driver_versions(nvml) == {"nvidia_driver": "580.159.04", "cuda_driver": "13.0"}
    assert nvml.init_count == 0, "NVML shut down again"


def test_driver_without_cuda_version_call_still_names_the_driver():
    from pytest_gpumem.sampling.nvml import driver_versions

    nvml = FakeNvml([FakeGpu(0)], missing=("nvmlSystemGetCudaDriverVersion",))
    assert driver_versions(nvml) == {"nvidia_driver": "580.159.04"}
    assert driver_versions(FakeNvml([], driver=False)) == {}


def test_a_session_that_launches_on_gpus_keeps_nvml_up_between_launches(monkeypatch):
    """Each launch's GPU check, driver versions and sampler init and shut NVML down; with the library
    held open for the session they count references instead of starting it again."""
    fake = FakeNvml([FakeGpu(uuid(1))])
    monkeypatch.setattr(nvml_module, "_held", [])
    monkeypatch.setattr("atexit.register", lambda fn, *args: None)
    assert nvml_module.hold_open(fake) and fake.init_count == 1
    assert not nvml_module.hold_open(fake)  # once per session
    assert len(visible_gpus(env={}, nvml=fake)) == 1 and fake.init_count == 1
    assert not nvml_module.hold_open(FakeNvml([], driver=False))  # no driver: nothing to hold
