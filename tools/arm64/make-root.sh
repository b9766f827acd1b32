#!/bin/bash
# Make (once) the arm64 Debian 12 root the aarch64 build is tested in, under
# ${KTD_ARM64_ROOT:-~/.cache/ktd/arm64-root}: debootstrap --arch=arm64 (minbase) with Debian's arm64
# python3, numpy, msgpack, yaml, pytest and the Python headers; the second stage runs under
# qemu-user-static through binfmt_misc. Needs root, debootstrap, qemu-user-static and a Debian
# mirror (KTD_DEBIAN_MIRROR). gguf-py (pure Python, the kernel tests' oracle) is copied in from
# the development venv at the version pinned in requirements-dev.txt.
set -euo pipefail
ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
MIRROR=${KTD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${KTD_PYTHON:-python3}
PKGS=python3,python3-numpy,python3-msgpack,python3-yaml,python3-pytest,python3-dev,pybind11-dev

"$(dirname "$0")/binfmt.sh"
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    for tool in debootstrap qemu-aarch64-static; do
        command -v $tool >/dev/null || { echo "make-root.sh: $tool not found (apt-get install debootstrap qemu-user-static)" >&2; exit 1; }
    done
    rm -rf "$ROOT.partial"
    mkdir -p "$(dirname "$ROOT")"
    debootstrap --arch=arm64 --variant=minbase --include=$PKGS bookworm "$ROOT.partial" "$MIRROR"
    mv "$ROOT.partial" "$ROOT"
fi
# gguf-py: pure Python; the same copy the x86 tests use.
GGUF=$("$PY" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')
mkdir -p "$ROOT/opt/ktd-pylib"
rm -rf "$ROOT/opt/ktd-pylib/gguf"
cp -r "$GGUF" "$ROOT/opt/ktd-pylib/gguf"
echo "arm64 root ready: $ROOT"
