"""Checks shared by the kernel tests of the 256-element block types (tests/kernels/test_kernels_k.py,
tests/kernels/test_kernels_iq.py): which ISAs run here, and the matmul / threads / tile checks, each against
the independent oracle of kernel_oracle.py (gguf-py + float64) or the kernels' own invariants.

Each test module brings its own ``random_weights(qt, rows, k, rng)`` (valid random blocks of its
types) and parametrizes over its types; the bodies are here.

Error bound of check_matmul (derived in test_kernels_k.py's docstring): the only approximation in
a kernel is the Q8_K rounding of the activations, |x̃ − x| ≤ amax_block/254 per 256-block, plus
float32 summation rounding bounded by 1e-5·Σ|w_i||x_i|; against the reference twin only the
summation order differs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

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
