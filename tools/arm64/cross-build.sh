#!/bin/bash
# Cross-compile ktd's native module for aarch64 (Debian's g++-aarch64-linux-gnu, the toolchain
# file tools/arm64/toolchain-aarch64.cmake, the Python headers of the arm64 root) into
# ${KTD_ARM64_BUILD:-build/arm64} and print the module's path on the last line. One build serves
# both `make test-arm64` (every emulated CPU model) and `make deb ARCH=arm64`; ccache is used when
# the host has it. Environment: KTD_ARM64_ROOT (required), CMAKE, NINJA, KTD_HOST_PYTHON (pybind11's
# CMake files; pybind11 is header-only), KTD_WERROR (default ON), KTD_ARM64_JOBS.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
: "${KTD_ARM64_ROOT:?}"
CMAKE=${CMAKE:-cmake}
NINJA=${NINJA:-ninja}
HOST_PY=${KTD_HOST_PYTHON:-$REPO/.venv/bin/python}
[ -x "$HOST_PY" ] || HOST_PY=python3
BUILD=${KTD_ARM64_BUILD:-$REPO/build/arm64}
command -v aarch64-linux-gnu-g++ >/dev/null || { echo "cross-build: aarch64-linux-gnu-g++ not found (apt-get install g++-aarch64-linux-gnu)" >&2; exit 1; }
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
"$CMAKE" -S "$REPO" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$(command -v "$NINJA")" \
    -DCMAKE_TOOLCHAIN_FILE="$REPO/tools/arm64/toolchain-aarch64.cmake" -DKTD_ARM64_ROOT="$KTD_ARM64_ROOT" \
    -DKTD_WERROR="${KTD_WERROR:-ON}" -DKTD_CUDA=OFF -DPython_EXECUTABLE="$HOST_PY" \
    -Dpybind11_DIR="$("$HOST_PY" -m pybind11 --cmakedir)" "${launcher[@]}" >/dev/null
"$CMAKE" --build "$BUILD" --parallel "${KTD_ARM64_JOBS:-$(nproc)}" >&2
SO=$(ls "$BUILD"/_native*.so)
file "$SO" | grep -q 'ARM aarch64' || { echo "cross-build: $SO is not an aarch64 object" >&2; exit 1; }
echo "$SO"
