"""Checks shared by the kernel tests, each against the independent oracle of kernel_oracle.py
(gguf-py + float64) or the kernels' own invariants; the test modules parametrize over their types
and ISAs, the bodies are here.

- 256-element block types (tests/kernels/test_kernels_k.py, test_kernels_iq.py): which ISAs run
  here, and the matmul / threads / tile checks. Each caller brings its own
  ``random_weights(qt, rows, k, rng)`` (kernel_inputs.py: valid random blocks of its types).
  Error bound of check_matmul (derived in test_kernels_k.py's docstring): the only approximation
  in a kernel is the Q8_K rounding of the activations, |x̃ − x| ≤ amax_block/254 per 256-block,
  plus float32 summation rounding bounded by 1e-5·Σ|w_i||x_i|; against the reference twin only
  the summation order differs.
- 32-element block types and float types (test_kernels_q32.py, and the ISA-specific modules that
  run the same cases on their ISAs: test_kernels_arm.py, test_kernels_q32_avx512.py): the
  ``check_q32_*`` functions, with kernel_inputs.py's q32_inputs and bounds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kernel_inputs import FLOAT_TYPES, oracle_bound, q32_inputs
from kernel_oracle import dequantize_ref
from ktd import _native

K = _native.kernels
QK_K = 256

RandomWeights = Callable[[str, int, int, np.random.Generator], np.ndarray]

# (rows, k, n) of test_matmul_vs_gguf: one row / one column, odd tails, a 64-column tile.
MATMUL_SHAPES = [(1, 256, 1), (3, 512, 2), (7, 256, 5), (17, 1280, 3), (33, 768, 9), (129, 512, 1), (16, 256, 64)]


def isas() -> list[str]:
    """"ref" and every SIMD ISA that this build has and this CPU runs."""
    out = ["ref"]
    for isa in ("avx2", "avx512", "neon", "dotprod", "i8mm"):
        if K.isa_compiled(isa) and K.isa_supported(isa):
            out.append(isa)
    return out


ISAS = isas()
# The ISAs test_kernels_q32.py runs (AVX-512 and the ARM ISAs run the same checks in their own
# modules, test_kernels_q32_avx512.py and test_kernels_arm.py).
Q32_ISAS = [i for i in ("ref", "avx2") if K.isa_compiled(i) and K.isa_supported(i)]


def kernels_or_skip(qt: str, isa: str) -> None:
    if qt not in K.supported_types(isa):
        pytest.skip(f"no {isa} kernels for {qt} in this build")


def exact_and_bound(qt: str, w: np.ndarray, rows: int, k: int, x: np.ndarray):
    """float64 Y from gguf-py, the activation-quantization bound per output, and Σ|w||x|."""
    wd = dequantize_ref(qt, w, rows, k)
    x64 = x.astype(np.float64)
    y = x64 @ wd.T
    amax = np.abs(x64).reshape(x.shape[0], -1, QK_K).max(axis=2)  # [n, nb]
    wabs = np.abs(wd).reshape(rows, -1, QK_K).sum(axis=2)  # [rows, nb]
    bound = (amax / 254.0) @ wabs.T
    mag = np.abs(x64) @ np.abs(wd).T
    return y, bound, mag


def check_matmul(qt: str, isa: str, w: np.ndarray, rows: int, k: int, x: np.ndarray, threads: int = 1):
    """K.matmul within the bound of gguf-py's float64 product, and of the reference twin's."""
    y = K.matmul(qt, w, rows, k, x, isa=isa, threads=threads)
    assert y.shape == (x.shape[0], rows) and y.dtype == np.float32
    assert np.isfinite(y).all()
    exact, bound, mag = exact_and_bound(qt, w, rows, k, x)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound + 1e-5 * mag + 1e-30).all(), f"max excess {np.max(err - bound - 1e-5 * mag)}"
    if isa != "ref":
        yr = K.matmul(qt, w, rows, k, x, isa="ref", threads=1)
        assert (np.abs(y.astype(np.float64) - yr) <= 1e-5 * mag + 1e-30).all()
    return y


def check_dequantize_bitwise(qt: str, isa: str, random_weights: RandomWeights, rows: int, k: int, seed: int) -> None:
    """K.dequantize of random blocks equals gguf-py's dequantizer bit for bit."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(seed)
    w = random_weights(qt, rows, k, rng)
    got = K.dequantize(qt, w, k, isa=isa)
    want = dequantize_ref(qt, w, rows, k).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def check_random_matmul(qt: str, isa: str, random_weights: RandomWeights, rows: int, k: int, n: int) -> None:
    """check_matmul on random blocks and standard-normal activations of one MATMUL_SHAPES shape."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(rows * 7919 + k * 31 + n)
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    check_matmul(qt, isa, w, rows, k, x)


def check_threads_bitwise(qt: str, isa: str, random_weights: RandomWeights) -> None:
    """2 and 3 threads give the same bits as 1 (67 rows: uneven shares)."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(11)
    rows, k, n = 67, 512, 4
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y1 = K.matmul(qt, w, rows, k, x, isa=isa, threads=1)
    for threads in (2, 3):
        np.testing.assert_array_equal(K.matmul(qt, w, rows, k, x, isa=isa, threads=threads), y1)


def check_gemm_tile_guard(qt: str, isa: str, random_weights: RandomWeights, nr: int, nc: int) -> None:
    """The tile kernel writes exactly y[c*ldy + r] for r < nr, c < nc and nothing around it, and
    what it writes equals K.matmul's result."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(nr * 100 + nc)
    k, ldy, guard = 512, nr + 5, 16
    w = random_weights(qt, nr, k, rng)
    x = rng.standard_normal((nc, k)).astype(np.float32)
    xq = K.quantize_act(qt, x, isa=isa)
    sentinel = np.float32(-1234.5)
    y = np.full(guard + nc * ldy + guard, sentinel, dtype=np.float32)
    K.gemm_tile(qt, w, k, xq, nr, nc, y, guard, ldy, isa=isa)
    tile = y[guard : guard + nc * ldy].reshape(nc, ldy)
    written = np.zeros_like(y, dtype=bool)
    written[guard : guard + nc * ldy].reshape(nc, ldy)[:, :nr] = True
    assert (y[~written] == sentinel).all()
    np.testing.assert_array_equal(tile[:, :nr], K.matmul(qt, w, nr, k, x, isa=isa))


# --- 32-element block types and float types -------------------------------------------------


def check_q32_matmul_vs_oracle(t: str, isa: str, rows: int, k: int, n: int) -> None:
    """K.matmul within oracle_bound of gguf-py's float64 product."""
    w, x = q32_inputs(t, rows, k, n, seed=rows * 7919 + k * 31 + n)
    y = K.matmul(t, w, rows, k, x, isa=isa)
    assert y.shape == (n, rows) and y.dtype == np.float32
    assert np.isfinite(y).all()
    w_deq = dequantize_ref(t, w, rows, k)
    y64 = x.astype(np.float64) @ w_deq.T
    xq = K.quantize_act(t, x, isa="ref")
    bound = oracle_bound(t, w_deq, x, xq, k)
    assert (np.abs(y - y64) <= bound).all(), float(np.max(np.abs(y - y64) / bound))


def check_q32_dequantize_bitwise(t: str, isa: str, random_bytes: bool) -> None:
    """K.dequantize equals gguf-py's dequantizer bit for bit (random_bytes: block fields other
    than the scales random)."""
    k = 32 * 13 if t not in FLOAT_TYPES else 421
    rows = 5
    w, _ = q32_inputs(t, rows, k, 1, seed=11, random_bytes=random_bytes)
    got = K.dequantize(t, w, k, isa=isa)
    want = dequantize_ref(t, w, rows, k).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _check_into_guards(t: str, w: np.ndarray, rows: int, k: int, x: np.ndarray, isa: str, **kw) -> np.ndarray:
    """matmul_into on 1, 2, 3 threads: nothing written outside the output, the same bits; returns
    the output."""
    n = x.shape[0]
    sentinel = np.float32(-1234.5)
    results = []
    for threads in (1, 2, 3):
        offset, guard = 37, 53
        out = np.full(offset + n * rows + guard, sentinel, dtype=np.float32)
        K.matmul_into(t, w, rows, k, x, out, offset, isa=isa, threads=threads, **kw)
        assert (out[:offset] == sentinel).all() and (out[offset + n * rows:] == sentinel).all()
        results.append(out[offset:offset + n * rows].copy())
    for y in results[1:]:
        np.testing.assert_array_equal(y.view(np.uint32), results[0].view(np.uint32))
    return results[0]


def check_q32_threads_and_guards(t: str, isa: str) -> None:
    """1, 2 and 3 threads give the same bits, and nothing outside the output is written."""
    rows, k, n = 77, 32 * 5, 6
    w, x = q32_inputs(t, rows, k, n, seed=5)
    assert np.isfinite(_check_into_guards(t, w, rows, k, x, isa)).all()


def check_q32_repacked_threads_and_guards(t: str, isa: str) -> None:
    """Repacking on 1, 2, 3 threads gives the same bytes; each output of the repacked matmul is
    computed by one worker (any thread count, the same bits) and nothing outside it is written."""
    rows, k, n = 77, 32 * 5, 6
    w, x = q32_inputs(t, rows, k, n, seed=8, random_bytes=True)
    packs = [K.repack(t, w, rows, k, isa=isa, threads=th) for th in (1, 2, 3)]
    for p in packs[1:]:
        np.testing.assert_array_equal(p, packs[0])
    _check_into_guards(t, packs[0], rows, k, x, isa, repacked=True)


def check_q32_prepared_path(t: str, isa: str) -> None:
    """prepare_weights repacks exactly when the kernels have a layout, and gives the same result
    as the direct call on that layout."""
    rows, k, n = 41, 64, 3
    w, x = q32_inputs(t, rows, k, n, seed=9)
    y, repacked = K.matmul_prepared(t, w, rows, k, x, isa=isa, threads=2)
    assert repacked == (K.repack_rows(t, isa=isa) > 0)
    want = (K.matmul_repacked(t, K.repack(t, w, rows, k, isa=isa), rows, k, x, isa=isa) if repacked
            else K.matmul(t, w, rows, k, x, isa=isa))
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
    y_plain, was = K.matmul_prepared(t, w, rows, k, x, isa=isa, allow_repack=False)
    assert not was
    np.testing.assert_array_equal(y_plain.view(np.uint32), K.matmul(t, w, rows, k, x, isa=isa).view(np.uint32))
