"""ktd's aarch64 wheel from the cross-built native module (`make deb ARCH=arm64`).

The native module is cross-compiled once (tools/arm64/cross-build.sh, the build `make test-arm64`
tests); this puts it into a wheel tagged cp311-cp311-linux_aarch64 beside the Python package
daemon/ktd, with the metadata (METADATA, entry_points.txt) that scikit-build-core's
prepare_metadata_for_build_wheel hook writes from pyproject.toml, i.e. what `pip wheel .` would
produce on an aarch64 machine, without a second compile.

usage: python make-wheel.py REPO NATIVE_SO OUTDIR   (prints the wheel's path)
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

TAG = "cp311-cp311-linux_aarch64"


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    repo, so, outdir = Path(argv[1]).resolve(), Path(argv[2]).resolve(), Path(argv[3]).resolve()
    if not so.name.endswith(".cpython-311-aarch64-linux-gnu.so"):
        print(f"make-wheel: {so} is not an aarch64 CPython 3.11 module", file=sys.stderr)
        return 1
    with open(so, "rb") as f:
        head = f.read(20)
    # ELF, 64-bit, little endian, e_machine 183 (EM_AARCH64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or int.from_bytes(head[18:20], "little") != 183:
        print(f"make-wheel: {so} is not an aarch64 ELF object", file=sys.stderr)
        return 1

    from scikit_build_core import build as skb

    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(repo)
        try:
            distinfo_name = skb.prepare_metadata_for_build_wheel(tmp)
        finally:
            os.chdir(cwd)
        distinfo = Path(tmp) / distinfo_name
        name, version = distinfo_name[: -len(".dist-info")].split("-", 1)
        files: list[tuple[str, bytes]] = []
        pkg = repo / "daemon" / "ktd"
        for path in sorted(pkg.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".so", ".pyc"):
                continue
            files.append((f"ktd/{path.relative_to(pkg).as_posix()}", path.read_bytes()))
        files.append((f"ktd/{so.name}", so.read_bytes()))
        for path in sorted(distinfo.rglob("*")):
            if path.is_file() and path.name not in ("WHEEL", "RECORD"):
                files.append((f"{distinfo_name}/{path.relative_to(distinfo).as_posix()}", path.read_bytes()))
        wheel_meta = (
            "Wheel-Version: 1.0\n"
            "Generator: ktd tools/arm64/make-wheel.py\n"
            "Root-Is-Purelib: false\n"
            f"Tag: {TAG}\n"
        ).encode()
        files.append((f"{distinfo_name}/WHEEL", wheel_meta))
        record = "\n".join(_record_line(a, d) for a, d in files) + f"\n{distinfo_name}/RECORD,,\n"
        files.append((f"{distinfo_name}/RECORD", record.encode()))

        outdir.mkdir(parents=True, exist_ok=True)
        out = outdir / f"{name}-{version}-{TAG}.whl"
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for arcname, data in files:
                info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o644 & 0xFFFF) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
