"""The i-quant block types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) with Q8_K
activations, every ISA this machine runs, against gguf-py (dequantize bit for bit, float64
matmul) and against the scalar reference twin.

Error bound (as tests/kernels/test_kernels_k.py): the kernels' only approximation is the Q8_K rounding of
the activations, |x̃ − x| ≤ amax_block/254 per 256-block, so |y − y_exact| ≤ Σ_blocks
(amax_block/254)·Σ_{i in block}|w_i| per output, plus float32 summation rounding bounded by
1e-5·Σ|w_i||x_i|. Against the reference twin the activations are bitwise equal and only the
summation order differs: |y − y_ref| ≤ 1e-5·Σ|w_i||x_i|.

Weights are random valid blocks: every bit pattern of the index, sign, scale and shift fields
is a valid code (the grids are indexed by whole bit fields), so random bytes are used there and
only the fp16 block scale is set to a finite half around 1/64 (random bytes there would give
Inf/NaN/huge values). gguf-py's dequantizer decodes them independently.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kernel_checks import ISAS, MATMUL_SHAPES, check_dequantize_bitwise, check_gemm_tile_guard, check_matmul
from kernel_checks import check_random_matmul, check_threads_bitwise, kernels_or_skip
from kernel_inputs import IQ_BLOCKS as BLOCKS, IQ_TYPES, set_iq_block_scale as set_block_scale
from kernel_inputs import random_iq_weights as random_weights
from kernel_oracle import dequantize_ref
from ktd import _native
from paths import ROOT

K = _native.kernels
QK_K = 256
TYPES = IQ_TYPES
# The ISAs with kernels for these types here (the i-quants have reference and AVX2 kernels; under
# KTD_ISA=avx512 the AVX2 ones run, as for every type without AVX-512 kernels).
IQ_ISAS = [isa for isa in ISAS if set(TYPES) <= set(K.supported_types(isa))]


def test_block_sizes_match_gguf_py():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for qt, (size, _) in BLOCKS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[qt]] == (QK_K, size)


def test_generated_grids_up_to_date(tmp_path):
    """native/src/kernels/iq_grids.cpp is what tools/gen_iq_grids.py makes from gguf-py now."""
    out = tmp_path / "iq_grids.cpp"
    subprocess.run([sys.executable, str(ROOT / "tools/gen_iq_grids.py"), str(out)], check=True)
    assert out.read_text() == (ROOT / "native/src/kernels/iq_grids.cpp").read_text()


def test_types_registered():
    assert "ref" in IQ_ISAS
    if "avx2" in ISAS:
        assert "avx2" in IQ_ISAS
    for isa in IQ_ISAS:
        for qt in TYPES:
            assert K.act_type(qt, isa) == "Q8_K"


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_dequantize_bitwise_vs_gguf(qt, isa):
    check_dequantize_bitwise(qt, isa, random_weights, 6, 1024, seed=TYPES.index(qt))


@pytest.mark.parametrize("qt", TYPES)
def test_every_grid_point_decodes_like_gguf(qt):
    """Blocks that walk every grid index (and both shift signs / all scales) dequantize like gguf-py:
    the tables and bit fields agree everywhere, not only where random bytes happened to land."""
    rng = np.random.default_rng(99)
    size, _ = BLOCKS[qt]
    # Enough blocks that the low 8 index bits (bytes, random) and the high bits (random) cover the
    # code book many times over; then compare with the ISAs' dequantizers.
    nb = 512
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    set_block_scale(qt, blocks, rng.uniform(0.5, 1.5, nb) / 64)
    w = blocks.reshape(nb, size)
    want = dequantize_ref(qt, w, nb, QK_K).astype(np.float32)
    for isa in IQ_ISAS:
        got = K.dequantize(qt, w, QK_K, isa=isa)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=isa)


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k,n", MATMUL_SHAPES)
def test_matmul_vs_gguf(qt, isa, rows, k, n):
    check_random_matmul(qt, isa, random_weights, rows, k, n)


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_prefill_equals_decode_bitwise(qt, isa):
    """Many columns (the AVX2 tile decodes each row once per block of 64 columns into a buffer)
    give the same bits as one column at a time (weights decoded in registers)."""
    rng = np.random.default_rng(21)
    rows, k, n = 9, 768, 70
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y = K.matmul(qt, w, rows, k, x, isa=isa, threads=2)
    for c in (0, 3, 4, 5, 63, 64, 69):
        np.testing.assert_array_equal(K.matmul(qt, w, rows, k, x[c : c + 1], isa=isa), y[c : c + 1])


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_matmul_threads_bitwise(qt, isa):
    check_threads_bitwise(qt, isa, random_weights)


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("nr,nc", [(1, 1), (5, 3), (9, 7)])
def test_gemm_tile_guard_values(qt, isa, nr, nc):
    check_gemm_tile_guard(qt, isa, random_weights, nr, nc)


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_matmul_special_inputs(qt, isa):
    """Zero activations give exact zeros; an Inf block scale propagates only to its row; a NaN
    activation only to its column."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(3)
    rows, k = 4, 512
    w = random_weights(qt, rows, k, rng)
    y0 = K.matmul(qt, w, rows, k, np.zeros((2, k), np.float32), isa=isa)
    assert (y0 == 0).all()
    blocks = w.reshape(rows * k // QK_K, -1)
    set_block_scale(qt, blocks[4:5], np.array([np.inf]))  # row 2's first block
    w = blocks.reshape(rows, -1)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 300] = np.nan
    y = K.matmul(qt, w, rows, k, x, isa=isa)
    assert np.isfinite(y[[0, 2]][:, [0, 1, 3]]).all()
    assert not np.isfinite(y[[0, 2], 2]).any()
    assert np.isnan(y[1]).all()


@pytest.mark.parametrize("qt", TYPES)
def test_bad_shapes_rejected(qt):
    size, _ = BLOCKS[qt]
    w = np.zeros((2, size), np.uint8)
    with pytest.raises(ValueError):
        K.matmul(qt, w, 2, 300, np.zeros((1, 300), np.float32))  # k not a multiple of 256
    with pytest.raises(ValueError):
        K.matmul(qt, w, 3, 256, np.zeros((1, 256), np.float32))  # fewer bytes than rows × row size
    with pytest.raises(ValueError):
        K.dequantize(qt, np.zeros((1, size - 1), np.uint8), 256)
    with pytest.raises(ValueError):
        K.quantize_act(qt, np.zeros((1, 100), np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", ["IQ1_S", "IQ2_XXS", "IQ3_XXS"])
def test_model_shapes(qt, isa):
    """A DeepSeek-V3 expert matrix's k (7168) on 2 threads, vs gguf-py and vs 1 thread."""
    kernels_or_skip(qt, isa)
    rng = np.random.default_rng(7)
    rows, k = 96, 7168
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((2, k)).astype(np.float32)
    y = check_matmul(qt, isa, w, rows, k, x, threads=2)
    np.testing.assert_array_equal(y, K.matmul(qt, w, rows, k, x, isa=isa, threads=1))


# --- against llama.cpp's own kernels ----------------------------------------------------------


@pytest.fixture(scope="module")
def ggml():
    from ktd.bench.ggml_matmul import load

    g, why = load()
    if g is None:
        pytest.skip(f"llama.cpp's ggml is not available: {why}")
    return g


@pytest.mark.parametrize("isa", IQ_ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k,n", [(7, 512, 1), (33, 1280, 5)])
def test_matmul_vs_llama_cpp(ggml, qt, isa, rows, k, n):
    """llama.cpp's ggml_mul_mat on the same bytes (its CPU kernels, Q8_K activations too): the two
    differ by the float summation order, and by a Q8_K level where the two quantizers round a value
    differently (bounded per output by the activation rounding bound, as against gguf-py)."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(rows + k + n)
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    want = ggml.matmul(int(GGMLQuantizationType[qt]), w, rows, k, x).astype(np.float64)
    got = K.matmul(qt, w, rows, k, x, isa=isa).astype(np.float64)
    wd = dequantize_ref(qt, w, rows, k)
    mag = np.abs(x.astype(np.float64)) @ np.abs(wd).T
    err = np.abs(got - want)
    assert (err <= 1e-5 * mag + 1e-30).all(), f"max excess {np.max(err - 1e-5 * mag):.3g}"
