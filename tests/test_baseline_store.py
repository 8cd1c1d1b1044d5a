"""The baseline store: format, merging, bad files, crash safety, permissions, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from pytest_gpumem.judging import baseline
from pytest_gpumem.judging.baseline import SCHEMA_VERSION, BaselineError, BaselineStore, Entry
from pytest_gpumem.sampling.identity import host_provenance, platform_key

REPO = Path(__file__).resolve().parents[1]
CPU = "cpu:Intel(R) Xeon(R) Platinum 8480+"
GPU = "gpu:NVIDIA H200"
TEST = "examples/test_dp.py::test_a[2]"


def found(store: BaselineStore, test_id: str, platform: str, world_size: int) -> Entry:
    got = store.lookup(test_id, platform, world_size)
    assert got is not None, (test_id, platform, world_size)
    return got


def entry(gated: float = 512.34, world_size: int = 2, device: str = "cpu", **kw: Any) -> Entry:
    ranks = kw.pop("ranks", {r: gated - r for r in range(world_size)})
    prov = kw.pop("provenance", {"date": "2026-05-09", "framework": "oneflow", "framework_version": "0.9.0"})
    return Entry(gated_mib=gated, ranks=ranks, rank=kw.pop("rank", 0), device=device,
                 method=kw.pop("method", "high-water mark"), provenance=prov)


@pytest.fixture
def store(tmp_path: Path) -> BaselineStore:
    return BaselineStore(tmp_path / "baselines")


def test_file_layout_and_round_trip(store: BaselineStore) -> None:
    assert store.file_for(TEST) == store.directory / "examples" / "test_dp.py.json"
    assert store.file_for("test_x.py::TestCls::test_a") == store.directory / "test_x.py.json"
    assert store.lookup(TEST, CPU, 2) is None and store.platforms(TEST) == []

    changes = store.update(TEST, CPU, {2: entry(512.34), 1: entry(300.06, world_size=1)})
    assert changes[2][0] is None and changes[2][1].gated_mib == 512.3
    got = store.lookup(TEST, CPU, 2)
    assert got == Entry(gated_mib=512.3, ranks={0: 512.3, 1: 511.3}, rank=0, device="cpu",
                        method="high-water mark", provenance=entry().provenance)
    assert store.lookup(TEST, CPU, 1) == changes[1][1] and found(store, TEST, CPU, 1).gated_mib == 300.1
    assert store.lookup(TEST, CPU, 4) is None and store.lookup(TEST, GPU, 2) is None
    assert store.lookup("examples/test_dp.py::test_b", CPU, 2) is None
    assert store.platforms(TEST) == [CPU]

    store.update("test_x.py::TestCls::test_a", GPU, {1: entry(7.0, 1, "gpu", rank="all")})
    assert found(store, "test_x.py::TestCls::test_a", GPU, 1).rank == "all"
    assert json.loads(store.file_for("test_x.py::x").read_text())["tests"].keys() == {"TestCls::test_a"}


@pytest.mark.parametrize("test_id", ["../outside.py::t", "/abs/test_x.py::t", "test_x.py", "a//b.py::t", "test_x.py::"])
def test_test_ids_that_would_escape_the_directory_are_refused(store: BaselineStore, test_id: str) -> None:
    with pytest.raises(BaselineError, match="test id"):
        store.file_for(test_id)


def test_file_reads_well_in_a_diff(store: BaselineStore) -> None:
    store.update(TEST, CPU, {10: entry(9.0, world_size=10), 2: entry(1.0)})
    text = store.file_for(TEST).read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "schema": 1,\n  "tests": {\n')
    assert text.index('"2": {') < text.index('"10": {')  # world sizes numerically
    assert text.index('"9": 0.0') > text.index('"2": 7.0')  # ranks numerically, too
    assert '"gated_mib": 9.0,' in text and '"rank": 0,' in text
    assert all(line.count(":") <= 2 for line in text.splitlines())  # one value per line
    assert json.loads(text)["schema"] == SCHEMA_VERSION


def test_same_entries_give_identical_bytes_and_no_rewrite(tmp_path: Path) -> None:
    a, b = BaselineStore(tmp_path / "a"), BaselineStore(tmp_path / "b")
    a.update(TEST, CPU, {1: entry(1, 1), 2: entry()})
    a.update("examples/test_dp.py::test_b", GPU, {2: entry(device="gpu")})
    b.update("examples/test_dp.py::test_b", GPU, {2: entry(device="gpu")})
    b.update(TEST, CPU, {2: entry(), 1: entry(1, 1)})
    assert a.file_for(TEST).read_bytes() == b.file_for(TEST).read_bytes()
    before = os.stat(a.file_for(TEST))
    a.update(TEST, CPU, {2: entry()})
    after = os.stat(a.file_for(TEST))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_update_touches_only_its_test_platform_and_sizes(store: BaselineStore) -> None:
    file = store.file_for(TEST)
    file.parent.mkdir(parents=True)
    hand: dict[str, Any] = {"device": "gpu", "gated_mib": 5098, "method": "accounting", "rank": "all",
            "ranks": {"3": 5000.25, "0": 5098}, "provenance": {"z": "last", "a": "first", "date": "2022-01-01"}}
    doc: dict[str, Any] = {"tests": {"test_a[2]": {GPU: {"8": hand, "1": dict(hand, ranks={"0": 1.5})}},
                     "test_b": {GPU: {"8": hand}}}, "schema": 1}
    file.write_text(json.dumps(doc))  # hand-written: other order, ints, unrounded floats
    other = store.file_for("examples/other.py::t")
    store.update("examples/other.py::t", CPU, {1: entry(1, 1)})
    other_bytes = other.read_bytes()

    changes = store.update(TEST, CPU, {2: entry(600)})
    assert list(changes) == [2] and changes[2][0] is None
    changes = store.update(TEST, GPU, {8: entry(6474, 8, "gpu")})
    assert changes[8][0] == Entry(5098.0, {3: 5000.25, 0: 5098.0}, "all", "gpu", "accounting", hand["provenance"])
    assert changes[8][1].gated_mib == 6474.0

    now = json.loads(file.read_text())
    assert now["tests"]["test_a[2]"][GPU]["1"] == doc["tests"]["test_a[2]"][GPU]["1"]
    assert now["tests"]["test_b"] == doc["tests"]["test_b"]
    assert type(now["tests"]["test_b"][GPU]["8"]["gated_mib"]) is int  # value kept as written
    assert now["tests"]["test_a[2]"][CPU]["2"]["gated_mib"] == 600
    assert sorted(store.platforms(TEST)) == sorted([CPU, GPU]) and other.read_bytes() == other_bytes


def test_entries_filters_by_test_id_pattern(store: BaselineStore) -> None:
    store.update(TEST, CPU, {4: entry(4, 4), 2: entry(2)})
    store.update("examples/test_dp.py::test_b", CPU, {1: entry(1, 1)})
    store.update("tests/deep/test_z.py::TestC::test_q", GPU, {1: entry(1, 1, "gpu")})
    everything = store.entries()
    assert [(t, p, n) for t, p, n, _ in everything] == [
        ("examples/test_dp.py::test_a[2]", CPU, 2), ("examples/test_dp.py::test_a[2]", CPU, 4),
        ("examples/test_dp.py::test_b", CPU, 1), ("tests/deep/test_z.py::TestC::test_q", GPU, 1)]
    assert [e[0] for e in store.entries("examples/*::test_a*")] == [TEST, TEST]
    assert [e[0] for e in store.entries("*TestC::*")] == ["tests/deep/test_z.py::TestC::test_q"]
    assert store.entries("nothing*") == [] and BaselineStore(store.directory / "none").entries() == []


def test_reads_never_write(tmp_path: Path, store: BaselineStore) -> None:
    assert store.lookup(TEST, CPU, 2) is None and store.platforms(TEST) == [] and store.entries() == []
    assert not store.directory.exists()
    store.update(TEST, CPU, {2: entry()})
    (store.directory / baseline.LOCK_NAME).unlink()
    listing = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    store.lookup(TEST, CPU, 2), store.platforms(TEST), store.entries()
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == listing


def _good_doc() -> dict[str, Any]:
    e = {"device": "cpu", "gated_mib": 512.3, "method": "high-water mark", "provenance": {"date": "2026-05-09"},
         "rank": 0, "ranks": {"0": 512.3, "1": 511.0}}
    return {"schema": 1, "tests": {"test_a[2]": {CPU: {"2": e}}}}


def _entry_text(change: Callable[[dict[str, Any]], None]) -> str:
    doc = _good_doc()
    change(doc["tests"]["test_a[2]"][CPU]["2"])
    return json.dumps(doc, indent=2)


GOOD = json.dumps(_good_doc(), indent=2)
FIELD = f"tests['test_a[2]'][{CPU!r}]['2']"
BAD_FILES: dict[str, tuple[str | bytes, str]] = {
    "truncated": (GOOD[: len(GOOD) // 2], "truncated?"),
    "empty": ("", "line 1 column 1"),
    "hand-broken": (GOOD.replace('"rank": 0,', '"rank": 0'), "line 14 column 11: Expecting ',' delimiter"),
    "merge-conflict": ("<<<<<<< HEAD\n" + GOOD, "line 1 column 1"),
    "not-utf8": (GOOD.encode().replace(b"high", b"h\xffgh"), "byte "),
    "top-level-array": ("[]", "(top level): got an array"),
    "schema-newer": (GOOD.replace('"schema": 1', '"schema": 2'), "schema: got 2, which this pytest-gpumem cannot read; expected 1"),
    "schema-missing": (GOOD.replace('"schema": 1,', ""), "schema: missing"),
    "schema-string": (GOOD.replace('"schema": 1', '"schema": "1"'), "schema: got the string '1'"),
    "unknown-top-key": (GOOD.replace('"schema": 1', '"schema": 1, "notes": "x"'), "unknown key(s) 'notes'"),
    "unknown-entry-key": (_entry_text(lambda e: e.update(peak=1)), f"{FIELD}: unknown key(s) 'peak'"),
    "missing-entry-key": (_entry_text(lambda e: e.pop("method")), f"{FIELD}.method: missing"),
    "gated-string": (_entry_text(lambda e: e.update(gated_mib="512")), f"{FIELD}.gated_mib: got the string '512'"),
    "gated-bool": (_entry_text(lambda e: e.update(gated_mib=True)), f"{FIELD}.gated_mib: got true"),
    "gated-negative": (_entry_text(lambda e: e.update(gated_mib=-1)), f"{FIELD}.gated_mib: got -1"),
    "gated-nan": (GOOD.replace('"gated_mib": 512.3', '"gated_mib": NaN'), f"{FIELD}.gated_mib: got NaN"),
    "rank-infinity": (GOOD.replace('"1": 511.0', '"1": -Infinity'), f"{FIELD}.ranks['1']: got -Infinity"),
    "gated-overflow": (GOOD.replace('"gated_mib": 512.3', '"gated_mib": 1e400'), f"{FIELD}.gated_mib: got inf"),
    "gated-huge": (GOOD.replace('"gated_mib": 512.3', '"gated_mib": 1e20'), f"{FIELD}.gated_mib: got 1e+20"),
    "gated-5000-digits": (GOOD.replace('"gated_mib": 512.3', '"gated_mib": ' + "9" * 5000), f"{FIELD}.gated_mib: got 999999999999... (5000 digits)"),
    "ranks-array": (_entry_text(lambda e: e.update(ranks=[512.3])), f"{FIELD}.ranks: got an array"),
    "rank-out-of-range": (_entry_text(lambda e: e.update(rank=2)), f"{FIELD}.rank: got 2; expected 'all' or an integer rank 0..1"),
    "rank-word": (_entry_text(lambda e: e.update(rank="first")), f"{FIELD}.rank: got the string 'first'"),
    "ranks-key": (_entry_text(lambda e: e["ranks"].update({"5": 1.0})), f"{FIELD}.ranks['5']: not a rank"),
    "device-mismatch": (_entry_text(lambda e: e.update(device="gpu")), f"{FIELD}.device: got the string 'gpu'; expected 'cpu'"),
    "method-empty": (_entry_text(lambda e: e.update(method="")), f"{FIELD}.method"),
    "provenance-number": (_entry_text(lambda e: e["provenance"].update(cuda=11.8)), f"{FIELD}.provenance['cuda']: got 11.8"),
    "world-size-zero": (GOOD.replace('"2": {', '"0": {'), f"[{CPU!r}]['0']: not a world size"),
    "platform-key": (GOOD.replace(CPU, "tpu:v4"), "tests['test_a[2]']['tpu:v4']: not a platform key"),
    "duplicate-key": (GOOD.replace('"rank": 0,', '"rank": 0, "rank": 1,'), f"{FIELD}['rank']: given more than once"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_named_and_never_overwritten(store: BaselineStore, case: str) -> None:
    content, field = BAD_FILES[case]
    file = store.file_for(TEST)
    file.parent.mkdir(parents=True)
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = file.read_bytes()
    for call in (lambda: store.lookup(TEST, CPU, 2), lambda: store.platforms(TEST), lambda: store.entries(),
                 lambda: store.update(TEST, CPU, {2: entry()}), lambda: store.update(TEST, GPU, {1: entry(1, 1, "gpu")})):
        with pytest.raises(BaselineError) as info:
            call()
        assert str(info.value).startswith(f"{file}: ") and field in str(info.value), str(info.value)
        assert "; expected " in str(info.value)
    assert file.read_bytes() == before and sorted(p.name for p in file.parent.iterdir()) == [file.name]


@pytest.mark.parametrize("bad, field", [
    (entry(float("nan")), ".gated_mib: got nan"),
    (entry(2.0**41), ".gated_mib"),
    (entry(ranks={0: 1.0, 2: 1.0}), ".ranks['2']: not a rank"),
    (entry(ranks={0: "1"}), ".ranks['0']: got the string '1'"),
    (entry(device="gpu"), ".device"),
    (entry(rank=-1), ".rank"),
    (entry(provenance={"driver": 535}), ".provenance['driver']"),
])
def test_update_refuses_entries_it_could_not_read_back(store: BaselineStore, bad: Entry, field: str) -> None:
    with pytest.raises(BaselineError, match=r"\['2'\]" + field.replace("[", r"\[").replace("]", r"\]")):
        store.update(TEST, CPU, {2: bad})
    with pytest.raises(BaselineError, match="not a world size"):
        store.update(TEST, CPU, {0: entry()})
    with pytest.raises(BaselineError, match="not a platform key"):
        store.update(TEST, "H200", {2: entry()})
    assert not store.file_for(TEST).exists()


@pytest.mark.parametrize("victim", ["replace", "fsync"])
def test_failure_mid_write_keeps_old_file_and_no_temp(store: BaselineStore, monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    store.update(TEST, CPU, {2: entry(100)})
    file = store.file_for(TEST)
    before = file.read_bytes()
    seen: list[str] = []

    def crash(*args: Any) -> None:
        temps = list(file.parent.glob(".*.tmp"))
        seen.extend(t.read_text() for t in temps)  # the temp file was really written
        raise KeyboardInterrupt if victim == "fsync" else OSError(28, "No space left on device")

    monkeypatch.setattr(baseline.os, victim, crash)
    with pytest.raises((BaselineError, KeyboardInterrupt)) as info:
        store.update(TEST, CPU, {2: entry(200)})
    monkeypatch.undo()
    if victim == "replace":  # an OSError is told as the file that could not be written, and why
        assert "cannot be written (No space left on device)" in str(info.value)
    assert len(seen) == 1 and '"gated_mib": 200.0' in seen[0]
    assert file.read_bytes() == before and list(file.parent.glob(".*.tmp")) == []
    assert found(store, TEST, CPU, 2).gated_mib == 100


def test_killed_writer_leaves_old_file_and_its_temp_is_swept_later(store: BaselineStore) -> None:
    store.update(TEST, CPU, {2: entry(100)})
    file = store.file_for(TEST)
    before = file.read_bytes()
    code = f"""
        import os
        from pytest_gpumem.judging import baseline
        os.replace = lambda *a: os._exit(9)  # the process dies between the write and the rename
        s = baseline.BaselineStore({str(store.directory)!r})
        s.update({TEST!r}, {CPU!r}, {{2: baseline.Entry(200.0, {{0: 200.0}}, 0, "cpu", "m", {{}})}})
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 9
    assert file.read_bytes() == before
    (stale,) = file.parent.glob(".*.tmp")
    store.update(TEST, CPU, {4: entry(4, 4)})
    assert stale.exists()  # young: might belong to a live writer
    os.utime(stale, (time.time() - 3600,) * 2)
    store.update(TEST, CPU, {4: entry(5, 4)})
    assert not stale.exists() and found(store, TEST, CPU, 2).gated_mib == 100


def test_temp_file_private_final_file_normal(store: BaselineStore, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real_fchmod = os.fchmod

    def spy(fd: int, mode: int) -> None:
        st = os.fstat(fd)
        if st.st_size > 0:  # our temp file, not filelock's empty lock file
            modes.append(stat.S_IMODE(st.st_mode))  # content is all in and it is still private
        real_fchmod(fd, mode)

    monkeypatch.setattr(baseline.os, "fchmod", spy)
    old_umask = os.umask(0o027)
    try:
        store.update(TEST, CPU, {2: entry()})
    finally:
        os.umask(old_umask)
    file = store.file_for(TEST)
    assert modes == [0o600] and stat.S_IMODE(file.stat().st_mode) == 0o640
    assert stat.S_IMODE((store.directory / baseline.LOCK_NAME).stat().st_mode) == 0o600
    file.chmod(0o664)
    store.update(TEST, CPU, {2: entry(1)})
    assert modes == [0o600, 0o600] and stat.S_IMODE(file.stat().st_mode) == 0o664


def _refresh_many(directory: str, worker: int, barrier: Any) -> None:
    store = BaselineStore(Path(directory))
    barrier.wait()
    for i in range(25):
        store.update(f"examples/test_dp.py::test_w{worker}[{i}]", CPU, {2: entry(worker * 100 + i + 1)})


def _read_while_writing(directory: str, barrier: Any, done: Any, reads: Any) -> None:
    """Lock-free reads must only ever see a whole file: old or new, never half written."""
    store = BaselineStore(Path(directory))
    barrier.wait()
    while not done.is_set():
        store.entries()  # raises, and so exits non-zero, on a partial file
        reads.value += 1


def test_concurrent_refreshes_lose_nothing(store: BaselineStore) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, done, reads = ctx.Barrier(9), ctx.Event(), ctx.Value("i", 0)
    writers = [ctx.Process(target=_refresh_many, args=(str(store.directory), w, barrier)) for w in range(8)]
    reader = ctx.Process(target=_read_while_writing, args=(str(store.directory), barrier, done, reads))
    for p in [*writers, reader]:
        p.start()
    for p in writers:
        p.join(120)
    done.set()
    reader.join(60)
    assert [p.exitcode for p in writers] == [0] * 8 and reader.exitcode == 0 and reads.value > 10
    found = {(t, e.gated_mib) for t, _, _, e in store.entries()}  # entries() validates the file
    assert found == {(f"examples/test_dp.py::test_w{w}[{i}]", float(w * 100 + i + 1)) for w in range(8) for i in range(25)}
    assert list(store.file_for(TEST).parent.glob(".*.tmp")) == []


def test_host_provenance_has_knobs_but_no_machine_names() -> None:
    home = os.path.expanduser("~")
    env = {"NCCL_DEBUG": "INFO", "ONEFLOW_BOXING_DISABLE_MIDDLE_NODE": "1", "OMP_NUM_THREADS": "4",
           "CUDA_MODULE_LOADING": "LAZY", "NCCL_TOPO_FILE": f"{home}/topo.xml", "HOSTNAME": "node17",
           "PATH": "/usr/bin", "NCCLX": "no"}
    prov = host_provenance(env)
    assert prov["env.NCCL_DEBUG"] == "INFO" and prov["env.OMP_NUM_THREADS"] == "4"
    assert prov["env.ONEFLOW_BOXING_DISABLE_MIDDLE_NODE"] == "1" and prov["env.CUDA_MODULE_LOADING"] == "LAZY"
    assert prov["env.NCCL_TOPO_FILE"] == "~/topo.xml"
    assert not {"env.HOSTNAME", "env.PATH", "env.NCCLX"} & prov.keys()
    assert prov["python"] == ".".join(map(str, sys.version_info[:3]))
    assert time.strptime(prov["date"], "%Y-%m-%d")
    assert all(isinstance(v, str) and socket.gethostname() not in v for v in prov.values())


def test_platform_key(store: BaselineStore) -> None:
    assert platform_key("gpu", " NVIDIA  H200 ") == GPU
    cpu = platform_key("cpu")
    assert cpu.startswith("cpu:") and len(cpu) > 4 and cpu == " ".join(cpu.split())
    for args in (("gpu",), ("gpu", ""), ("tpu", "v4")):
        with pytest.raises(ValueError):
            platform_key(*args)
    store.update(TEST, cpu, {1: entry(1, 1)})
    assert store.platforms(TEST) == [cpu]
