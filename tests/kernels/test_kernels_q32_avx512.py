"""AVX-512 VNNI kernels of Q5_0 and Q8_0 (kernels/avx512/q5_0.cpp, q8_0.cpp, q32_vnni.h): plain
and 16-row repacked layouts against the scalar reference and against gguf-py + float64.

Bounds as in test_kernels_q32.py (kernel_inputs.py): the activations are quantized bitwise identically to the
reference (tested), each block's integer dot is exact, so vs ref only the float32 summation order
of the per-block partial sums differs (order_bound); vs gguf-py + float64 the activation format's
error (oracle_bound). Dequantization is bitwise (both compute d·q in float32).

Shapes: the real ones of Qwen2.5-0.5B (k = 896, 4864; rows 128, 896, 4864 and rows that are not
a multiple of the 16-row group), n = 1..9 around the 8-column tile, and a prefill size.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import check_q32_repacked_threads_and_guards
from kernel_inputs import oracle_bound, order_bound
from kernel_inputs import q32_inputs as inputs
from kernel_oracle import dequantize_ref
from ktd import _native

K = _native.kernels
TYPES = ["Q5_0", "Q8_0"]
HAVE_AVX512 = K.isa_compiled("avx512") and K.isa_supported("avx512")
pytestmark = pytest.mark.skipif(not HAVE_AVX512, reason="AVX-512 kernels not compiled or this CPU lacks AVX-512 VNNI/VBMI")

# rows x k x n: partial groups (rows % 16 != 0), every column count of the 8-wide tile and past
# it, the model's k (896 = 28 blocks, 4864 = 152) and a prefill n.
SHAPES = ([(r, 896, n) for r, n in [(1, 1), (15, 2), (16, 3), (17, 4), (31, 5), (33, 6), (47, 7), (128, 8), (129, 9)]]
          + [(r, 4864, n) for r, n in [(7, 1), (40, 8), (33, 3)]]
          + [(r, 32, n) for r, n in [(3, 1), (17, 16)]]
          + [(77, 160, 64)])


@pytest.mark.parametrize("t", TYPES)
def test_layout_registered(t):
    assert K.repack_rows(t, isa="avx512") == 16
    # A different layout from the AVX2 one must carry a different version.
    assert K.repack_layout(t, isa="avx512") not in (0, K.repack_layout(t, isa="avx2"))
    assert K.act_type(t, isa="avx512") == "Q8_0"


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("random_bytes", [False, True])
def test_dequantize_bitwise(t, random_bytes):
    rows, k = 5, 32 * 13
    w, _ = inputs(t, rows, k, 1, seed=3, random_bytes=random_bytes)
    got = K.dequantize(t, w, k, isa="avx512")
    want = dequantize_ref(t, w, rows, k).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantize_act_bitwise():
    x = np.random.default_rng(5).standard_normal((3, 896)).astype(np.float32) * 4
    x[1, :32] = 0.0
    for t in TYPES:
        np.testing.assert_array_equal(K.quantize_act(t, x, isa="avx512"), K.quantize_act(t, x, isa="ref"))


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_plain_and_repacked_vs_ref(t, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows * 131 + k + n, random_bytes=True)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    xq = K.quantize_act(t, x, isa="ref")
    bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, xq, k)
    y = K.matmul(t, w, rows, k, x, isa="avx512")
    assert y.shape == (n, rows) and np.isfinite(y).all()
    assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all(), "plain"
    wp = K.repack(t, w, rows, k, isa="avx512")
    assert wp.size == -(-rows // 16) * 16 * w.shape[1]
    y = K.matmul_repacked(t, wp, rows, k, x, isa="avx512")
    assert y.shape == (n, rows) and np.isfinite(y).all()
    assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all(), "repacked"


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("rows,k", [(896, 896), (128, 896), (4864, 896), (896, 4864)])
def test_real_shapes_vs_gguf(t, rows, k):
    """gguf-py's quantizer on normal weights (the real value distribution), threaded."""
    n = 4
    w, x = inputs(t, rows, k, n, seed=rows + k)
    w_deq = dequantize_ref(t, w, rows, k)
    y64 = x.astype(np.float64) @ w_deq.T
    bound = oracle_bound(t, w_deq, x, K.quantize_act(t, x, isa="ref"), k)
    y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa="avx512", threads=2), rows, k, x, isa="avx512", threads=2)
    assert (np.abs(y - y64) <= bound).all(), float(np.max(np.abs(y - y64) / bound))


@pytest.mark.parametrize("t", TYPES)
def test_threads_bitwise_and_output_guards(t):
    """Each output is computed by one worker: any thread count gives the same bits, and nothing
    outside the output is written."""
    check_q32_repacked_threads_and_guards(t, "avx512")


@pytest.mark.parametrize("t", TYPES)
def test_extreme_values(t):
    """Saturating inputs: every weight q at its extreme (Q8_0 -128/127, Q5_0 0/31) and activations
    at ±127 — the unsigned-offset products and the int32 sums must not overflow."""
    rows, k, n = 19, 896, 3
    rb = k // 32 * (34 if t == "Q8_0" else 22)
    w = np.zeros((rows, k // 32, rb // (k // 32)), dtype=np.uint8)
    w[:, :, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    w[: rows // 2, :, 2:] = 0xFF if t == "Q5_0" else 0x7F
    w[rows // 2:, :, 2:] = 0x00 if t == "Q5_0" else 0x80
    w = w.reshape(rows, rb)
    x = np.ones((n, k), dtype=np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, K.quantize_act(t, x, isa="ref"), k)
    for y in (K.matmul(t, w, rows, k, x, isa="avx512"),
              K.matmul_repacked(t, K.repack(t, w, rows, k, isa="avx512"), rows, k, x, isa="avx512")):
        assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all()


@pytest.mark.parametrize("t", TYPES)
def test_default_dispatch_uses_avx512(t):
    """Without KTD_ISA the default (AVX2) ISA hands Q5_0/Q8_0 to their AVX-512 kernels (measured
    faster at n = 1..512, plain and repacked). The two ISAs' plain tiles sum in different orders,
    so bitwise equality with the AVX-512 result (and not the AVX2 one) tells which ran."""
    import os

    if os.environ.get("KTD_ISA"):
        pytest.skip("KTD_ISA fixes the ISA for every type")
    if K.active_isa() != "avx2":
        pytest.skip(f"the active ISA is {K.active_isa()}, not the AVX2 default")
    w, x = inputs(t, 40, 896, 5, seed=17)
    got = K.matmul(t, w, 40, 896, x)
    np.testing.assert_array_equal(got.view(np.uint32), K.matmul(t, w, 40, 896, x, isa="avx512").view(np.uint32))
    assert not np.array_equal(got.view(np.uint32), K.matmul(t, w, 40, 896, x, isa="avx2").view(np.uint32))
