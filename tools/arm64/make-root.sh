#!/bin/bash
# Make (once) the arm64 Debian 12 root the aarch64 build is tested and packaged in, under
# ${KTD_ARM64_ROOT:-~/.cache/ktd/arm64-root}:
#   - Debian's arm64 python3, numpy, msgpack, yaml, jinja2, pytest and the Python headers (tests);
#   - debhelper, python3-venv, python3-pip, gcc, libsystemd-dev (`make deb ARCH=arm64` runs
#     dpkg-buildpackage in this root, so that dh_shlibdeps reads arm64 libraries and the arm64
#     dpkg database; systemd-python's C extension is cross-compiled on the host with this root as
#     its sysroot: libc6-dev, libsystemd-dev and the python3.11 headers);
#   - /opt/ktd-pylib: what Debian 12 lacks or has too old, from the package index's aarch64/pure
#     wheels at the pins of requirements-dev.txt (gguf, hypothesis, llguidance, jsonschema),
#     installed from the host with `pip install --target --platform` (no emulation needed).
# mmdebstrap --variant=extract when the host has it (parallel downloads, debs cached in
# ${KTD_DEBIAN_CACHE:-${KTD_CACHE:-~/.cache/ktd}/debian}/arm64-archives for the next root; the packages are unpacked and
# recorded in the dpkg database by the host, no maintainer script runs: see below), else
# debootstrap (whose second stage configures every package under qemu-user-static: slow). Needs
# root, binfmt_misc and a Debian mirror (KTD_DEBIAN_MIRROR) and the package index (pip) the first
# time. Cold, on a 2-core machine at load ~5: 3 min 28 s wall, 91 s CPU (was 51 min wall, 6.7 min
# CPU at load 13-22 with every package configured under qemu).
# An existing root made by an older version of this script gets the missing packages by apt-get.
set -euo pipefail
ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
MIRROR=${KTD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${KTD_CACHE:-$HOME/.cache/ktd}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${KTD_PYTHON:-python3}
TEST_PKGS=python3,python3-numpy,python3-msgpack,python3-yaml,python3-jinja2,python3-pytest,python3-dev,pybind11-dev
BUILD_PKGS=debhelper,python3-venv,python3-pip,gcc,libc6-dev,libsystemd-dev,pkg-config
PKGS=$TEST_PKGS,$BUILD_PKGS

"$(dirname "$0")/binfmt.sh"

# What the maintainer scripts of an extracted root would have done that its uses need (the rest —
# byte-compiling, certificates, debconf, man-db — nothing here reads):
#   base-passwd   /etc/passwd and /etc/group from its master files (pytest, dpkg-buildpackage's
#                 chown, getpwuid);
#   dash          /bin/sh -> dash (its postinst makes the link behind a diversion);
#   base-files    /etc/dpkg/origins/default -> debian (dpkg-gencontrol's vendor);
#   libc-bin      the ld.so cache (one emulated ldconfig; the multiarch directories are ld.so's
#                 defaults, the cache only saves lookups);
#   python3.11    nothing: the interpreter, its stdlib and the python3 links are files of the
#                 packages (the .pyc files are not written: the tests run with
#                 PYTHONDONTWRITEBYTECODE=1, as before).
configure_by_hand() {
    local r=$1
    [ -s "$r/etc/passwd" ] || install -m 0644 "$r/usr/share/base-passwd/passwd.master" "$r/etc/passwd"
    [ -s "$r/etc/group" ] || install -m 0644 "$r/usr/share/base-passwd/group.master" "$r/etc/group"
    [ -e "$r/usr/bin/sh" ] || ln -s dash "$r/usr/bin/sh"
    [ -e "$r/etc/dpkg/origins/default" ] || ln -s debian "$r/etc/dpkg/origins/default"
    chroot "$r" /sbin/ldconfig
    chroot "$r" /usr/bin/python3 -c 'import numpy, msgpack, yaml, jinja2, pytest' \
        || { echo "make-root.sh: the extracted root's python3 cannot import numpy/msgpack/yaml/jinja2/pytest" >&2; exit 1; }
}
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    command -v qemu-aarch64-static >/dev/null || { echo "make-root.sh: qemu-aarch64-static not found (apt-get install qemu-user-static)" >&2; exit 1; }
    rm -rf "$ROOT.partial"
    mkdir -p "$(dirname "$ROOT")"
    if command -v mmdebstrap >/dev/null; then
        debs=${KTD_DEBIAN_CACHE:-$CACHE/debian}/arm64-archives
        mkdir -p "$debs"
        # --variant=extract: the packages (Essential ones, the lists above and their dependencies)
        # are unpacked by the host's dpkg-deb and tar, and none of their maintainer scripts runs:
        # configuring them under qemu took 6.7 min of emulated CPU (c_rehash, py3compile, perl;
        # 51 min wall on a loaded 2-core machine). What those scripts do that matters here is done
        # from the host below and by dpkg-register.py (the dpkg database, the alternatives).
        # No manual pages or translations. Merged /usr (Debian 12) as debootstrap makes it. (The
        # customize hooks do not run for this variant: the extract hooks do the rest.)
        mmdebstrap --mode=root --arch=arm64 --variant=extract --include='?essential' \
            --include="usr-is-merged,$PKGS" \
            --setup-hook=/usr/share/mmdebstrap/hooks/merged-usr/setup00.sh \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
            --setup-hook="sync-in $debs /var/cache/apt/archives/" \
            --skip=download/empty \
            --extract-hook="sync-out /var/cache/apt/archives $debs" \
            --extract-hook="python3 '$REPO/tools/arm64/dpkg-register.py' \"\$1\" \"\$1\"/var/cache/apt/archives/*.deb" \
            bookworm "$ROOT.partial" "$MIRROR"
        configure_by_hand "$ROOT.partial"
    else
        command -v debootstrap >/dev/null || { echo "make-root.sh: neither mmdebstrap nor debootstrap found" >&2; exit 1; }
        debootstrap --arch=arm64 --variant=minbase --include=$PKGS bookworm "$ROOT.partial" "$MIRROR"
    fi
    mv "$ROOT.partial" "$ROOT"
fi
# A root made before the build packages were added: install what is missing.
# (one emulated dpkg-query for all of them)
installed=$(chroot "$ROOT" dpkg-query -W -f='${Package} ${Status}\n' ${PKGS//,/ } 2>/dev/null | sed -n 's/ install ok installed$//p' || true)
missing=()
for p in ${PKGS//,/ }; do
    grep -qx "$p" <<<"$installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "make-root.sh: apt-get install ${missing[*]} in $ROOT"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
    echo "man-db man-db/auto-update boolean false" | chroot "$ROOT" debconf-set-selections
    chroot "$ROOT" apt-get update -qq
    chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    chroot "$ROOT" apt-get clean
fi

# /opt/ktd-pylib from wheels at the pins of requirements-dev.txt, remade when the list changes.
# llguidance 1.9.1's aarch64 wheel is manylinux_2_31 (Debian 12 has glibc 2.36): every manylinux
# level up to 2.36 is offered to pip.
PYLIB_REQS=$(grep -iE '^(gguf|hypothesis|sortedcontainers|attrs|llguidance|jsonschema|jsonschema-specifications|referencing|rpds-py|typing_extensions)==' "$REPO/requirements-dev.txt" | sort)
# gguf's own dependencies are not needed by the tests (numpy and yaml come from Debian); hypothesis
# needs attrs and sortedcontainers.
grep -q '^sortedcontainers==' <<<"$PYLIB_REQS" || PYLIB_REQS+=$'\nsortedcontainers==2.4.0'
STAMP=$ROOT/opt/ktd-pylib/.requirements
if [ "$(cat "$STAMP" 2>/dev/null)" != "$PYLIB_REQS" ]; then
    platforms=()
    for v in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${v}_aarch64"); done
    platforms+=(--platform manylinux2014_aarch64 --platform linux_aarch64)
    # Installed beside the old one and swapped in (other worktrees' runs may be using the root).
    NEW=$ROOT/opt/ktd-pylib.new
    rm -rf "$NEW" "$ROOT/opt/ktd-pylib.old"
    mkdir -p "$NEW"
    printf '%s\n' "$PYLIB_REQS" >"$ROOT/opt/ktd-pylib.requirements.txt"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none "${platforms[@]}" \
        --target "$NEW" -r "$ROOT/opt/ktd-pylib.requirements.txt"
    rm -f "$ROOT/opt/ktd-pylib.requirements.txt"
    rm -rf "$NEW/bin"
    find "$NEW" -name __pycache__ -prune -exec rm -rf {} +
    printf '%s' "$PYLIB_REQS" >"$NEW/.requirements"
    [ ! -e "$ROOT/opt/ktd-pylib" ] || mv "$ROOT/opt/ktd-pylib" "$ROOT/opt/ktd-pylib.old"
    mv "$NEW" "$ROOT/opt/ktd-pylib"
    rm -rf "$ROOT/opt/ktd-pylib.old"
fi
echo "arm64 root ready: $ROOT"
