"""The 256-element block types (K-quants, IQ4_XS, ternary TQ1_0/TQ2_0) and their activation
format Q8_K, every ISA this machine runs, against gguf-py (dequantize + float64 matmul) and
against the scalar reference twin.

Error bound. The only approximation in a kernel is the Q8_K quantization of the activations:
each element is rounded to the grid of its 256-block, |x̃ − x| ≤ |d|/2 = amax_block/254. Hence
for every output  |y − y_exact| ≤ Σ_blocks (amax_block/254) · Σ_{i in block} |w_i|  (computed per
output below), plus float32 summation rounding, bounded by 1e-5 · Σ|w_i||x_i| for these k.
Against the reference twin the activations are identical (the quantizers agree bitwise), so
only the summation order differs: |y − y_ref| ≤ 1e-5 · Σ|w_i||x_i|.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import ISAS, MATMUL_SHAPES, check_dequantize_bitwise, check_gemm_tile_guard
from kernel_checks import check_matmul, check_random_matmul, check_threads_bitwise, kernels_or_skip
from kernel_inputs import K_FP16_FIELDS as FP16_FIELDS, K_TYPES as TYPES
from kernel_inputs import random_k_weights as random_weights
from kernel_oracle import dequantize_ref
from ktd import _native
from paths import TESTS

K = _native.kernels
QK_K = 256


# --- Q8_K activation quantizer --------------------------------------------------------------


def q8_K_fields(raw: np.ndarray, n: int, k: int):
    b = raw.reshape(n * k // QK_K, 292)
    d = b[:, 0:4].copy().view(np.float32).reshape(-1)
    qs = b[:, 4:260].view(np.int8).astype(np.int64)
    bsums = b[:, 260:292].copy().view(np.int16).astype(np.int64)
    return d, qs, bsums


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [256, 512, 2304])
def test_q8_K_quantizer_invariants(isa, k):
    kernels_or_skip("Q4_K", isa)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((5, k)).astype(np.float32) * np.float32(3.0)
    x[1, :256] = 0.0  # an all-zero block: d = 0, all values 0
    x[2, 7] = 50.0  # an outlier
    x[3, 300 % k] = -50.0  # a negative outlier
    raw = K.quantize_act("Q4_K", x, isa=isa)
    assert raw.shape == (5, k // QK_K * 292)
    d, qs, bsums = q8_K_fields(raw, 5, k)
    assert np.isfinite(d).all()
    assert (np.abs(qs) <= 127).all()
    np.testing.assert_array_equal(bsums, qs.reshape(-1, 16, 16).sum(axis=2))
    xb = x.reshape(-1, QK_K).astype(np.float64)
    amax = np.abs(xb).max(axis=1)
    # ggml's definition: the element of largest magnitude maps to -127, d = -max/127.
    np.testing.assert_allclose(np.abs(d), amax / 127, rtol=1e-6)
    err = np.abs(qs * d[:, None].astype(np.float64) - xb)
    assert (err <= np.abs(d)[:, None] / 2 * (1 + 1e-5) + 1e-30).all()
    zero_block = k // QK_K  # first block of row 1
    assert d[zero_block] == 0 and (qs[zero_block] == 0).all()


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "ref"])
def test_q8_K_quantizer_matches_reference_bitwise(isa):
    kernels_or_skip("Q4_K", isa)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 1536)).astype(np.float32)
    x[0, 5] = x[0, 9] = 4.0  # ties for the maximum magnitude: the first one wins
    x[0, 7] = -4.0
    x[1, :] = np.float32(0.5) * np.round(rng.standard_normal(1536) * 8)  # many rounding ties
    x[2, :256] = 0
    np.testing.assert_array_equal(K.quantize_act("Q4_K", x, isa=isa), K.quantize_act("Q4_K", x, isa="ref"))


# --- dequantization -------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_dequantize_bitwise_vs_gguf(qt, isa):
    check_dequantize_bitwise(qt, isa, random_weights, 5, 768, seed=TYPES.index(qt))


# --- matmul: shapes, threads, tiles ---------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k,n", MATMUL_SHAPES)
def test_matmul_vs_gguf(qt, isa, rows, k, n):
    check_random_matmul(qt, isa, random_weights, rows, k, n)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_matmul_threads_bitwise(qt, isa):
    check_threads_bitwise(qt, isa, random_weights)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("nr,nc", [(1, 1), (5, 3), (9, 7)])
def test_gemm_tile_guard_values(qt, isa, nr, nc):
    check_gemm_tile_guard(qt, isa, random_weights, nr, nc)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_matmul_special_inputs(qt, isa):
    """Zero activations give exact zeros; an Inf/NaN weight scale propagates only to its row."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(3)
    rows, k = 4, 512
    w = random_weights(qt, rows, k, rng)
    y0 = K.matmul(qt, w, rows, k, np.zeros((2, k), np.float32), isa=isa)
    assert (y0 == 0).all()
    _, d_off, _ = FP16_FIELDS[qt]
    w[2, d_off[0] : d_off[0] + 2] = np.array([np.inf], np.float16).view(np.uint8)
    x = rng.standard_normal((2, k)).astype(np.float32)
    y = K.matmul(qt, w, rows, k, x, isa=isa)
    assert np.isfinite(y[:, [0, 1, 3]]).all()
    assert not np.isfinite(y[:, 2]).any()


def test_bad_shapes_rejected():
    w = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError):
        K.matmul("Q4_K", w, 2, 300, np.zeros((1, 300), np.float32))
    with pytest.raises(ValueError):
        K.matmul("Q4_K", w, 3, 256, np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError):
        K.quantize_act("Q6_K", np.zeros((1, 100), np.float32))
    with pytest.raises(ValueError):
        K.gemm_tile("Q4_K", w, 256, np.zeros(292, np.uint8), 2, 1, np.zeros(1, np.float32), 0, 2)


# --- model shapes and real weights ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt,rows,k", [("Q4_K", 1536, 8960), ("Q6_K", 896, 4864)])
def test_model_shapes(qt, isa, rows, k):
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(rows)
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    y = check_matmul(qt, isa, w, rows, k, x, threads=2)
    np.testing.assert_array_equal(y, K.matmul(qt, w, rows, k, x, isa=isa, threads=1))


def real_tensor(reader, qt: str, min_rows: int, model: str):
    for t in reader.tensors:
        if t.tensor_type.name == qt and len(t.shape) == 2 and int(t.shape[1]) >= min_rows:
            k, rows = int(t.shape[0]), int(t.shape[1])
            return t.name, np.asarray(t.data, dtype=np.uint8).reshape(rows, -1), rows, k
    pytest.skip(f"no 2-D {qt} tensor in {model}")


@pytest.mark.realmodel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", ["Q4_K", "Q6_K"])
def test_real_weights(real_model_reader, qt, isa):
    kernels_or_skip(qt, isa)
    model = "qwen2.5-coder-1.5b"
    name, w, rows, k = real_tensor(real_model_reader(model), qt, 64, model)
    sl = slice(rows // 3, rows // 3 + 64)
    ws = np.ascontiguousarray(w[sl])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_array_equal(
        K.dequantize(qt, ws, k, isa=isa).view(np.uint32),
        dequantize_ref(qt, ws, 64, k).astype(np.float32).view(np.uint32),
    )
    check_matmul(qt, isa, ws, 64, k, x, threads=2)


def test_avx512_falls_back_to_avx2_kernels():
    """With KTD_ISA=avx512, a type without AVX-512 kernels runs the AVX2 ones, not the reference."""
    import os
    import subprocess
    import sys

    if not (K.isa_compiled("avx512") and K.isa_supported("avx512")):
        pytest.skip("this CPU or build has no AVX-512")
    # Any block-quantized type with AVX2 but no AVX-512 kernels whose weights gguf-py can make
    # (quantized: gguf-py returns their raw bytes, and the integer kernels sum in an order that
    # tells the reference apart).
    missing = [t for t in K.supported_types("avx2") if t not in K.supported_types("avx512")]
    missing = [t for t in missing if t in TYPES or t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]
    if not missing:
        pytest.skip("every type with AVX2 kernels has AVX-512 kernels in this build")
    qt = missing[0]
    # The default (isa=None) path uses kernels_for(); compare it bitwise with explicit ISAs.
    code = f"""
import numpy as np, sys
sys.path[:0] = [{str(TESTS)!r}]
from gguf.quants import quantize
from kernel_inputs import K_TYPES as TYPES, random_k_weights as random_weights
from kernel_oracle import qtype
from ktd import _native
K = _native.kernels
assert K.active_isa() == "avx512"
rng = np.random.default_rng(1)
qt = {qt!r}
w = random_weights(qt, 5, 512, rng) if qt in TYPES else quantize(rng.standard_normal((5, 512)).astype(np.float32), qtype(qt))
x = rng.standard_normal((3, 512)).astype(np.float32)
y = K.matmul(qt, w, 5, 512, x)
assert np.array_equal(y, K.matmul(qt, w, 5, 512, x, isa="avx2"))
# (the reference sums in another order: with this seed its result differs, so the check above
# distinguishes the two)
assert not np.array_equal(y, K.matmul(qt, w, 5, 512, x, isa="ref"))
"""
    env = dict(os.environ, KTD_ISA="avx512")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_nonfinite_activations_propagate(qt, isa):
    """A NaN or ±Inf activation makes its column's outputs NaN (and only its column's): the Q8_K
    block holding it gets d = NaN, on every ISA alike."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(9)
    rows, k = 5, 768
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((4, k)).astype(np.float32)
    x[1, 300] = np.nan
    x[2, 5] = np.inf
    x[3, 700] = -np.inf
    xq = K.quantize_act(qt, x, isa=isa)
    np.testing.assert_array_equal(xq, K.quantize_act(qt, x, isa="ref"))
    y = K.matmul(qt, w, rows, k, x, isa=isa)
    assert np.isfinite(y[0]).all()
    assert np.isnan(y[1:]).all()
