"""CPUID feature detection against the kernel's own view in /proc/cpuinfo (independent oracle:
the kernel reads CPUID itself and clears what the OS does not enable)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from ktd import _native

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")


def cpuinfo_first_cpu() -> dict[str, str]:
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break  # end of the first processor's block
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


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


def test_identity_matches_proc_cpuinfo():
    info = cpuinfo_first_cpu()
    f = _native.cpu_features()
    assert f.vendor == info["vendor_id"]
    assert " ".join(f.model_name.split()) == " ".join(info["model name"].split())
    assert f.family == int(info["cpu family"])
    assert f.model == int(info["model"])
    assert f.stepping == int(info["stepping"])


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

