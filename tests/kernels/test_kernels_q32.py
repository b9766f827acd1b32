"""Kernels of the 32-element block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) and the float
types (F32, F16, BF16), every ISA this machine runs, against gguf-py and against each other.

Error bounds (derived in kernel_inputs.py's docstring, stated per comparison below):
- vs gguf-py + float64: oracle_bound, the Q8_0 rounding of the activations (32-element types) plus
  float32 accumulation.
- AVX2 (plain or row-interleaved "repacked" layout) vs ref: the activations are quantized bitwise
  identically (tested), so only the float32 summation order differs: order_bound.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import quantize

from kernel_checks import Q32_ISAS, check_q32_dequantize_bitwise, check_q32_matmul_vs_oracle, check_q32_prepared_path
from kernel_checks import check_q32_repacked_threads_and_guards, check_q32_threads_and_guards
from kernel_inputs import FLOAT_TYPES, K_FLOAT, K_Q32, Q32_TYPES, ROWS_N, oracle_bound, order_bound
from kernel_inputs import q32_inputs as inputs
from kernel_oracle import dequantize_ref, qtype, row_bytes
from ktd import _native

K = _native.kernels

TYPES = Q32_TYPES + FLOAT_TYPES
ISAS = Q32_ISAS


def shapes_for(t: str):
    return [(r, k, n) for k in (K_FLOAT if t in FLOAT_TYPES else K_Q32) for r, n in ROWS_N]


CASES = [(t, isa, r, k, n) for t in TYPES for isa in ISAS for r, k, n in shapes_for(t)]


@pytest.mark.parametrize("t,isa,rows,k,n", CASES)
def test_matmul_vs_gguf_oracle(t, isa, rows, k, n):
    check_q32_matmul_vs_oracle(t, isa, rows, k, n)


# random_bytes: block fields other than the scales random (float types have none to randomise).
WEIGHT_KINDS = [(t, False) for t in TYPES] + [(t, True) for t in Q32_TYPES]


@pytest.mark.parametrize("t,random_bytes", WEIGHT_KINDS)
@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_bitwise_gguf(t, isa, random_bytes):
    check_q32_dequantize_bitwise(t, isa, random_bytes)


def test_dequantize_bf16_nan_and_inf_kept():
    vals = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 3.0] * 3, dtype=np.float32)
    w = np.ascontiguousarray(quantize(vals.reshape(1, -1), qtype("BF16"))).view(np.uint8)
    for isa in ISAS:
        got = K.dequantize("BF16", w, vals.size, isa=isa)
        want = dequantize_ref("BF16", w, 1, vals.size).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def special_activations(k: int, rng: np.random.Generator) -> np.ndarray:
    """Activation rows that hit the quantizer's edges: zero blocks, exact .5 ties after scaling,
    huge and tiny magnitudes, a single non-zero element."""
    rows = []
    rows.append(np.zeros(k, np.float32))
    ties = np.arange(-16, 16, dtype=np.float32) + 0.5  # amax 127 -> d = 1: every element a .5 tie
    ties[0] = 127.0
    rows.append(np.tile(ties, k // 32))
    rows.append((np.arange(k, dtype=np.float32) % 32 - 15.5).astype(np.float32))  # ±k.5 steps, amax 15.5
    rows.append(rng.standard_normal(k).astype(np.float32) * 1e4)  # fp16 scale near its top
    rows.append(rng.standard_normal(k).astype(np.float32) * 1e-30)
    one = np.zeros(k, np.float32)
    one[5] = -3.0
    rows.append(one)
    rows.append(rng.standard_normal(k).astype(np.float32))
    return np.stack(rows)


@pytest.mark.parametrize("t", TYPES)
def test_quantize_act_isas_bitwise(t):
    k = 32 * 9
    x = special_activations(k, np.random.default_rng(3))
    ref = K.quantize_act(t, x, isa="ref")
    for isa in ISAS:
        np.testing.assert_array_equal(K.quantize_act(t, x, isa=isa), ref)


def test_quantize_act_q8_0_matches_gguf():
    """The Q8_0 activation format is gguf-py's Q8_0 quantizer (an independent implementation)."""
    k = 32 * 9
    x = special_activations(k, np.random.default_rng(4))
    want = np.ascontiguousarray(quantize(x, qtype("Q8_0"))).view(np.uint8).reshape(x.shape[0], -1)
    for isa in ISAS:
        np.testing.assert_array_equal(K.quantize_act("Q8_0", x, isa=isa), want)


ORDER_CASES = [(t, rb, r, k, n) for t, rb in WEIGHT_KINDS for r, k, n in shapes_for(t)[::3]]


@pytest.mark.skipif("avx2" not in ISAS, reason="this machine cannot run AVX2")
@pytest.mark.parametrize("t,random_bytes,rows,k,n", ORDER_CASES)
def test_avx2_vs_ref(t, random_bytes, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows + k + n, random_bytes=random_bytes)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    y_avx = K.matmul(t, w, rows, k, x, isa="avx2")
    assert np.isfinite(y_avx).all()
    xq = K.quantize_act(t, x, isa="ref")
    bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, xq, k)
    assert (np.abs(y_avx.astype(np.float64) - y_ref) <= bound).all()


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_threads_bitwise_and_guards(t, isa):
    check_q32_threads_and_guards(t, isa)


REPACK_TYPES = [(t, isa) for t in TYPES for isa in ISAS if K.repack_rows(t, isa=isa) > 0]


def test_repacked_layouts_present():
    """The row-interleaved layouts exist for every 32-element type where this machine runs AVX2."""
    if "avx2" not in ISAS:
        pytest.skip("this machine cannot run AVX2")
    assert {t for t, isa in REPACK_TYPES if isa == "avx2"} == set(Q32_TYPES)


@pytest.mark.parametrize("t,isa", REPACK_TYPES)
@pytest.mark.parametrize("rows,k,n", [(r, k, n) for k in K_Q32 for r, n in ROWS_N])
def test_repacked_vs_ref(t, isa, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows * 3 + k + n, random_bytes=True)
    wp = K.repack(t, w, rows, k, isa=isa)
    y = K.matmul_repacked(t, wp, rows, k, x, isa=isa)
    assert np.isfinite(y).all()
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    xq = K.quantize_act(t, x, isa="ref")
    bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, xq, k)
    assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all()


@pytest.mark.parametrize("t,isa", REPACK_TYPES)
def test_repacked_threads_bitwise_and_guards(t, isa):
    check_q32_repacked_threads_and_guards(t, isa)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_prepared_weights_path(t, isa):
    """prepare_weights repacks exactly when the kernels have a layout (kernel_checks)."""
    check_q32_prepared_path(t, isa)


def test_repack_rejected_without_layout():
    w, _ = inputs("F16", 3, 64, 1, seed=1)
    with pytest.raises(ValueError):
        K.repack("F16", w, 3, 64, isa="ref")


REAL_SHAPES = [(896, 4864), (4864, 896)]  # Qwen2.5-0.5B ffn_down / ffn_up (rows, k)


@pytest.mark.slow
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("rows,k", REAL_SHAPES)
def test_real_model_shapes(t, rows, k):
    w, x = inputs(t, rows, k, 3, seed=rows)
    w_deq = dequantize_ref(t, w, rows, k)
    y64 = x.astype(np.float64) @ w_deq.T
    xq = K.quantize_act(t, x, isa="ref")
    bound = oracle_bound(t, w_deq, x, xq, k)
    for isa in ISAS:
        y = K.matmul(t, w, rows, k, x, isa=isa, threads=2)
        assert np.isfinite(y).all()
        assert (np.abs(y - y64) <= bound).all(), (isa, float(np.max(np.abs(y - y64) / bound)))
        if K.repack_rows(t, isa=isa) > 0:
            y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa=isa, threads=2), rows, k, x, isa=isa, threads=2)
            assert (np.abs(y - y64) <= bound).all(), (isa, "repacked")


@pytest.mark.parametrize("t", TYPES)
def test_bad_shapes_rejected(t):
    k = 64
    w, x = inputs(t, 3, k, 1, seed=1)
    with pytest.raises(ValueError):
        K.matmul(t, w[:, :-1].copy(), 3, k, x)  # rows too short
    with pytest.raises(ValueError):
        K.matmul(t, w, 3, k, x[:, :-1].copy())  # activations of the wrong length
    with pytest.raises(ValueError):
        K.matmul_into(t, w, 3, k, x, np.zeros(3, np.float32), 1)  # no room in out
    if t not in FLOAT_TYPES:
        with pytest.raises(ValueError):
            K.matmul(t, w, 3, k + 1, np.zeros((1, k + 1), np.float32))  # k not whole blocks


def test_empty_shapes():
    for t in ("Q8_0", "F32"):
        k = 64
        x = np.ones((1, k), np.float32)
        assert K.matmul(t, np.zeros((0, row_bytes(t, k)), np.uint8), 0, k, x).shape == (1, 0)
        w, _ = inputs(t, 5, k, 1, seed=2)
        assert K.matmul(t, w, 5, k, np.zeros((0, k), np.float32)).shape == (0, 5)


def test_bench_bindings_validate_input():
    """The benchmark's C++ timing loops (no timing asserted: only that they run and reject bad input)."""
    assert K.bench_read_bandwidth(1 << 20, 1, 1) > 0
    # One loop alone: every distance the best-of measures, and any other (bytes ahead; 0: none).
    assert K.READ_BANDWIDTH_PREFETCH == (0, 2048, 4096, 8192)
    for pf in K.READ_BANDWIDTH_PREFETCH + (64, 1 << 20):
        assert K.bench_read_bandwidth(1 << 20, 2, 1, pf) > 0
    with pytest.raises(ValueError, match="prefetch must be -1"):
        K.bench_read_bandwidth(1 << 20, 1, 1, -2)
    w, _ = inputs("Q8_0", 16, 64, 1, seed=3)
    assert K.bench_matmul("Q8_0", w, 16, 64, 2, 2, 1) > 0
    with pytest.raises(ValueError):
        K.bench_read_bandwidth(100, 1, 1)
    # The kept buffer: its size rounded down to whole 4 KiB pages, one pass per read of any loop.
    buf = K.ReadBuffer((1 << 20) + 100, 2)
    assert (buf.bytes, buf.threads) == (1 << 20, 2)
    assert all(buf.read(pf) > 0 for pf in K.READ_BANDWIDTH_PREFETCH + (64,))
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        buf.read(-1)
    with pytest.raises(ValueError, match="bytes >= 4096"):
        K.ReadBuffer(4095, 1)
    with pytest.raises(ValueError):
        K.bench_matmul("Q8_0", w, 17, 64, 1, 1, 1)  # wrong size
    with pytest.raises(ValueError):
        K.bench_matmul("Q8_0", w, 16, 64, 0, 1, 1)  # n = 0
    with pytest.raises(ValueError):
        K.bench_matmul("Q8_0", w[:15].copy(), 16, 64, 1, 1, 1, repacked=True)  # too small when repacked
