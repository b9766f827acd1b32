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

BUILD = Path(__file__).resolve().parent.parent / "build" / "dev" / "CMakeFiles"


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
