"""tools/arm64/make-wheel.py: ktd's aarch64 wheel around a cross-built module (make deb ARCH=arm64).

Checked with pip itself (an independent wheel installer): the wheel installs for an aarch64
CPython 3.11 target and not for x86-64, holds the Python package and the module, and carries the
metadata pyproject.toml declares (dependencies, console scripts).
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from paths import ROOT

REPO = ROOT
SCRIPT = REPO / "tools" / "arm64" / "make-wheel.py"
SUFFIX = ".cpython-311-aarch64-linux-gnu.so"


def fake_elf(path: Path, machine: int) -> Path:
    # ELF64 little-endian header with the given e_machine (183 = AArch64, 62 = x86-64).
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    head[4], head[5], head[6] = 2, 1, 1
    head[16:18] = (3).to_bytes(2, "little")   # ET_DYN
    head[18:20] = machine.to_bytes(2, "little")
    path.write_bytes(bytes(head) + b"module body")
    return path


def make_wheel(so: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(REPO), str(so), str(out)],
                          capture_output=True, text=True, timeout=300)


def pip_install(wheel: Path, target: Path, platform: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                           "--abi", "cp311", "--platform", platform, "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)


def test_wheel_installs_for_aarch64_with_package_module_and_metadata(tmp_path):
    so = fake_elf(tmp_path / f"_native{SUFFIX}", 183)
    r = make_wheel(so, tmp_path / "dist")
    assert r.returncode == 0, r.stderr
    wheel = Path(r.stdout.strip().splitlines()[-1])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name == f"ktd-{version}-cp311-cp311-linux_aarch64.whl"

    bad = pip_install(wheel, tmp_path / "x86", "manylinux2014_x86_64")
    assert bad.returncode != 0   # pip refuses it for another platform
    r = pip_install(wheel, tmp_path / "site", "linux_aarch64")
    assert r.returncode == 0, r.stderr
    site = tmp_path / "site"
    assert (site / "ktd" / so.name).read_bytes() == so.read_bytes()
    py_files = {p.relative_to(REPO / "daemon").as_posix() for p in (REPO / "daemon" / "ktd").rglob("*.py")
                if "__pycache__" not in p.parts}
    installed = {p.relative_to(site).as_posix() for p in (site / "ktd").rglob("*.py")}
    assert py_files == installed
    assert not list((site / "ktd").glob("*x86_64*")), "an x86 module went into the aarch64 wheel"

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    distinfo = next(site.glob("ktd-*.dist-info"))
    meta = (distinfo / "METADATA").read_text()
    requires = {line.split(":", 1)[1].strip().replace(" ", "").lower()
                for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    for dep in project["dependencies"]:
        assert dep.replace(" ", "").lower() in requires, (dep, requires)
    eps = configparser.ConfigParser()
    eps.read(distinfo / "entry_points.txt")
    assert dict(eps["console_scripts"]) == project["scripts"]
    with zipfile.ZipFile(wheel) as zf:
        assert "Tag: cp311-cp311-linux_aarch64" in zf.read(f"{distinfo.name}/WHEEL").decode()
        assert zf.testzip() is None


@pytest.mark.parametrize("name,machine", [(f"_native{SUFFIX}", 62),                       # x86-64 object
                                          ("_native.cpython-311-x86_64-linux-gnu.so", 183)])  # wrong suffix
def test_rejects_a_module_that_is_not_aarch64_cpython311(tmp_path, name, machine):
    so = fake_elf(tmp_path / name, machine)
    r = make_wheel(so, tmp_path / "dist")
    assert r.returncode == 1
    assert "aarch64" in r.stderr
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())
