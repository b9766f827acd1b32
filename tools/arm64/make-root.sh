#!/bin/bash
# Make (once) the arm64 Debian 12 root the aarch64 build is tested in, under
# ${KTD_ARM64_ROOT:-~/.cache/ktd/arm64-root}: debootstrap --arch=arm64 (minbase) with Debian's arm64
# python3, numpy, msgpack, yaml, pytest and the Python headers; the second stage runs under
# qemu-user-static through binfmt_misc. Needs root, debootstrap, qemu-user-static and a Debian
# mirror (KTD_DEBIAN_MIRROR).
set -euo pipefail
ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
MIRROR=${KTD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${KTD_PYTHON:-python3}
PKGS=python3,python3-numpy,python3-msgpack,python3-yaml,python3-jinja2,python3-pytest,python3-dev,pybind11-dev

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
# gguf-py (pure Python, not packaged by Debian 12) at the version the x86 tests use
# (requirements-dev.txt), copied from the development venv to /opt/ktd-pylib.
SITE=$("$PY" -c 'import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))')
mkdir -p "$ROOT/opt/ktd-pylib"
for item in gguf; do
    rm -rf "$ROOT/opt/ktd-pylib/$item"
    [ -e "$SITE/$item" ] && cp -r "$SITE/$item" "$ROOT/opt/ktd-pylib/$item"
done
find "$ROOT/opt/ktd-pylib" -name __pycache__ -prune -exec rm -rf {} +
echo "arm64 root ready: $ROOT"
