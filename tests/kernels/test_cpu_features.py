"""CPU feature detection against the kernel's own view.

x86-64: CPUID against /proc/cpuinfo (independent oracle: the kernel reads CPUID itself and clears
what the OS does not enable). aarch64: getauxval(AT_HWCAP/AT_HWCAP2) in C++ against the auxiliary
vector read here from /proc/self/auxv, with the bit numbers restated from the Linux arm64 ABI
(Documentation/arch/arm64/elf_hwcaps.rst); under qemu-user (make test-arm64) qemu provides both."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from ktd import _native

X86 = platform.machine() in ("x86_64", "AMD64")
AARCH64 = platform.machine() in ("aarch64", "arm64")
x86_only = pytest.mark.skipif(not X86, reason="x86-64 only")
aarch64_only = pytest.mark.skipif(not AARCH64, reason="aarch64 only")


def cpuinfo_first_cpu() -> dict[str, str]:
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break  # end of the first processor's block
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


@x86_only
def test_every_flag_matches_proc_cpuinfo():
    flags = set(cpuinfo_first_cpu()["flags"].split())
    got = _native.cpu_features().flags()
    assert len(got) >= 22
    mismatched = {name: value for name, value in got.items() if value != (name in flags)}
    assert not mismatched, f"CPUID and /proc/cpuinfo disagree: {mismatched}"


def test_attributes_match_flags():
    f = _native.cpu_features()
    for name, value in f.flags().items():
        assert getattr(f, name) == value


@x86_only
def test_identity_matches_proc_cpuinfo():
    info = cpuinfo_first_cpu()
    f = _native.cpu_features()
    assert f.vendor == info["vendor_id"]
    assert " ".join(f.model_name.split()) == " ".join(info["model name"].split())
    assert f.family == int(info["cpu family"])
    assert f.model == int(info["model"])
    assert f.stepping == int(info["stepping"])


@x86_only
def test_kernel_isa_support_follows_the_flags():
    # The rule is restated from CMakeLists.txt's per-ISA flags, not taken from the C++.
    flags = set(cpuinfo_first_cpu()["flags"].split())
    avx2 = {"avx2", "fma", "f16c", "bmi2", "popcnt"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi"} <= flags
    k = _native.kernels
    assert k.isa_supported("ref")
    assert k.isa_supported("avx2") == avx2
    assert k.isa_supported("avx512") == avx512
    # AVX-512 is opt-in (KTD_ISA=avx512): the default is AVX2 wherever the CPU has it.
    if "KTD_ISA" not in os.environ:
        assert k.active_isa() == ("avx2" if avx2 else "ref")



# (word, bit) of each flag in the auxiliary vector: AT_HWCAP = 16, AT_HWCAP2 = 26.
AT_HWCAP, AT_HWCAP2 = 16, 26
ARM_HWCAP_BITS = {
    "fp": (AT_HWCAP, 0), "asimd": (AT_HWCAP, 1), "asimdhp": (AT_HWCAP, 10), "asimddp": (AT_HWCAP, 20),
    "sve": (AT_HWCAP, 22), "sve2": (AT_HWCAP2, 1), "i8mm": (AT_HWCAP2, 13), "bf16": (AT_HWCAP2, 14),
}


def auxv() -> dict[int, int]:
    data = Path("/proc/self/auxv").read_bytes()
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data) - 7, 8)]
    return dict(zip(words[0::2], words[1::2]))


@aarch64_only
def test_arm_flags_match_auxv():
    av = auxv()
    got = _native.cpu_features().flags()
    assert set(got) == set(ARM_HWCAP_BITS)
    want = {name: bool((av.get(word, 0) >> b) & 1) for name, (word, b) in ARM_HWCAP_BITS.items()}
    assert got == want
    assert got["asimd"] and got["fp"]  # every Armv8-A Linux system


@aarch64_only
def test_arm_kernel_isa_support_follows_the_flags():
    # Restated from CMakeLists.txt: neon = armv8-a (Advanced SIMD + FP), dotprod = + asimddp,
    # i8mm = + asimddp + i8mm.
    f = _native.cpu_features().flags()
    k = _native.kernels
    assert k.isa_supported("neon") == (f["asimd"] and f["fp"])
    assert k.isa_supported("dotprod") == (f["asimd"] and f["fp"] and f["asimddp"])
    assert k.isa_supported("i8mm") == (f["asimd"] and f["fp"] and f["asimddp"] and f["i8mm"])
    for isa in ("avx2", "avx512"):
        assert not k.isa_supported(isa) and not k.isa_compiled(isa)
    if "KTD_ISA" not in os.environ:
        assert k.active_isa() == ("i8mm" if f["asimddp"] and f["i8mm"] else "dotprod" if f["asimddp"] else "neon")


@aarch64_only
def test_arm_identity_from_midr():
    midr = Path("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1")
    f = _native.cpu_features()
    if not midr.exists():
        assert f.vendor == "" and f.model == 0
        return
    v = int(midr.read_text(), 16)
    assert f.family == (v >> 24) & 0xFF
    assert f.model == (v >> 4) & 0xFFF
    assert f.stepping == ((v >> 20) & 0xF) << 4 | (v & 0xF)
