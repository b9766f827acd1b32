#!/usr/bin/env bash
# Install the llama.cpp oracle (llama-cpp-python) into the project venv.
#
# llama-cpp-python ships only an sdist that compiles llama.cpp (several minutes on 2 cores), so
# the wheel is built once into a cache outside the repository and reinstalled from there:
#   ${KTD_CACHE:-~/.cache/ktd}/wheels/llama_cpp_python-<version>-*.whl
# Idempotent: with the wheel cached and installed this takes about a second.
# Usage: tools/oracle.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
PY=${1:-.venv/bin/python}
CACHE=${KTD_CACHE:-$HOME/.cache/ktd}/wheels

if "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
    exit 0
fi

mkdir -p "$CACHE"
shopt -s nullglob
wheels=("$CACHE"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*_"$(uname -m)".whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "oracle: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (compiles llama.cpp; several minutes)" >&2
    start=$(date +%s)
    # Portable x86-64 build with AVX2/FMA/F16C (no -march=native: the wheel is cached and may be
    # reused on another machine of the same kind); no curl (no network), no examples/tests/tools.
    # On aarch64: Armv8.2-A with dotprod (Neoverse N1/Graviton2 and later; ktd's dotprod kernels
    # are the comparable path), KTD_ORACLE_ARM_ARCH overrides it (e.g. armv8.6-a+i8mm on a CPU
    # with i8mm); the x86 options do not apply there.
    isa_args="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    case $("$PY" -c 'import platform; print(platform.machine())') in
        aarch64|arm64) isa_args="-DGGML_CPU_ARM_ARCH=${KTD_ORACLE_ARM_ARCH:-armv8.2-a+dotprod}" ;;
    esac
    CMAKE_ARGS="-DGGML_NATIVE=OFF $isa_args \
-DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "$PY" -m pip wheel --no-deps -w "$CACHE" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    echo "oracle: built in $(( $(date +%s) - start )) s" >&2
    wheels=("$CACHE"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*_"$(uname -m)".whl)
fi
# Runtime dependencies (typing-extensions, numpy, diskcache, jinja2) come from the index.
"$PY" -m pip install -q "${wheels[0]}"
