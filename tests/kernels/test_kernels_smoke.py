"""The kernel registry and the Q8_0 reference against gguf-py (the pattern every type follows)."""

import numpy as np
import pytest
from gguf.quants import quantize

from kernel_oracle import dequantize_ref, matmul_ref, nmse, qtype
from ktd import _native

K = _native.kernels


def test_active_isa_is_supported():
    assert K.isa_supported(K.active_isa())


def test_unknown_isa_rejected():
    with pytest.raises(ValueError):
        K.isa_supported("sse9")


@pytest.mark.parametrize("rows,k,n", [(1, 32, 1), (7, 96, 3), (33, 256, 9)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_q8_0_ref(rows, k, n, threads):
    rng = np.random.default_rng(rows * 1000 + k + n)
    w = quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype("Q8_0"))
    x = rng.standard_normal((n, k)).astype(np.float32)
    np.testing.assert_array_equal(K.dequantize("Q8_0", w, k, isa="ref"), dequantize_ref("Q8_0", w, rows, k))
    y = K.matmul("Q8_0", w, rows, k, x, isa="ref", threads=threads)
    assert np.isfinite(y).all()
    # Q8_0 activations: per-element rounding error <= d/2 = amax/254, NMSE ~ 1e-5 for Gaussian data.
    assert nmse(y, matmul_ref("Q8_0", w, rows, k, x)) < 1e-4
