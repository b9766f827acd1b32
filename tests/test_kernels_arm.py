"""The aarch64 kernel ISAs (NEON = Armv8-A Advanced SIMD, DOTPROD = + SDOT, I8MM = + SMMLA) against
gguf-py and the scalar reference.

They run only in an aarch64 build (on ARM hardware, or cross-compiled and emulated by
`make test-arm64`, tools/arm64/test-arm64.sh); on x86-64 the ISAs are not compiled in and only
the dispatch rules are checked. The per-case checks are test_kernels_q32's (the same oracle and
bounds), applied to every (type, ISA) pair that has an ARM kernel; in addition the ARM Q8_0/Q4_0
kernels sum each block exactly and accumulate blocks in the reference's order, so they must equal
the reference bit for bit.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from ktd import _native
from test_kernels_k import random_weights
from test_kernels_q32 import ROWS_N, K_Q32, inputs
from test_kernels_q32 import test_dequantize_bitwise_gguf as _dequantize_case
from test_kernels_q32 import test_matmul_vs_gguf_oracle as _oracle_case
from test_kernels_q32 import test_prepared_weights_path as _prepared_case
from test_kernels_q32 import test_threads_bitwise_and_guards as _threads_case

K = _native.kernels
AARCH64 = platform.machine() in ("aarch64", "arm64")
ARM_ISAS = [i for i in ("neon", "dotprod", "i8mm") if K.isa_compiled(i) and K.isa_supported(i)]
# The types that must have kernels of every ARM ISA (the rest fall back: I8MM → DOTPROD → NEON → ref).
# The 256-element ones are also run through every test of test_kernels_k (its ISA list has them).
Q32_ARM_TYPES = ["Q8_0", "Q4_0"]
K_ARM_TYPES = ["Q4_K", "Q6_K"]
ARM_TYPES = Q32_ARM_TYPES + K_ARM_TYPES
PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in Q32_ARM_TYPES]
K_PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in K_ARM_TYPES]
NO_ARM = "no aarch64 kernel ISA compiled in and supported here (x86-64 build, or a CPU without it)"


def test_isas_compiled_for_the_target():
    for isa in ("neon", "dotprod", "i8mm"):
        assert K.isa_compiled(isa) == AARCH64
    for isa in ("avx2", "avx512"):
        if AARCH64:
            assert not K.isa_compiled(isa)
    if AARCH64:
        # Every aarch64 CPU has Advanced SIMD; dotprod follows the hwcap (test_cpu_features).
        assert K.isa_supported("neon")
        for isa in ARM_ISAS:
            assert set(ARM_TYPES) <= set(K.supported_types(isa)), isa
    else:
        for isa in ("neon", "dotprod", "i8mm"):
            assert not K.isa_supported(isa)
            with pytest.raises(ValueError, match="not compiled"):
                K.set_active_isa(isa)


def test_default_isa_on_aarch64():
    if not AARCH64:
        pytest.skip("aarch64 only (x86-64: test_cpu_features.test_kernel_isa_support_follows_the_flags)")
    want = next(i for i in ("i8mm", "dotprod", "neon") if K.isa_supported(i))
    if "KTD_ISA" not in os.environ:
        assert K.active_isa() == want


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("rows,k,n", [(r, k, n) for k in K_Q32 for r, n in ROWS_N])
def test_matmul_vs_gguf_oracle(t, isa, rows, k, n):
    _oracle_case(t, isa, rows, k, n)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("random_bytes", [False, True])
def test_dequantize_bitwise_gguf(t, isa, random_bytes):
    _dequantize_case(t, isa, random_bytes)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 32, 1), (7, 160, 3), (33, 1024, 5), (129, 1024, 64)])
def test_bitwise_equal_to_ref(t, isa, random_bytes, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows + 3 * k + n, random_bytes=random_bytes)
    y = K.matmul(t, w, rows, k, x, isa=isa)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    np.testing.assert_array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    np.testing.assert_array_equal(K.quantize_act(t, x, isa=isa), K.quantize_act(t, x, isa="ref"))


@pytest.mark.skipif(not K_PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", K_PAIRS)
@pytest.mark.parametrize("rows,k,n", [(1, 256, 1), (7, 512, 3), (33, 2304, 5), (65, 1024, 17)])
def test_k_bitwise_equal_to_ref(t, isa, rows, k, n):
    rng = np.random.default_rng(rows * 31 + k + n)
    w = random_weights(t, rows, k, rng)
    x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
    y = K.matmul(t, w, rows, k, x, isa=isa)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    np.testing.assert_array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    np.testing.assert_array_equal(K.dequantize(t, w, k, isa=isa).view(np.uint32),
                                  K.dequantize(t, w, k, isa="ref").view(np.uint32))


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
def test_threads_bitwise_and_guards(t, isa):
    _threads_case(t, isa)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
def test_prepared_weights_path(t, isa):
    _prepared_case(t, isa)


@pytest.mark.skipif(not ARM_ISAS, reason=NO_ARM)
@pytest.mark.parametrize("isa", ARM_ISAS)
def test_types_without_arm_kernels_fall_back(isa):
    """Under an ARM ISA, a type without its kernels runs the fallback's (I8MM → DOTPROD → NEON → ref):
    the active-ISA path (no isa=) gives the fallback's result, bit for bit."""
    code = (
        "import numpy as np, sys\n"
        "from ktd import _native\n"
        "from test_kernels_q32 import inputs\n"
        "K = _native.kernels\n"
        f"K.set_active_isa({isa!r})\n"
        "chain = {'i8mm': ['i8mm', 'dotprod', 'neon', 'ref'], 'dotprod': ['dotprod', 'neon', 'ref'],\n"
        "         'neon': ['neon', 'ref']}[sys.argv[1]]\n"
        "for t in ['Q8_0', 'Q4_0', 'Q5_0', 'Q4_1', 'IQ4_NL', 'F16']:\n"
        "    want_isa = next(i for i in chain if t in K.supported_types(i))\n"
        "    w, x = inputs(t, 9, 64, 2, seed=1)\n"
        "    y = K.matmul(t, w, 9, 64, x)\n"
        "    want = K.matmul(t, w, 9, 64, x, isa=want_isa)\n"
        "    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (t, want_isa)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, isa], capture_output=True, text=True,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
