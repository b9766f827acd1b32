"""Per-ISA translation units must not leak wide instructions into code every CPU runs.

Two ways it can happen, both checked on the object files of the development build:
1. a baseline object (everything outside native/src/kernels/{avx2,avx512}) containing AVX/AVX-512
   register use (e.g. a flag added to the wrong target);
2. an inline function or template instantiated both in a baseline object and in an ISA object:
   the linker keeps ONE copy of such a weak symbol, possibly the AVX-512 one, which baseline code
   then calls — a SIGILL on a CPU without it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from paths import ROOT

BUILD = ROOT / "build" / "dev" / "CMakeFiles"


def _objects(target: str) -> list[Path]:
    return sorted((BUILD / f"{target}.dir").rglob("*.o"))


def _weak_symbols(obj: Path) -> set[str]:
    out = subprocess.run(["nm", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    return {parts[2] for parts in (line.split(" ", 2) for line in out.splitlines())
            if len(parts) == 3 and parts[1] in ("W", "V", "u")}


@pytest.fixture(scope="module")
def objects():
    if not shutil.which("nm") or not shutil.which("objdump"):
        pytest.skip("binutils (nm, objdump) not installed")
    base = _objects("_native") + _objects("ktd_isa_ref")
    if not base:
        pytest.skip(f"no development build objects under {BUILD} (run `make build`)")
    return {"base": base, "avx2": _objects("ktd_isa_avx2"), "avx512": _objects("ktd_isa_avx512")}


def test_baseline_objects_use_no_wide_registers(objects):
    offenders = []
    for obj in objects["base"]:
        dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)],
                             capture_output=True, text=True, check=True).stdout
        if re.search(r"%[yz]mm\d", dis):
            offenders.append(obj.name)
    assert offenders == []


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_no_weak_symbol_shared_between_isa_and_baseline(objects, isa):
    if not objects[isa]:
        pytest.skip(f"{isa} translation units not in this build")
    base = set().union(*(_weak_symbols(o) for o in objects["base"]))
    wide = set().union(*(_weak_symbols(o) for o in objects[isa]))
    assert sorted(base & wide) == []


# --- the aarch64 cross build (build/arm64, made by `make test-arm64`) -------------------------

ARM_BUILD = ROOT / "build" / "arm64" / "CMakeFiles"


@pytest.fixture(scope="module")
def arm_objects():
    if not shutil.which("aarch64-linux-gnu-objdump") or not shutil.which("aarch64-linux-gnu-nm"):
        pytest.skip("aarch64 binutils not installed (binutils-aarch64-linux-gnu, installed by make test-arm64)")
    base = sorted((ARM_BUILD / "_native.dir").rglob("*.o")) + sorted((ARM_BUILD / "ktd_isa_ref.dir").rglob("*.o"))
    if not base:
        pytest.skip(f"no aarch64 build objects under {ARM_BUILD} (run `make test-arm64`)")
    return {"base": base, "neon": sorted((ARM_BUILD / "ktd_isa_neon.dir").rglob("*.o")),
            "dotprod": sorted((ARM_BUILD / "ktd_isa_dotprod.dir").rglob("*.o")),
            "i8mm": sorted((ARM_BUILD / "ktd_isa_i8mm.dir").rglob("*.o"))}


def test_arm_baseline_objects_use_no_dot_product(arm_objects):
    """Armv8-A baseline code must not contain SDOT/UDOT/SMMLA (Armv8.2+ optional instructions)."""
    offenders = []
    for obj in arm_objects["base"] + arm_objects["neon"]:
        dis = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(obj)],
                             capture_output=True, text=True, check=True).stdout
        if re.search(r"\s(sdot|udot|usdot|smmla|ummla|usmmla)\s", dis):
            offenders.append(obj.name)
    assert offenders == []
    assert arm_objects["dotprod"], "no dotprod objects in the aarch64 build"
    assert arm_objects["i8mm"], "no i8mm objects in the aarch64 build"


def test_arm_dotprod_objects_use_no_matrix_multiply(arm_objects):
    """SMMLA & co. (FEAT_I8MM) only in the i8mm objects: a CPU with dotprod may lack i8mm."""
    offenders = []
    for obj in arm_objects["dotprod"]:
        dis = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(obj)],
                             capture_output=True, text=True, check=True).stdout
        if re.search(r"\s(smmla|ummla|usmmla|usdot|sudot)\s", dis):
            offenders.append(obj.name)
    assert offenders == []
    # ... and the i8mm tier really has its SMMLA tiles (the repacked Q8_0/Q4_0/Q4_K/Q6_K prefill).
    smmla = [o.name for o in arm_objects["i8mm"]
             if re.search(r"\ssmmla\s", subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(o)],
                                                       capture_output=True, text=True, check=True).stdout)]
    assert smmla, "no SMMLA in the i8mm objects"


@pytest.mark.parametrize("isa", ["neon", "dotprod", "i8mm"])
def test_arm_no_weak_symbol_shared_between_isa_and_baseline(arm_objects, isa):
    def weak(obj):
        out = subprocess.run(["aarch64-linux-gnu-nm", "--defined-only", str(obj)],
                             capture_output=True, text=True, check=True).stdout
        return {p[2] for p in (line.split(" ", 2) for line in out.splitlines())
                if len(p) == 3 and p[1] in ("W", "V", "u")}
    # dotprod objects must not share one with the NEON ones either (a CPU without SDOT runs NEON),
    # nor i8mm ones with the dotprod or NEON ones.
    lower = {"neon": [], "dotprod": ["neon"], "i8mm": ["neon", "dotprod"]}[isa]
    others = arm_objects["base"] + [o for i in lower for o in arm_objects[i]]
    base = set().union(*(weak(o) for o in others))
    wide = set().union(*(weak(o) for o in arm_objects[isa]))
    assert sorted(base & wide) == []
