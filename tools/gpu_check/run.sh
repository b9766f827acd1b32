#!/bin/bash
# make gpu-check: one run on a machine with an NVIDIA GPU (driver R580+ for CUDA 13), meant for a
# short device window. Writes ONE JSON, $GPU_CHECK_OUT (default bench/results/gpu-check.json;
# $OUT/gpu-check.json when $OUT is set, as on a lent device machine):
#   machine   nvidia-smi's GPU, driver, compute capability; python; nvcc
#   build     how ktd._native and libktd_cuda.so were obtained (carried or built here) and the time
#   status    ktd._native.cuda_status()
#   tests     every gpu-marked test (kernels vs gguf-py/numpy) and the CPU-side cuda tests: outcome,
#             duration, the failure text
#   bench     tools/gpu_check/hybrid_bench.py: greedy on Qwen2.5-Coder-0.5B CPU vs device, hybrid vs
#             CPU-only prefill/decode on the MoE bench files with HybridStats; or why not
# Steps: a venv from the carried wheelhouse (build/gpu-carry/wheels, tools/gpu_check/carry.sh)
# when numpy/gguf/pytest are missing; the native module built with KTD_CUDA=ON for this GPU's
# architecture unless a carried build matches this Python; pytest -m gpu.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=${OUT:-$ROOT/bench/results}
mkdir -p "$RESULTS"
JSON=${GPU_CHECK_OUT:-$RESULTS/gpu-check.json}
WORK=$ROOT/build/gpu-check
mkdir -p "$WORK"
LOG=$WORK/log.txt
: >"$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
t0=$(date +%s)

# --- Python with numpy, gguf, pytest, pybind11, cmake, ninja ---------------------------------
PY=${KTD_GPU_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3); fi
fi
need_venv=0
"$PY" -c 'import numpy, gguf, pytest, yaml, msgpack, pybind11, cmake, ninja' 2>/dev/null || need_venv=1
if [ $need_venv = 1 ]; then
  WH=$ROOT/build/gpu-carry/wheels
  say "venv $WORK/venv from $WH (numpy/gguf/pytest/pybind11 missing for $PY)"
  "$PY" -m venv --system-site-packages "$WORK/venv" >>"$LOG" 2>&1 || "$PY" -m venv "$WORK/venv" >>"$LOG" 2>&1
  PY=$WORK/venv/bin/python
  "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WH" \
    numpy gguf pytest pyyaml msgpack pybind11 cmake ninja tqdm requests >>"$LOG" 2>&1 || say "pip install from the wheelhouse failed (see $LOG)"
fi
PYTAG=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')

# --- ktd._native + libktd_cuda.so ------------------------------------------------------------
build_how="carried"
if ! ls "$ROOT/daemon/ktd/_native$PYTAG" >/dev/null 2>&1 || [ ! -f "$ROOT/daemon/ktd/libktd_cuda.so" ] \
   || [ -n "${GPU_CHECK_REBUILD:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  arch=${cc:-90}
  NVCC=${CUDACXX:-$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)}
  say "build: _native$PYTAG and libktd_cuda.so for sm_$arch with ${NVCC:-no nvcc}"
  build_how="built here for sm_$arch"
  CMAKE=$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null || command -v cmake)
  NINJA=$("$PY" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))' 2>/dev/null || command -v ninja)
  { "$CMAKE" -S . -B build/gpu -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" -DKTD_INPLACE=ON -DKTD_WERROR=ON \
      -DKTD_CUDA=ON -DKTD_CUDA_ARCHITECTURES="$arch" ${NVCC:+-DCMAKE_CUDA_COMPILER="$NVCC"} \
      -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
    && "$CMAKE" --build build/gpu --parallel "$(nproc)"; } >>"$LOG" 2>&1 || { say "build failed (see $LOG)"; build_how="build failed"; }
fi
t_build=$(( $(date +%s) - t0 ))

# --- tests -----------------------------------------------------------------------------------
say "tests: gpu-marked kernels + the CPU-side cuda tests"
export PYTHONPATH=$ROOT/daemon:$ROOT/tests
"$PY" -m pytest -q -rA -p no:cacheprovider --junitxml="$WORK/junit.xml" \
  tests/kernels/test_cuda_block_math.py tests/kernels/test_cuda_ops.py tests/model/test_cuda_device_emulated.py \
  ${GPU_CHECK_PYTEST_ARGS:-} >>"$LOG" 2>&1
rc=$?

# --- end to end: greedy on the real model, hybrid vs CPU-only on the MoE bench files ------------
# (tools/gpu_check/hybrid_bench.py; exits 2 with the reason in its JSON when CUDA cannot run)
say "bench: the CUDA device backend end to end (hybrid_bench.py)"
"$PY" "$ROOT/tools/gpu_check/hybrid_bench.py" --out "$WORK/hybrid.json" ${GPU_CHECK_BENCH_ARGS:-} >>"$LOG" 2>&1
bench_rc=$?
[ $rc = 0 ] && rc=$bench_rc

# --- the one JSON ----------------------------------------------------------------------------
"$PY" "$ROOT/tools/gpu_check/report.py" --junit "$WORK/junit.xml" --log "$LOG" --build "$build_how" \
  --build-seconds "$t_build" --pytest-rc "$rc" --bench "$WORK/hybrid.json" --out "$JSON"
echo "gpu-check: $JSON"
tail -5 "$LOG"
exit $rc
