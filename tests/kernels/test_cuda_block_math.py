"""The CUDA backend without a GPU: its block arithmetic (native/src/cuda/block_math.h, the same
__host__ __device__ code the kernels run, compiled here for the CPU) against gguf-py and numpy,
and cuda_status() giving a reason where the backend cannot run. On a machine with a CUDA device
the `gpu` tests run the kernels themselves against the same oracles.

dot(): the activations are quantized to int8 per 32 (scale amax/127, round half away from zero),
as the kernels do; the oracle is numpy's float64 product of gguf-py's dequantized weights with
the same quantized activations, so the only difference left is float32 accumulation:
|got − want| ≤ 1e-5 · Σ|w_i · a_i|.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kernel_oracle import dequantize_ref, row_bytes
from ktd import _native

CM = _native.cuda_math
TYPES_32 = ["Q4_0", "Q5_0", "Q8_0"]        # gguf-py quantizes these
TYPES_T = ["TQ1_0", "TQ2_0"]               # and these (ternary, blocks of 256)
TYPES_K = {"Q4_K": (144, [0, 2]), "Q5_K": (176, [0, 2]), "Q6_K": (210, [208])}  # size, fp16 fields
TYPES = TYPES_32 + list(TYPES_K) + ["F32", "F16", "BF16"] + TYPES_T
BLOCK_TYPES = TYPES_32 + list(TYPES_K) + TYPES_T


def weights(qt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """rows × k weights of type qt as stored in GGUF: gguf-py's quantizer for the 32-element
    and ternary types; random bytes with finite positive fp16 scales (around 1/64) for the K-quants."""
    if qt in TYPES_32 + TYPES_T:
        return quantize(rng.standard_normal((rows, k)).astype(np.float32), GGMLQuantizationType[qt])
    size, fp16 = TYPES_K[qt]
    nb = rows * k // 256
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in fp16:
        blocks[:, off:off + 2] = (rng.uniform(0.5, 1.5, nb) / 64).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, row_bytes(qt, k))


def act_ref(x: np.ndarray):
    """numpy's int8 activation blocks: d = amax/127, q = round half away from zero of x/d."""
    xb = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = xb * inv[:, None]
    q = np.trunc(v + np.where(v < 0, np.float32(-0.5), np.float32(0.5))).astype(np.int8)
    return d, q.astype(np.int32).sum(axis=1), q


@pytest.mark.parametrize("qt", BLOCK_TYPES)
def test_dequantize_bitwise_vs_gguf(qt):
    rng = np.random.default_rng(TYPES.index(qt))
    rows, k = 3, 512
    w = weights(qt, rows, k, rng)
    want = dequantize_ref(qt, w, rows, k).astype(np.float32)
    for r in range(rows):
        got = CM.dequantize(qt, w[r], k)
        np.testing.assert_array_equal(got.view(np.uint32), want[r].view(np.uint32))


def test_quantize_act_matches_numpy():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(32 * 40).astype(np.float32) * rng.uniform(0.01, 100, 32 * 40).astype(np.float32)
    x[:32] = 0.0                                   # an all-zero block: d = 0, q = 0
    x[32:64] = np.linspace(-1, 1, 32)              # exact halves on the grid: ties away from zero
    d, s, q = CM.quantize_act(x)
    d_ref, s_ref, q_ref = act_ref(x)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s, s_ref)
    assert d[0] == 0 and not q[0].any()


@pytest.mark.parametrize("qt", BLOCK_TYPES)
def test_dot_through_dp4a_matches_numpy(qt):
    rng = np.random.default_rng(100 + TYPES.index(qt))
    rows, k = 4, 1024
    w = weights(qt, rows, k, rng)
    deq = dequantize_ref(qt, w, rows, k)
    for r in range(rows):
        x = rng.standard_normal(k).astype(np.float32)
        d, _, q = act_ref(x)
        a = (d[:, None].astype(np.float64) * q).reshape(-1)
        want = float(deq[r] @ a)
        bound = 1e-5 * float(np.abs(deq[r] * a).sum())
        assert abs(CM.dot(qt, w[r], x) - want) <= bound


def test_bad_input_is_a_clear_error():
    w = weights("Q4_0", 1, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="no CUDA kernel for type 'Q2_K'"):
        CM.dequantize("Q2_K", w[0], 64)
    with pytest.raises(ValueError, match="is 36 bytes, got 18"):
        CM.dequantize("Q4_0", w[0][:18], 64)
    with pytest.raises(ValueError, match="not a whole number"):
        CM.dequantize("Q4_K", w[0], 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        CM.quantize_act(np.zeros(33, np.float32))


def _status_in_subprocess(env: dict[str, str]) -> dict:
    code = "import json; from ktd import _native; print(json.dumps(_native.cuda_status()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                         check=True)
    import json
    return json.loads(out.stdout)


def test_cuda_status_without_the_library_says_so(tmp_path):
    missing = tmp_path / "libktd_cuda.so"
    st = _status_in_subprocess({"KTD_CUDA_LIBRARY": str(missing)})
    assert st == {"library": str(missing), "available": False, "devices": 0,
                  "reason": st["reason"]}
    assert st["reason"].startswith("the CUDA backend is not installed or cannot be loaded") and str(missing) in st["reason"]


def test_cuda_status_rejects_a_library_that_is_not_the_backend(tmp_path):
    # Any shared object without the entry points (here: ktd._native itself).
    st = _status_in_subprocess({"KTD_CUDA_LIBRARY": _native.__file__})
    assert st["available"] is False and "not a ktd CUDA backend" in st["reason"]


def _built_backend() -> Path | None:
    lib = Path(_native.__file__).with_name("libktd_cuda.so")
    return lib if lib.exists() else None


def test_cuda_status_of_the_built_backend():
    lib = _built_backend()
    if lib is None:
        pytest.skip("libktd_cuda.so was not built (no nvcc when the native module was built)")
    st = _native.cuda_status()
    assert st["library"] == str(lib)
    has_driver = Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()
    if not has_driver:
        # No NVIDIA driver: the runtime's own reason, never a crash.
        assert st["available"] is False and st["devices"] == 0
        assert "cudaGetDeviceCount" in st["reason"]
    else:
        assert isinstance(st["available"], bool) and st["reason"]


def _gpu_or_skip():
    st = _native.cuda_status()
    if not st["available"]:
        pytest.skip(f"no usable CUDA device: {st['reason']}")


@pytest.mark.gpu
@pytest.mark.parametrize("qt", TYPES)
def test_gpu_gemv_matches_the_host_math(qt):
    _gpu_or_skip()
    rng = np.random.default_rng(200 + TYPES.index(qt))
    rows, k, n = 96, 1024, 6  # two tiles of activation rows (kernels.cuh kTokTile 4), the second partial
    if qt in ("F32", "F16", "BF16"):
        dense = rng.standard_normal((rows, k)).astype(np.float32)
        w = quantize(dense, GGMLQuantizationType[qt]) if qt != "F32" else dense
        w = np.ascontiguousarray(w).view(np.uint8).reshape(rows, -1)
    else:
        w = weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y = CM.gpu_gemv(qt, w, rows, k, x)
    deq = dequantize_ref(qt, w, rows, k)
    for i in range(n):
        if qt in ("F32", "F16", "BF16"):
            want = deq @ x[i].astype(np.float64)
            bound = 1e-5 * (np.abs(deq) @ np.abs(x[i]).astype(np.float64))
        else:
            want = np.array([CM.dot(qt, w[r], x[i]) for r in range(rows)])
            bound = 1e-5 * (np.abs(deq) @ np.abs(x[i]).astype(np.float64))
        assert np.all(np.abs(y[i] - want) <= bound + 1e-6)
