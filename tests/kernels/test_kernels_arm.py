"""The aarch64 kernel ISAs (NEON = Armv8-A Advanced SIMD, DOTPROD = + SDOT, I8MM = + SMMLA) against
gguf-py and the scalar reference.

They run only in an aarch64 build (on ARM hardware, or cross-compiled and emulated by
`make test-arm64`, tools/arm64/test-arm64.sh); on x86-64 the ISAs are not compiled in and only
the dispatch rules are checked. The per-case checks are test_kernels_q32's (kernel_checks.py's
check_q32_*: the same oracle and bounds), applied to every (type, ISA) pair that has an ARM kernel
(the 256-element and i-quant types also run through every test of test_kernels_k /
test_kernels_iq, whose ISA lists include the ARM ones). In addition the ARM kernels of every
quantized type sum each block exactly and accumulate blocks in the reference's order, so they must
equal the reference bit for bit; the float types (F32, F16, BF16) use FMA into several
accumulators, as the AVX2 ones do, so they are held to the summation-order bound (kernel_inputs'
order_bound) against the reference instead, and their dequantization is exact.

Every type has its own entry in both ARM ISAs (test_isas_compiled_for_the_target): the isa= tests
run exactly that ISA's kernels, no fallback. Under `make test-arm64` the suite runs twice, with
-cpu max (NEON and dotprod both run) and -cpu cortex-a57 (no dotprod: NEON only).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kernel_checks import check_q32_dequantize_bitwise, check_q32_matmul_vs_oracle, check_q32_prepared_path
from kernel_checks import check_q32_threads_and_guards
from kernel_inputs import K_FLOAT, K_Q32, ROWS_N, order_bound, q32_inputs as inputs, random_iq_weights, random_k_weights
from kernel_oracle import dequantize_ref
from ktd import _native
from paths import TESTS

K = _native.kernels
AARCH64 = platform.machine() in ("aarch64", "arm64")
ARM_ISAS = [i for i in ("neon", "dotprod", "i8mm") if K.isa_compiled(i) and K.isa_supported(i)]
# The types that must have kernels of every ARM ISA (the rest fall back: I8MM → DOTPROD → NEON → ref).
# The 256-element ones are also run through every test of test_kernels_k (its ISA list has them).
Q32_ARM_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
K_ARM_TYPES = ["Q4_K", "Q6_K", "Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "TQ1_0", "TQ2_0"]
IQ_ARM_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
FLOAT_ARM_TYPES = ["F32", "F16", "BF16"]
ARM_TYPES = Q32_ARM_TYPES + K_ARM_TYPES + IQ_ARM_TYPES + FLOAT_ARM_TYPES
PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in Q32_ARM_TYPES]
K_PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in K_ARM_TYPES]
IQ_PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in IQ_ARM_TYPES]
F_PAIRS = [(t, isa) for isa in ARM_ISAS for t in K.supported_types(isa) if t in FLOAT_ARM_TYPES]
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
        # NEON and DOTPROD have every type; a higher tier may cover fewer and fall back to DOTPROD.
        for isa in set(ARM_ISAS) & {"neon", "dotprod"}:
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
    check_q32_matmul_vs_oracle(t, isa, rows, k, n)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("random_bytes", [False, True])
def test_dequantize_bitwise_gguf(t, isa, random_bytes):
    check_q32_dequantize_bitwise(t, isa, random_bytes)


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


# The 256-element types: the K-quants, IQ4_XS and the ternary types (kernel_inputs' random_k_weights)
# and the i-quants (random_iq_weights), each on its own shapes; one check for both.
K_SHAPES = [(1, 256, 1), (7, 512, 3), (33, 2304, 5), (65, 1024, 17)]
IQ_SHAPES = [(1, 256, 1), (7, 512, 3), (33, 1280, 5), (65, 1024, 17)]
SUPERBLOCK_CASES = [pytest.param(t, isa, gen, rows, k, n, id=f"{t}-{isa}-{rows}-{k}-{n}")
                    for pairs, gen, shapes in ((K_PAIRS, random_k_weights, K_SHAPES),
                                               (IQ_PAIRS, random_iq_weights, IQ_SHAPES))
                    for t, isa in pairs for rows, k, n in shapes]


@pytest.mark.skipif(not SUPERBLOCK_CASES, reason=NO_ARM)
@pytest.mark.parametrize("t,isa,gen,rows,k,n", SUPERBLOCK_CASES)
def test_superblock_bitwise_equal_to_ref(t, isa, gen, rows, k, n):
    rng = np.random.default_rng(rows * 31 + k + n)
    w = gen(t, rows, k, rng)
    x = (rng.standard_normal((n, k)) * 2).astype(np.float32)
    y = K.matmul(t, w, rows, k, x, isa=isa)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    np.testing.assert_array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    np.testing.assert_array_equal(K.dequantize(t, w, k, isa=isa).view(np.uint32),
                                  K.dequantize(t, w, k, isa="ref").view(np.uint32))


# --- float weights (F32, F16, BF16): FMA accumulators, the summation-order bound -----------------


@pytest.mark.skipif(not F_PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", F_PAIRS)
@pytest.mark.parametrize("rows,k,n", [(r, k, n) for k in K_FLOAT for r, n in ROWS_N])
def test_float_matmul_vs_gguf_oracle(t, isa, rows, k, n):
    check_q32_matmul_vs_oracle(t, isa, rows, k, n)


@pytest.mark.skipif(not F_PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", F_PAIRS)
@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (5, 7, 1), (17, 33, 1), (33, 1024, 1), (3, 7, 2), (9, 33, 5),
                                      (17, 100, 8), (129, 1024, 9), (8, 4096, 4)])
def test_float_vs_ref_order_bound(t, isa, rows, k, n):
    """The decode path (n = 1: four accumulators) and the prefill tile (one accumulator per
    output, full 4×4 tiles and edges) against the reference's sequential sum, within the
    summation-order bound the AVX2 kernels are held to (test_kernels_q32.test_avx2_vs_ref)."""
    w, x = inputs(t, rows, k, n, seed=rows + 5 * k + n)
    y = K.matmul(t, w, rows, k, x, isa=isa)
    y_ref = K.matmul(t, w, rows, k, x, isa="ref")
    assert np.isfinite(y).all()
    bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, K.quantize_act(t, x, isa="ref"), k)
    assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all()
    # Each output of the prefill tile is one accumulator whatever the tiling: the rows one by one
    # (edge tiles) give the same bits as the whole matrix (full tiles).
    if n > 1:
        for r in range(0, rows, max(1, rows // 3)):
            y_r = K.matmul(t, w[r:r + 1], 1, k, x, isa=isa)
            np.testing.assert_array_equal(y_r[:, 0].view(np.uint32), y[:, r].view(np.uint32))


@pytest.mark.skipif(not F_PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", F_PAIRS)
def test_float_dequantize_bitwise(t, isa):
    check_q32_dequantize_bitwise(t, isa, False)
    # Odd lengths (the scalar tail) and the special values, kept as they are.
    vals = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 1e-7, np.inf, -np.inf, np.nan, 3.0, -1.0], dtype=np.float32)
    if t == "F16":
        w = vals.astype(np.float16).view(np.uint8)
    elif t == "BF16":
        w = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        w = vals.view(np.uint8)
    got = K.dequantize(t, w.reshape(1, -1), vals.size, isa=isa)
    want = K.dequantize(t, w.reshape(1, -1), vals.size, isa="ref")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not F_PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", F_PAIRS)
def test_float_threads_and_prepared(t, isa):
    check_q32_threads_and_guards(t, isa)
    check_q32_prepared_path(t, isa)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
def test_threads_bitwise_and_guards(t, isa):
    check_q32_threads_and_guards(t, isa)


@pytest.mark.skipif(not PAIRS, reason=NO_ARM)
@pytest.mark.parametrize("t,isa", PAIRS)
def test_prepared_weights_path(t, isa):
    check_q32_prepared_path(t, isa)


@pytest.mark.skipif(not ARM_ISAS, reason=NO_ARM)
@pytest.mark.parametrize("how", ["set_active_isa", "KTD_ISA"])
@pytest.mark.parametrize("isa", ARM_ISAS)
def test_active_isa_runs_its_kernels(isa, how):
    """With the ISA chosen by set_active_isa or by the KTD_ISA environment variable, the
    active-ISA path (no isa=) of every type runs that ISA's kernels where it has them, else the
    fallback's (DOTPROD → NEON → ref): bit for bit the explicit isa= result of that ISA."""
    code = (
        "import numpy as np, os, sys\n"
        "from ktd import _native\n"
        "from kernel_inputs import q32_inputs as inputs, random_iq_weights, random_k_weights\n"
        "K = _native.kernels\n"
        "isa, how = sys.argv[1], sys.argv[2]\n"
        "if how == 'set_active_isa':\n"
        "    K.set_active_isa(isa)\n"
        "assert K.active_isa() == isa, K.active_isa()\n"
        "chain = {'i8mm': ['i8mm', 'dotprod', 'neon', 'ref'], 'dotprod': ['dotprod', 'neon', 'ref'],\n"
        "         'neon': ['neon', 'ref']}[isa]\n"
        "rng = np.random.default_rng(1)\n"
        "for t in sys.argv[3:]:\n"
        "    want_isa = next(i for i in chain if t in K.supported_types(i))\n"
        "    if t in ('Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'IQ4_NL', 'F32', 'F16', 'BF16'):\n"
        "        w, x = inputs(t, 9, 256, 2, seed=1)\n"
        "    else:\n"
        "        w = (random_iq_weights if t.startswith('IQ') and t != 'IQ4_XS' else random_k_weights)(t, 9, 256, rng)\n"
        "        x = rng.standard_normal((2, 256)).astype(np.float32)\n"
        "    y = K.matmul(t, w, 9, 256, x)\n"
        "    want = K.matmul(t, w, 9, 256, x, isa=want_isa)\n"
        "    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (t, want_isa)\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    env.pop("KTD_ISA", None)
    if how == "KTD_ISA":
        env["KTD_ISA"] = isa
    r = subprocess.run([sys.executable, "-c", code, isa, how, *ARM_TYPES], capture_output=True, text=True,
                       cwd=str(TESTS), env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
