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
import threading
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import pytest

from pytest_gpumem.judging import baseline
from pytest_gpumem.judging.baseline import SCHEMA_VERSION, BaselineError, BaselineStore, Entry
from pytest_gpumem.sampling.identity import host_provenance, platform_key
from pytest_gpumem.storage import atomic

REPO = Path(__file__).resolve().parents[3]
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


@pytest.mark.parametrize("test_id", ["../outside.py::t", "/abs/test_x.py::t", "test_x.py", "a//b.py::t", "test_x.py::",
                                     "./test_x.py::t", "a/./b.py::t"])
def test_test_ids_that_would_escape_the_directory_are_refused(store: BaselineStore, test_id: str) -> None:
    with pytest.raises(BaselineError) as info:
        store.file_for(test_id)
    assert str(info.value) == (f"{store.directory}: test id {test_id!r}: cannot be stored;"
                               " expected 'path/under/rootdir/test_x.py::name'")


def test_file_reads_well_in_a_diff(store: BaselineStore) -> None:
    store.update(TEST, CPU, {10: entry(9.0, world_size=10), 2: entry(1.0)})
    text = store.file_for(TEST).read_text()
    assert text.endswith("}\n") and text.startswith('{\n  "schema": 2,\n  "tests": {\n')
    assert text.index('"2": {') < text.index('"10": {')  # world sizes numerically
    assert text.index('"9": 0.0') > text.index('"2": 7.0')  # ranks numerically, too
    assert '"gated_mib": 9.0,' in text and '"rank": 0,' in text
    assert all(line.count(":") <= 2 for line in text.splitlines())  # one value per line
    assert json.loads(text)["schema"] == SCHEMA_VERSION


def test_file_keeps_text_readable_and_orders_mixed_keys(store: BaselineStore) -> None:
    prov = {"b": "x", "10": "y", "9": "z", "a": "w", "env.HOME": "~/données", "env.RAW": "a\udcffb"}
    store.update(TEST, CPU, {2: entry(provenance=prov)})
    text = store.file_for(TEST).read_text()
    assert '"env.HOME": "~/données"' in text  # as written, not "\u00e9"
    assert '"env.RAW": "a\\udcffb"' in text  # an undecodable byte (a lone surrogate) as its JSON escape
    at = [text.index(f'"{key}": ') for key in ("9", "10", "a", "b", "env.HOME", "env.RAW")]
    assert at == sorted(at)  # numbers first, numerically; then names
    assert found(store, TEST, CPU, 2).provenance == prov


@pytest.mark.parametrize("mib", [0, 0.0, 2.0**40 - 1])
def test_mib_bounds_are_kept(store: BaselineStore, mib: float) -> None:
    store.update(TEST, CPU, {2: entry(mib, ranks={0: mib, 1: mib})})
    got = found(store, TEST, CPU, 2)
    assert (got.gated_mib, got.ranks) == (mib, {0: mib, 1: mib})


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
                     "test_b": {GPU: {"8": hand}}}, "schema": 2}
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
    store.update(TEST, GPU, {1: entry(1, 1, "gpu")})
    (store.directory / "examples" / ".notes.json").write_text("not a baseline")  # hidden: not read
    everything = store.entries()
    assert [(t, p, n) for t, p, n, _ in everything] == [
        ("examples/test_dp.py::test_a[2]", CPU, 2), ("examples/test_dp.py::test_a[2]", CPU, 4),
        ("examples/test_dp.py::test_a[2]", GPU, 1),
        ("examples/test_dp.py::test_b", CPU, 1), ("tests/deep/test_z.py::TestC::test_q", GPU, 1)]
    assert [e[0] for e in store.entries("examples/*::test_a*")] == [TEST] * 3
    assert [e[0] for e in store.entries("*::test_b")] == ["examples/test_dp.py::test_b"]  # after test_a[2] in its file
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
    return {"schema": 2, "tests": {"test_a[2]": {CPU: {"2": e}}}}


def _entry_text(change: Callable[[dict[str, Any]], None]) -> str:
    doc = _good_doc()
    change(doc["tests"]["test_a[2]"][CPU]["2"])
    return json.dumps(doc, indent=2)


GOOD = json.dumps(_good_doc(), indent=2)


def _gated(text: str) -> str:
    return GOOD.replace('"gated_mib": 512.3', '"gated_mib": ' + text)


FIELD = f"tests['test_a[2]'][{CPU!r}]['2']"
MIB_RULE = "expected a finite number of MiB, 0 <= value < 2**40"
# Each bad file and the whole message after "<file>: ": where, what was found, what is accepted.
BAD_FILES: dict[str, tuple[str | bytes, str]] = {
    "truncated": (GOOD[: len(GOOD) // 2], "line 9 column 21: Unterminated string starting at"
                  " (the file ends early: truncated?); expected JSON as pytest-gpumem writes it"),
    "empty": ("", "line 1 column 1: Expecting value (the file ends early: truncated?);"
              " expected JSON as pytest-gpumem writes it"),
    "hand-broken": (GOOD.replace('"rank": 0,', '"rank": 0'),
                    "line 14 column 11: Expecting ',' delimiter; expected JSON as pytest-gpumem writes it"),
    "merge-conflict": ("<<<<<<< HEAD\n" + GOOD,
                       "line 1 column 1: Expecting value; expected JSON as pytest-gpumem writes it"),
    "not-utf8": (GOOD.encode().replace(b"high", b"h\xffgh"), "byte 190: not UTF-8; expected a UTF-8 JSON file"),
    "top-level-array": ("[]", "(top level): got an array; expected an object with 'schema' and 'tests'"),
    "schema-newer": (GOOD.replace('"schema": 2', '"schema": 3'), "schema: got 3, which this pytest-gpumem cannot"
                     " read; expected 2 (the baseline schemas this pytest-gpumem reads)"),
    "schema-never-released": (GOOD.replace('"schema": 2', '"schema": 1'), "schema: got 1, which this pytest-gpumem"
                              " cannot read; expected 2 (the baseline schemas this pytest-gpumem reads)"),
    "schema-missing": (GOOD.replace('"schema": 2,', ""),
                       "schema: missing; expected 2 (the baseline schemas this pytest-gpumem reads)"),
    "schema-string": (GOOD.replace('"schema": 2', '"schema": "2"'), "schema: got the string '2', which this"
                      " pytest-gpumem cannot read; expected 2 (the baseline schemas this pytest-gpumem reads)"),
    "tests-missing": ('{"schema": 2}', "tests: missing; expected all of schema, tests"),
    "unknown-top-key": (GOOD.replace('"schema": 2', '"schema": 2, "notes": "x"'),
                        "(top level): unknown key(s) 'notes'; expected only 'schema', 'tests'"),
    "unknown-top-keys": (GOOD.replace('"schema": 2', '"schema": 2, "notes": "x", "a": 1'),
                         "(top level): unknown key(s) 'a', 'notes'; expected only 'schema', 'tests'"),
    "tests-array": ('{"schema": 2, "tests": []}', "tests: got an array; expected an object of test name -> platforms"),
    "platforms-array": ('{"schema": 2, "tests": {"test_a[2]": []}}', "tests['test_a[2]']: got an array; expected an"
                        " object of platform ('gpu:<GPU name>' or 'cpu:<architecture>'"
                        ") -> sizes"),
    "platform-key": (GOOD.replace(CPU, "tpu:v4"),
                     "tests['test_a[2]']['tpu:v4']: not a platform key;"
                     " expected 'gpu:<GPU name>' or 'cpu:<architecture>'"),
    "sizes-array": (json.dumps({"schema": 2, "tests": {"test_a[2]": {CPU: []}}}),
                    f"tests['test_a[2]'][{CPU!r}]: got an array; expected an object of world size -> entry"),
    "world-size-zero": (GOOD.replace('"2": {', '"0": {'), f"tests['test_a[2]'][{CPU!r}]['0']: not a world size;"
                        " expected a positive integer key like '2'"),
    "entry-number": (json.dumps({"schema": 2, "tests": {"test_a[2]": {CPU: {"2": 512.3}}}}),
                     f"{FIELD}: got 512.3; expected an object with device, gated_mib, method, provenance, rank, ranks"
                     " (and optionally allocated_mib, reserved_mib, sites, allocated_ranks, rank_sites)"),
    "unknown-entry-key": (_entry_text(lambda e: e.update(peak=1)), f"{FIELD}: unknown key(s) 'peak'; expected only"
                          " 'device', 'gated_mib', 'method', 'provenance', 'rank', 'ranks'"),
    "missing-entry-key": (_entry_text(lambda e: e.pop("method")), f"{FIELD}.method: missing;"
                          " expected all of device, gated_mib, method, provenance, rank, ranks"),
    "duplicate-key": (GOOD.replace('"rank": 0,', '"rank": 0, "rank": 1,'), f"{FIELD}['rank']: given more than once"
                      " in one object; expected each key once (was a merge conflict resolved by keeping both sides?)"),
    "duplicate-top-key": (GOOD.replace('"schema": 2,', '"schema": 2, "schema": 2,'), "['schema']: given more than"
                          " once in one object; expected each key once (was a merge conflict resolved by keeping both"
                          " sides?)"),
    "device-mismatch": (_entry_text(lambda e: e.update(device="gpu")),
                        f"{FIELD}.device: got the string 'gpu'; expected 'cpu', as the platform key says"),
    "gated-string": (_gated('"512"'), f"{FIELD}.gated_mib: got the string '512'; {MIB_RULE}"),
    "gated-bool": (_gated("true"), f"{FIELD}.gated_mib: got true; {MIB_RULE}"),
    "gated-object": (_gated("{}"), f"{FIELD}.gated_mib: got an object; {MIB_RULE}"),
    "gated-negative": (_gated("-1"), f"{FIELD}.gated_mib: got -1; {MIB_RULE}"),
    "gated-nan": (_gated("NaN"), f"{FIELD}.gated_mib: got NaN; {MIB_RULE}"),
    "rank-infinity": (GOOD.replace('"1": 511.0', '"1": -Infinity'), f"{FIELD}.ranks['1']: got -Infinity; {MIB_RULE}"),
    "gated-overflow": (_gated("1e400"), f"{FIELD}.gated_mib: got inf; {MIB_RULE}"),
    "gated-huge": (_gated("1e20"), f"{FIELD}.gated_mib: got 1e+20; {MIB_RULE}"),
    "gated-2**40": (_gated(str(2**40)), f"{FIELD}.gated_mib: got 1099511627776; {MIB_RULE}"),  # the first refused
    "gated-23-digits": (_gated("9" * 23), f"{FIELD}.gated_mib: got {'9' * 23}; {MIB_RULE}"),
    "gated-24-digits": (_gated("9" * 24), f"{FIELD}.gated_mib: got 999999999999... (24 digits); {MIB_RULE}"),
    "gated-5000-digits": (_gated("9" * 5000), f"{FIELD}.gated_mib: got 999999999999... (5000 digits); {MIB_RULE}"),
    "ranks-array": (_entry_text(lambda e: e.update(ranks=[512.3])), f"{FIELD}.ranks: got an array;"
                    " expected an object of rank -> MiB"),
    "rank-out-of-range": (_entry_text(lambda e: e.update(rank=2)),
                          f"{FIELD}.rank: got 2; expected 'all' or an integer rank 0..1"),
    "rank-word": (_entry_text(lambda e: e.update(rank="first")),
                  f"{FIELD}.rank: got the string 'first'; expected 'all' or an integer rank 0..1"),
    "ranks-key": (_entry_text(lambda e: e["ranks"].update({"5": 1.0})),
                  f"{FIELD}.ranks['5']: not a rank of this world size; expected rank keys '0'..'1'"),
    "allocated-ranks-key": (_entry_text(lambda e: e.update(rank="all", allocated_ranks={"0": 1.0, "2": 1.0})),
                            f"{FIELD}.allocated_ranks['2']: not a rank of this world size;"
                            " expected rank keys '0'..'1'"),
    "allocated-ranks-string": (_entry_text(lambda e: e.update(rank="all", allocated_ranks={"1": "9"})),
                               f"{FIELD}.allocated_ranks['1']: got the string '9'; {MIB_RULE}"),
    "rank-sites-list": (_entry_text(lambda e: e.update(rank="all", rank_sites=[])),
                        f"{FIELD}.rank_sites: got an array; expected an object of rank -> list of sites"),
    "rank-sites-site": (_entry_text(lambda e: e.update(rank="all", rank_sites={"1": [{"where": "a.py:1"}]})),
                        f"{FIELD}.rank_sites['1'][0].function: missing; expected all of where, function, detail, mib,"
                        " count, internal"),
    "method-empty": (_entry_text(lambda e: e.update(method="")),
                     f"{FIELD}.method: got the string ''; expected a non-empty string, e.g. 'high-water mark'"),
    "provenance-string": (_entry_text(lambda e: e.update(provenance="x")),
                          f"{FIELD}.provenance: got the string 'x'; expected an object of string -> string"),
    "provenance-number": (_entry_text(lambda e: e["provenance"].update(cuda=11.8)),
                          f"{FIELD}.provenance['cuda']: got 11.8; expected string keys and string values"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_named_and_never_overwritten(store: BaselineStore, case: str) -> None:
    content, message = BAD_FILES[case]
    file = store.file_for(TEST)
    file.parent.mkdir(parents=True)
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = file.read_bytes()
    for call in (lambda: store.lookup(TEST, CPU, 2), lambda: store.platforms(TEST), lambda: store.entries(),
                 lambda: store.update(TEST, CPU, {2: entry()}),
                 lambda: store.update(TEST, GPU, {1: entry(1, 1, "gpu")})):
        with pytest.raises(BaselineError) as info:
            call()
        assert str(info.value) == f"{file}: {message}"
    assert file.read_bytes() == before and sorted(p.name for p in file.parent.iterdir()) == [file.name]


def test_a_file_nested_too_deep_for_the_parser_is_named(store: BaselineStore) -> None:
    file = store.file_for(TEST)
    file.parent.mkdir(parents=True)
    file.write_text('{"schema": 2, "tests": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(BaselineError) as info:
        store.lookup(TEST, CPU, 2)
    message = str(info.value)  # the parser's own words in the middle
    assert message.startswith(f"{file}: (file): not readable as JSON (maximum recursion depth exceeded")
    assert message.endswith("); expected JSON as pytest-gpumem writes it")


def test_a_baseline_path_that_cannot_be_read_is_named(store: BaselineStore) -> None:
    file = store.file_for(TEST)
    file.mkdir(parents=True)  # a folder where the file should be
    for call in (lambda: store.lookup(TEST, CPU, 2), lambda: store.update(TEST, CPU, {2: entry()})):
        with pytest.raises(BaselineError) as info:
            call()
        assert str(info.value) == f"{file}: (file): cannot be read (Is a directory); expected a readable baseline file"


@pytest.mark.parametrize("bad, field", [
    (entry(float("nan")), f".gated_mib: got nan; {MIB_RULE}"),
    (entry(2.0**41), f".gated_mib: got 2199023255552.0; {MIB_RULE}"),
    (entry(ranks={0: 1.0, 2: 1.0}), ".ranks['2']: not a rank of this world size; expected rank keys '0'..'1'"),
    (entry(ranks={0: "1"}), f".ranks['0']: got the string '1'; {MIB_RULE}"),
    (entry(ranks=[1.0]), ".ranks: got an array; expected an object of rank -> MiB"),
    (entry(device="gpu"), ".device: got the string 'gpu'; expected 'cpu', as the platform key says"),
    (entry(rank=-1), ".rank: got -1; expected 'all' or an integer rank 0..1"),
    (entry(provenance={"driver": 535}), ".provenance['driver']: got 535; expected string keys and string values"),
    (entry(provenance=[("driver", "535")]), ".provenance: got an array; expected an object of string -> string"),
])
def test_update_refuses_entries_it_could_not_read_back(store: BaselineStore, bad: Entry, field: str) -> None:
    file = store.file_for(TEST)
    with pytest.raises(BaselineError) as info:
        store.update(TEST, CPU, {2: bad})
    assert str(info.value) == f"{file}: tests['test_a[2]'][{CPU!r}]['2']{field}"
    with pytest.raises(BaselineError) as info:
        store.update(TEST, CPU, {0: entry()})
    assert str(info.value) == f"{file}: tests['test_a[2]'][{CPU!r}]['0']: not a world size; expected a positive integer"
    for platform in ("H200", None):  # None: a GPU name that was never found
        with pytest.raises(BaselineError) as info:
            store.update(TEST, platform, {2: entry()})
        assert str(info.value) == (f"{file}: tests['test_a[2]'][{platform!r}]: not a platform key;"
                                   " expected 'gpu:<GPU name>' or 'cpu:<architecture>'")
    assert not file.exists()


def test_any_mapping_is_stored_and_a_platform_name_may_hold_a_colon(store: BaselineStore) -> None:
    """CPU and GPU names are free text: only the first colon ends the device."""
    platform = "cpu:Vendor: Model 9 (rev: 2)"
    prov = MappingProxyType({"date": "2026-05-09"})
    store.update(TEST, platform, {2: entry(provenance=prov, ranks=MappingProxyType({0: 1.0, 1: 2.0}))})
    assert found(store, TEST, platform, 2).provenance == {"date": "2026-05-09"}
    assert store.platforms(TEST) == [platform] and store.platforms("examples/test_dp.py::test_other") == []
    assert [(t, p, n) for t, p, n, _ in store.entries()] == [(TEST, platform, 2)]


@pytest.mark.parametrize("victim", ["replace", "fsync"])
def test_failure_mid_write_keeps_old_file_and_no_temp(
    store: BaselineStore, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    store.update(TEST, CPU, {2: entry(100)})
    file = store.file_for(TEST)
    before = file.read_bytes()
    seen: list[str] = []

    def crash(*args: Any) -> None:
        temps = list(file.parent.glob(".*.tmp"))
        seen.extend(t.read_text() for t in temps)  # the temp file was really written
        raise KeyboardInterrupt if victim == "fsync" else OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, victim, crash)
    with pytest.raises((BaselineError, KeyboardInterrupt)) as info:
        store.update(TEST, CPU, {2: entry(200)})
    monkeypatch.undo()
    if victim == "replace":  # an OSError is told as the file that could not be written, and why
        assert str(info.value) == (f"{file}: (file): cannot be written (No space left on device);"
                                   " expected a writable baseline folder")
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
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 9
    assert file.read_bytes() == before
    (stale,) = file.parent.glob(".*.tmp")
    store.update(TEST, CPU, {4: entry(4, 4)})
    assert stale.exists()  # young: might belong to a live writer
    os.utime(stale, (time.time() - 3600,) * 2)
    store.update(TEST, CPU, {4: entry(5, 4)})
    assert not stale.exists() and found(store, TEST, CPU, 2).gated_mib == 100


def test_stale_temp_files_are_swept_and_young_ones_kept(store: BaselineStore) -> None:
    """What a writer killed mid-write leaves (test_killed_writer_... makes one for real), in process."""
    store.update(TEST, CPU, {2: entry(100)})
    file = store.file_for(TEST)
    young, old = file.parent / f".{file.name}.young.tmp", file.parent / f".{file.name}.old.tmp"
    young.write_text("{")
    old.write_text("{")
    os.utime(old, (time.time() - baseline.STALE_TEMP_S - 60,) * 2)
    store.update(TEST, CPU, {2: entry(200)})
    assert young.exists() and not old.exists() and found(store, TEST, CPU, 2).gated_mib == 200


def test_a_temp_file_gone_before_it_is_looked_at_is_skipped(store: BaselineStore) -> None:
    """A peer may sweep a temp file between our listing and our stat: a dangling link stands for it."""
    store.update(TEST, CPU, {2: entry(100)})
    file = store.file_for(TEST)
    (file.parent / f".{file.name}.gone.tmp").symlink_to(file.parent / "nothing")
    store.update(TEST, CPU, {2: entry(200)})
    assert found(store, TEST, CPU, 2).gated_mib == 200


def test_a_folder_that_cannot_be_fsynced_does_not_fail_the_write(
    store: BaselineStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems refuse fsync on a directory (EINVAL): the file is written all the same."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    store.update(TEST, CPU, {2: entry(100)})
    assert found(store, TEST, CPU, 2).gated_mib == 100


def test_a_lock_held_too_long_is_named_instead_of_waited_on(
    store: BaselineStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from filelock import FileLock

    monkeypatch.setattr(baseline, "LOCK_TIMEOUT_S", 0.05)
    store.directory.mkdir()
    held, done = threading.Event(), threading.Event()

    def other_writer() -> None:  # holds the lock; lets go after 2 s, so a store that waits forever gets it
        with FileLock(str(store.directory / baseline.LOCK_NAME)):
            held.set()
            done.wait(2.0)

    thread = threading.Thread(target=other_writer)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(BaselineError) as info:
            store.update(TEST, CPU, {2: entry()})
    finally:
        done.set()
        thread.join()
    assert str(info.value) == (f"{store.directory / baseline.LOCK_NAME}: lock: not acquired within 0.05 s;"
                               " expected no other pytest-gpumem process to hold it that long")
    assert not store.file_for(TEST).exists()


def test_temp_file_private_final_file_normal(store: BaselineStore, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real_fchmod = os.fchmod

    def spy(fd: int, mode: int) -> None:
        st = os.fstat(fd)
        if st.st_size > 0:  # our temp file, not filelock's empty lock file
            modes.append(stat.S_IMODE(st.st_mode))  # content is all in and it is still private
        real_fchmod(fd, mode)

    monkeypatch.setattr(atomic.os, "fchmod", spy)
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
    old_umask = os.umask(0o002)
    try:
        store.update("examples/other.py::t", CPU, {2: entry()})
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(store.file_for("examples/other.py::t").stat().st_mode) == 0o664


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
    assert found == {(f"examples/test_dp.py::test_w{w}[{i}]", float(w * 100 + i + 1))
                     for w in range(8) for i in range(25)}
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


# --- Schema 2: host figures by architecture, allocator figures, sites ---------------------------------

def test_gpu_entries_keep_the_allocator_figure_and_sites(store: BaselineStore) -> None:
    sites = ({"where": "t.py:9", "function": "step", "detail": "", "mib": 256.0, "count": 2, "internal": False},)
    gpu_entry = Entry(14370.0, {0: 14370.0}, 0, "gpu", "per-pid sampled", {}, 7765.06, 12876.0, sites)
    store.update(TEST, GPU, {1: gpu_entry})
    got = found(store, TEST, GPU, 1)
    assert (got.allocated_mib, got.reserved_mib, got.sites) == (7765.1, 12876.0, sites)
    text = store.file_for(TEST).read_text()
    assert '"allocated_mib": 7765.1' in text and '"where": "t.py:9"' in text


def test_a_merge_decides_what_replaces_a_stored_entry(store: BaselineStore) -> None:
    store.update(TEST, CPU, {2: entry(500.0)})
    seen = []

    def merge(old: Entry, new: Entry) -> Entry:
        seen.append((old.gated_mib, new.gated_mib))
        return new if new.gated_mib > old.gated_mib + 10 else old

    store.update(TEST, CPU, {2: entry(505.0)}, merge=merge)
    assert seen == [(500.0, 505.0)] and found(store, TEST, CPU, 2).gated_mib == 500.0


@pytest.mark.parametrize("bad, field", [
    ({"allocated_mib": -1}, ".allocated_mib: got -1; expected a finite number of MiB, 0 <= value < 2**40"),
    ({"sites": {}}, ".sites: got an object; expected a list of sites"),
    ({"sites": [{"where": "t.py:1"}]},
     ".sites[0].function: missing; expected all of where, function, detail, mib, count, internal"),
    ({"sites": [{"where": 1, "function": "", "detail": "", "mib": 1.0, "count": 1, "internal": False}]},
     ".sites[0].where: got 1; expected a string"),
    ({"sites": [{"where": "a", "function": "", "detail": "", "mib": 1.0, "count": -1, "internal": False}]},
     ".sites[0].count: got -1; expected an integer >= 0"),
])
def test_bad_schema_2_fields_are_named(store: BaselineStore, bad: dict, field: str) -> None:
    file = store.file_for(TEST)
    file.parent.mkdir(parents=True)
    raw = {**baseline._to_json(entry()), **bad}
    file.write_text(json.dumps({"schema": 2, "tests": {"test_a[2]": {CPU: {"2": raw}}}}))
    with pytest.raises(BaselineError) as info:
        store.lookup(TEST, CPU, 2)
    assert str(info.value) == f"{file}: tests['test_a[2]'][{CPU!r}]['2']{field}"


def test_host_platform_keys_name_the_architecture() -> None:
    import platform

    assert platform_key("cpu") == f"cpu:{platform.machine()}"
    assert "cpu_model" in host_provenance({})


# -- a real GPU run beside the CPU gate's fake-GPU baseline ------------------------------------------


def test_a_real_gpu_run_says_how_far_the_fake_gpu_baseline_of_its_model_was_size_by_size(tmp_path: Path):
    """The nightly GPU run of a test the pull-request gate runs on a fake GPU: the two are never
    compared as limits (filed apart), but the real run reports the fake figure's error."""
    from pytest_gpumem.config.settings import resolve
    from pytest_gpumem.config.spec import Defaults, parse_marker
    from pytest_gpumem.judging.gate import Gate
    from pytest_gpumem.launching.launched import SizeRun, TestRun
    from pytest_gpumem.launching.supervise import LaunchResult
    from pytest_gpumem.results.size import SizeResult
    from pytest_gpumem.sampling import AllocatedPeak, Peak

    store = BaselineStore(tmp_path)
    fake = {n: Entry(mib, {0: mib}, 0, "gpu", "fake GPU NVIDIA H200: the allocator figure (no device figure)", {},
                     allocated_mib=mib) for n, mib in {1: 11046.8, 8: 7204.7}.items()}
    store.update("t.py::test_fsdp", "gpu:NVIDIA H200 (fake)", fake)
    spec = parse_marker((), {"nproc": [1, 8], "device": "gpu"}, Defaults())
    test = TestRun("t.py::test_fsdp", spec)
    for n, platform, real in ((1, "gpu:NVIDIA H200", 11046.75), (8, "gpu:NVIDIA H200 (simulated)", 7228.61)):
        result = SizeResult(n, "gpu", {0: Peak(real + 900, "per-pid sampled")}, platform=platform,
                            allocated={0: AllocatedPeak(real, real + 100, "torch")})
        test.runs.append(SizeRun(result=result, launch=LaunchResult(n, []), outcomes={}))
    gate = Gate(resolve({}, {}, {}, rootdir=tmp_path, enabled=True, refresh=False), store)
    assert gate.stored.fake_gpu_difference(test) == [
        "fake GPU vs this GPU: the gpu:NVIDIA H200 (fake) baseline's allocator figure vs this run's, "
        "nproc=1 11046.80 vs 11046.75 MiB (+0.05, +0.00%); nproc=8 7204.70 vs 7228.61 MiB (-23.91, -0.33%)"]

    fake_run = TestRun("t.py::test_fsdp", spec, runs=[SizeRun(
        result=SizeResult(1, "gpu", {0: Peak(11046.76, "fake")}, platform="gpu:NVIDIA H200 (fake)",
                          allocated={0: AllocatedPeak(11046.76, None, "torch")}, fake_gpu="NVIDIA H200"),
        launch=LaunchResult(1, []), outcomes={})])
    assert gate.stored.fake_gpu_difference(fake_run) == []  # a fake run is the fake figure: nothing to say


def test_rank_all_keeps_every_ranks_allocator_figure_and_the_other_ranks_sites(store: BaselineStore) -> None:
    """rank="all" holds each rank to its own figure: the entry keeps them, and each rank's sites."""
    site = {"where": "test_pp.py:22", "function": "forward", "detail": "", "mib": 400.0, "count": 32,
            "internal": False}
    entry = Entry(2153.0, {0: 1293.0, 1: 1821.0, 7: 2153.0}, "all", "gpu", "per-pid sampled", {"date": "d"},
                  allocated_mib=2100.0, sites=(dict(site, where="test_pp.py:40"),),
                  allocated_ranks={0: 1200.5, 1: 1750.25, 7: 2100.0}, rank_sites={1: (site,)})
    store.update(TEST, "gpu:NVIDIA H200", {8: entry})
    got = store.lookup(TEST, "gpu:NVIDIA H200", 8)
    assert got is not None and got.allocated_ranks == {0: 1200.5, 1: 1750.2, 7: 2100.0}  # to 0.1 MiB
    assert got.rank_sites == {1: (site,)} and got.gated_rank == 7
    assert got.sites_of(1) == (site,) and got.sites_of(7)[0]["where"] == "test_pp.py:40" and got.sites_of(3) == ()
    assert '"rank_sites": {\n' in store.file_for(TEST).read_text()


def test_gpumem_show_aligns_nproc_1024_with_nproc_8(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Issue 55: `nproc=1024` pushed its row's figures one column right."""
    from pytest_gpumem import cli

    BaselineStore(tmp_path).update(TEST, CPU, {8: entry(512.0, world_size=8), 1024: entry(2048.0, world_size=1024)})
    assert cli.main(["show", "--baselines", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "nproc=" in line]
    assert len(rows) == 2 and len({row.index(" MiB") for row in rows}) == 1, rows
