#!/bin/bash
# `make test-arm64`: cross-compile the native module for aarch64 and run tests in the arm64
# Debian 12 root under qemu-user emulation, once per emulated CPU model:
#   max         every feature qemu emulates (dotprod, i8mm, ...): the widest kernels (i8mm) run;
#   cortex-a57  Armv8.0-A, no dotprod: the NEON fallbacks run.
# Speed means nothing under emulation; this checks correctness only.
#
# Environment: KTD_ARM64_ROOT (default ~/.cache/ktd/arm64-root), KTD_ARM64_CPUS (default
# "max cortex-a57"), KTD_ARM64_TESTS (the test files, default below), PYTEST_ARGS (extra pytest
# arguments), KTD_ARM64_BUILD (the cross build directory, default build/arm64).
# KTD_ARM64_LIST=ci (`make test-arm64-ci`, .ci/run): CI's shorter lists instead of the default one:
#   -cpu max         the kernels of every type on every tier (the tests force NEON, DOTPROD and
#                    I8MM in turn), the repacked layouts, the CPU features, the forward passes
#                    (tiny models of every architecture, dense and MoE, the i-quant DeepSeek-shaped
#                    file), the tokenizer and chat templates;
#   other models     what depends on the CPU model: the features and the default ISA it picks,
#                    the kernels and repacks of the tiers it has (NEON on cortex-a57), the dense
#                    and MoE forward passes through the fallback dispatch. (The tokenizer and chat
#                    code has no ISA-specific path: it runs once, under max.)
# The real models of the host's cache (${KTD_CACHE:-~/.cache/ktd}/models: the x86 `make test`
# fetches them) are bind-mounted read-only into the root, so that the real-model tokenizer tests
# run when they are there (KTD_NO_FETCH=1: without them those tests skip with the reason).
# Needs root (chroot, mounts), g++-aarch64-linux-gnu, qemu-user-static, mmdebstrap or debootstrap.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
export KTD_ARM64_ROOT=$ROOT
CPUS=${KTD_ARM64_CPUS:-max cortex-a57}
TESTS=${KTD_ARM64_TESTS:-tests/bench/test_bench_tuning.py tests/kernels/test_cpu_features.py tests/kernels/test_kernels_arm.py tests/kernels/test_repack_arm.py tests/kernels/test_kernels_smoke.py tests/kernels/test_kernels_q32.py tests/kernels/test_kernels_k.py tests/kernels/test_kernels_iq.py tests/kernels/test_attention.py tests/kernels/test_elementwise.py tests/text/test_sampling.py tests/kernels/test_thread_pool.py tests/model/test_forward.py tests/model/test_moe_forward.py tests/text/test_tokenizer.py tests/text/test_chat.py tests/text/test_structured_output.py}
CI_MAX="tests/bench/test_bench_tuning.py tests/kernels/test_cpu_features.py tests/kernels/test_kernels_arm.py tests/kernels/test_repack_arm.py tests/model/test_forward.py tests/model/test_moe_forward.py tests/model/test_iq_forward.py tests/text/test_tokenizer.py tests/text/test_chat.py"
CI_FALLBACK="tests/bench/test_bench_tuning.py tests/kernels/test_cpu_features.py tests/kernels/test_kernels_arm.py tests/kernels/test_repack_arm.py tests/model/test_forward.py tests/model/test_moe_forward.py"
case ${KTD_ARM64_LIST:-} in
    "") ;;
    ci) [ -z "${KTD_ARM64_TESTS:-}" ] || { echo "test-arm64: KTD_ARM64_LIST=ci and KTD_ARM64_TESTS both given" >&2; exit 2; } ;;
    *) echo "test-arm64: KTD_ARM64_LIST=${KTD_ARM64_LIST}: only ci" >&2; exit 2 ;;
esac
tests_for() {
    if [ "${KTD_ARM64_LIST:-}" = ci ]; then
        if [ "$1" = max ]; then echo "$CI_MAX"; else echo "$CI_FALLBACK"; fi
    else
        echo "$TESTS"
    fi
}
CMAKE=${CMAKE:-cmake}
NINJA=${NINJA:-ninja}
HOST_PY=${KTD_HOST_PYTHON:-$REPO/.venv/bin/python}
[ -x "$HOST_PY" ] || HOST_PY=python3
command -v aarch64-linux-gnu-g++ >/dev/null || { echo "test-arm64: aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)" >&2; exit 1; }

t0=$(date +%s)
KTD_PYTHON=$HOST_PY "$REPO/tools/arm64/make-root.sh"
echo "=== arm64 root: $(( $(date +%s) - t0 )) s ==="

# Cross build (tools/arm64/cross-build.sh, shared with `make deb ARCH=arm64`; pybind11 is
# header-only: the host's copy is used).
BUILD=${KTD_ARM64_BUILD:-$REPO/build/arm64}
t0=$(date +%s)
SO=$(KTD_ARM64_BUILD=$BUILD KTD_HOST_PYTHON=$HOST_PY CMAKE=$CMAKE NINJA=$NINJA "$REPO/tools/arm64/cross-build.sh" | tail -1)
echo "=== aarch64 cross build: $(( $(date +%s) - t0 )) s ==="

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
# A run killed before its cleanup leaves its mounts behind, and once their source is gone (a
# checkout deleted and cloned again at the same path) the mount point cannot be mounted over
# (mount: ENOENT). So this checkout's own mount points are detached first (not proc, sys and dev,
# which runs from other checkouts may be using), and a mount that fails stops the run.
detach_stale() { while mountpoint -q "$1"; do umount -R -l "$1" || return 1; done; }
must() { "$@" || { echo "test-arm64: $* failed" >&2; exit 1; }; }
for m in proc sys dev; do mkdir -p "$ROOT/$m"; done
must mount -t proc proc "$ROOT/proc" && mounts+=("$ROOT/proc")
must mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys" && mounts+=("$ROOT/sys")
must mount --bind /dev "$ROOT/dev" && mounts+=("$ROOT/dev")
must detach_stale "$ROOT$MNT"
mkdir -p "$ROOT$MNT"
must mount --bind "$REPO" "$ROOT$MNT" && mounts+=("$ROOT$MNT")
# The package (it may live outside the worktree: KTD_ARM64_BUILD).
PKG_MNT=$MNT-py
must detach_stale "$ROOT$PKG_MNT"
mkdir -p "$ROOT$PKG_MNT"
must mount --bind "$PKG" "$ROOT$PKG_MNT" && mounts+=("$ROOT$PKG_MNT")
# The host's model cache, read-only, as KTD_CACHE's models/ in the root (one mount point per
# checkout, as above).
MODELS=${KTD_CACHE:-$HOME/.cache/ktd}/models
CACHE_MNT=$MNT-cache
if [ -d "$MODELS" ]; then
    must detach_stale "$ROOT$CACHE_MNT/models"
    mkdir -p "$ROOT$CACHE_MNT/models"
    must mount --bind "$MODELS" "$ROOT$CACHE_MNT/models" && mounts+=("$ROOT$CACHE_MNT/models")
    must mount -o remount,bind,ro "$ROOT$CACHE_MNT/models"
    echo "real models: $MODELS (read-only in the root: $(ls "$MODELS"/*.gguf 2>/dev/null | wc -l) files)"
else
    echo "real models: $MODELS absent (the real-model tests skip; the x86 make test fetches them)"
fi

rc=0
for cpu in $CPUS; do
    echo "=== arm64 tests under qemu -cpu $cpu ==="
    start=$(date +%s)
    # QEMU_CPU is read by qemu-aarch64-static, which binfmt_misc runs for every arm64 program.
    if ! chroot "$ROOT" /usr/bin/env -i QEMU_CPU="$cpu" HOME=/tmp PATH=/usr/bin:/bin LANG=C.UTF-8 \
        PYTHONPATH=$PKG_MNT:$MNT/tests:/opt/ktd-pylib PYTHONDONTWRITEBYTECODE=1 KTD_NO_FETCH=1 \
        KTD_CACHE=$CACHE_MNT /bin/sh -c "cd $MNT && python3 -m pytest -p no:cacheprovider -q -rs $(tests_for "$cpu") ${PYTEST_ARGS:-}"; then
        rc=1
    fi
    echo "=== -cpu $cpu: $(( $(date +%s) - start )) s ==="
done
exit $rc
