"""Element-wise activation kernels (ktd._native.elementwise): every ISA the machine runs against the
scalar reference and an independent float64 numpy definition, at odd lengths (the SIMD tail).

Bound: silu(a)·b in F32 with the SIMD exp (~2 ulp) and one division: measured max relative
error vs float64 1.5e-7 (per element, relative to max(|result|, 1e-30)); bound 4e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from ktd import _native

E = _native.elementwise
ISAS = [i for i in E.kernel_isas() if _native.kernels.isa_supported(i)]
TOL = 4e-6


def _numpy_swiglu(a, b):
    a64 = a.astype(np.float64)
    with np.errstate(over="ignore"):  # e^-a overflows to inf for a < -709: silu -> -0, as intended
        return a64 / (1.0 + np.exp(-a64)) * b.astype(np.float64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 17, 63, 127, 4864, 8960])
def test_swiglu_matches_numpy_and_reference(isa, n):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n) * 4).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    out = E.swiglu(a, b, isa=isa)
    assert np.all(np.isfinite(out))
    ref = _numpy_swiglu(a, b)
    rel = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-30)
    assert rel.max() < TOL, f"{isa}: max rel err {rel.max():.2e}"
    if isa != "ref":
        np.testing.assert_allclose(out, E.swiglu(a, b, isa="ref"), rtol=TOL, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_extremes(isa):
    """Saturation: silu(x) -> x for large x, -> 0 (not NaN) for very negative x; zeros stay zero."""
    a = np.array([0.0, -0.0, 1e-30, 30.0, 88.0, 100.0, 1e30, -30.0, -88.0, -100.0, -1e30], np.float32)
    b = np.full_like(a, 2.0)
    out = E.swiglu(a, b, isa=isa)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, _numpy_swiglu(a, b), rtol=TOL, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_result_does_not_depend_on_the_split(isa):
    """Computing pieces separately (as threads do) gives the same bits as the whole array."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(1001).astype(np.float32)
    b = rng.standard_normal(1001).astype(np.float32)
    whole = E.swiglu(a, b, isa=isa)
    parts = np.concatenate([E.swiglu(a[i:j], b[i:j], isa=isa) for i, j in ((0, 5), (5, 333), (333, 1001))])
    np.testing.assert_array_equal(parts, whole)


def test_swiglu_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        E.swiglu(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="unknown ISA"):
        E.swiglu(np.zeros(3, np.float32), np.zeros(3, np.float32), isa="neon")
