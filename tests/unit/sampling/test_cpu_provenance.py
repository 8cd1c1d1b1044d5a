"""``cpu_provenance()``: the CPU facts that move a host figure, read from a fake /proc and /sys tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpumem.sampling.identity import cpu_provenance

XEON_FLAGS = "fpu sse4_2 avx avx2 avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8"
EPYC_FLAGS = "fpu sse4_2 avx avx2 fma sha_ni"


def fake_root(tmp_path: Path, vendor: str, model: str, flags: str, cpus: int = 2,
              caches: dict[str, tuple[str, str]] | None = None) -> Path:
    """A /proc/cpuinfo of ``cpus`` processors and cpu0's cache folders: {index: (level type, size)}."""
    block = f"vendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    info = "\n".join(f"processor\t: {n}\n{block}" for n in range(cpus))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(info)
    for index, (level_type, size) in (caches or {}).items():
        level, kind = level_type.split()
        folder = tmp_path / "sys/devices/system/cpu/cpu0/cache" / index
        folder.mkdir(parents=True)
        (folder / "level").write_text(level + "\n")
        (folder / "type").write_text(kind + "\n")
        (folder / "size").write_text(size + "\n")
    return tmp_path


def test_xeon_with_amx(tmp_path):
    root = fake_root(tmp_path, "GenuineIntel", "Intel(R) Xeon(R)  Processor", XEON_FLAGS, cpus=2, caches={
        "index0": ("1 Data", "48K"), "index1": ("1 Instruction", "64K"),
        "index2": ("2 Unified", "2048K"), "index3": ("3 Unified", "491520K")})
    assert cpu_provenance(root) == {
        "cpu_model": "Intel(R) Xeon(R) Processor", "cpu_vendor": "GenuineIntel", "cpu_isa": "amx",
        "cpu_count": "2", "l2_cache": "2048 KiB", "l3_cache": "491520 KiB"}


def test_epyc_without_avx512(tmp_path):
    root = fake_root(tmp_path, "AuthenticAMD", "AMD EPYC 7B13", EPYC_FLAGS, cpus=4, caches={
        "index2": ("2 Unified", "512K"), "index3": ("3 Unified", "32M")})
    facts = cpu_provenance(root)
    assert facts["cpu_vendor"] == "AuthenticAMD" and facts["cpu_isa"] == "avx2"
    assert (facts["cpu_count"], facts["l2_cache"], facts["l3_cache"]) == ("4", "512 KiB", "32768 KiB")


@pytest.mark.parametrize("flags, isa", [
    ("fpu sse4_2 avx avx2 avx512f", "avx512"), ("fpu sse4_2 avx", "avx"), ("fpu sse4_2", "sse4_2"),
    ("fpu sse2", "baseline")])
def test_isa_is_the_best_the_flags_prove(tmp_path, flags, isa):
    assert cpu_provenance(fake_root(tmp_path, "GenuineIntel", "x", flags))["cpu_isa"] == isa


def test_what_cannot_be_read_is_left_out_not_guessed(tmp_path):
    """No cpuinfo (or an ARM one without flags) and no cache folders: only the facts found."""
    assert cpu_provenance(tmp_path / "nothing") == {}
    arm = tmp_path / "arm"
    (arm / "proc").mkdir(parents=True)
    (arm / "proc/cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd\n\nprocessor\t: 1\n")
    assert cpu_provenance(arm) == {"cpu_count": "2"}


def test_values_are_flat_strings_and_the_result_is_a_copy(tmp_path):
    root = fake_root(tmp_path, "GenuineIntel", "Intel(R) Xeon(R) Processor", XEON_FLAGS)
    facts = cpu_provenance(root)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in facts.items())
    facts["cpu_model"] = "changed"
    assert cpu_provenance(root)["cpu_model"] == "Intel(R) Xeon(R) Processor"


def test_this_machine():
    """The real /proc and /sys: whatever is there, flat strings and never a hostname."""
    import socket

    facts = cpu_provenance()
    assert all(isinstance(v, str) and v for v in facts.values())
    assert socket.gethostname() not in facts.values()
