#!/bin/bash
# `make test-arm64`: cross-compile the native module for aarch64 and run tests in the arm64
# Debian 12 root under qemu-user emulation, once per emulated CPU model:
#   max         every feature qemu emulates (dotprod, i8mm, ...): the widest kernels (i8mm) run;
#   cortex-a57  Armv8.0-A, no dotprod: the NEON fallbacks run.
# Speed means nothing under emulation; this checks correctness only.
#
# Environment: KTD_ARM64_ROOT (default ~/.cache/ktd/arm64-root), KTD_ARM64_CPUS (default
# "max cortex-a57"), KTD_ARM64_TESTS (the test files, default below), PYTEST_ARGS (extra pytest
# arguments). Needs root (chroot, mounts), g++-aarch64-linux-gnu, qemu-user-static, debootstrap.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
export KTD_ARM64_ROOT=$ROOT
CPUS=${KTD_ARM64_CPUS:-max cortex-a57}
TESTS=${KTD_ARM64_TESTS:-tests/test_cpu_features.py tests/test_kernels_arm.py tests/test_repack_arm.py tests/test_kernels_smoke.py tests/test_kernels_q32.py tests/test_kernels_k.py tests/test_kernels_iq.py tests/test_attention.py tests/test_elementwise.py tests/test_sampling.py tests/test_thread_pool.py tests/test_forward.py tests/test_moe_forward.py tests/test_tokenizer.py tests/test_chat.py tests/test_structured_output.py}
CMAKE=${CMAKE:-cmake}
NINJA=${NINJA:-ninja}
HOST_PY=${KTD_HOST_PYTHON:-$REPO/.venv/bin/python}
[ -x "$HOST_PY" ] || HOST_PY=python3
command -v aarch64-linux-gnu-g++ >/dev/null || { echo "test-arm64: aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)" >&2; exit 1; }

KTD_PYTHON=$HOST_PY "$REPO/tools/arm64/make-root.sh"

# Cross build (tools/arm64/cross-build.sh, shared with `make deb ARCH=arm64`; pybind11 is
# header-only: the host's copy is used).
BUILD=$REPO/build/arm64
SO=$(KTD_ARM64_BUILD=$BUILD KTD_HOST_PYTHON=$HOST_PY CMAKE=$CMAKE NINJA=$NINJA "$REPO/tools/arm64/cross-build.sh" | tail -1)

# The package as the root sees it: the Python sources plus the aarch64 module (the x86 module in
# daemon/ktd, if any, stays out of it).
PKG=$BUILD/py
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r "$REPO/daemon/ktd" "$PKG/ktd"
find "$PKG/ktd" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp "$SO" "$PKG/ktd/"

# The worktree at /ktd-<name of its directory> in the root (one mount point per checkout, so runs
# from several worktrees sharing the root do not see each other's tree); /proc (auxv, cpuinfo) and
# /sys (topology) from the host.
MNT=/ktd-$(basename "$REPO" | tr -c 'A-Za-z0-9_.\n-' _)
mounts=()
cleanup() { for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -R "${mounts[i]}" || true; done; }
trap cleanup EXIT
for m in proc sys dev "$MNT"; do mkdir -p "$ROOT/$m"; done
mount -t proc proc "$ROOT/proc" && mounts+=("$ROOT/proc")
mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys" && mounts+=("$ROOT/sys")
mount --bind /dev "$ROOT/dev" && mounts+=("$ROOT/dev")
mount --bind "$REPO" "$ROOT$MNT" && mounts+=("$ROOT$MNT")

rc=0
for cpu in $CPUS; do
    echo "=== arm64 tests under qemu -cpu $cpu ==="
    start=$(date +%s)
    # QEMU_CPU is read by qemu-aarch64-static, which binfmt_misc runs for every arm64 program.
    if ! chroot "$ROOT" /usr/bin/env -i QEMU_CPU="$cpu" HOME=/tmp PATH=/usr/bin:/bin LANG=C.UTF-8 \
        PYTHONPATH=$MNT/build/arm64/py:$MNT/tests:/opt/ktd-pylib PYTHONDONTWRITEBYTECODE=1 KTD_NO_FETCH=1 \
        /bin/sh -c "cd $MNT && python3 -m pytest -p no:cacheprovider -q $TESTS ${PYTEST_ARGS:-}"; then
        rc=1
    fi
    echo "=== -cpu $cpu: $(( $(date +%s) - start )) s ==="
done
exit $rc
