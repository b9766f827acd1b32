"""The aarch64 repacked layouts ("arm x4", version 3: 4 rows interleaved in 8-byte groups, SMMLA's
operand shape) of the 32-element types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL
(native/src/kernels/repacked_q32.h) and Q4_K, Q6_K (repacked_k.h), and the NEON / dotprod / i8mm
tiles on them.

- 32-element types: an independent numpy decoder of the layout, written from the header's
  description, decodes the repacked bytes to exactly gguf-py's dequantization of the original rows
  (float32, bitwise), and the rows padding the last group are zero.
- Q4_K/Q6_K: a numpy decoder written from the header rebuilds each row's original block bytes
  from the group blocks (so gguf-py's dequantization of them is the original's); padding rows zero.
- The tiles (NEON: SMULL/SADALP, dotprod: SDOT, i8mm: SMMLA on pairs of tokens, SDOT for an odd last
  one) sum each block exactly and do the reference's float operations per (row, token) in block
  order, so they equal the plain scalar reference bit for bit, for every shape: n = 1 (decode),
  even and odd n (prefill), partial groups, several thread counts, and through prepare_weights
  (the forward's path).

Only an aarch64 build has the layout (make test-arm64 runs this file under qemu, with -cpu max for
i8mm and -cpu cortex-a57 for NEON only); elsewhere every test is skipped with that reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_inputs import q32_inputs as inputs, random_k_weights
from kernel_oracle import dequantize_ref
from ktd import _native

K = _native.kernels
ARM_ISAS = [i for i in ("neon", "dotprod", "i8mm") if K.isa_compiled(i) and K.isa_supported(i)]
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
K_TYPES = ["Q4_K", "Q6_K"]
R = 4
LAYOUT = 3
PAIRS = [(t, isa) for t in TYPES for isa in ARM_ISAS]
K_PAIRS = [(t, isa) for t in K_TYPES for isa in ARM_ISAS]
pytestmark = pytest.mark.skipif(not ARM_ISAS, reason="the arm x4 layout exists only in aarch64 builds "
                                "(x86-64 here, or no ARM ISA supported)")


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


# The IQ4_NL code book (the format's definition, as in ggml-common.h and gguf-py).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
# Group block bytes per layout: d[4] (fp16), then m[4] (fp16) where the type has a min, then qh[16]
# for the 5-bit types, then qs.
GROUP_FIELDS = {"Q8_0": ("d", "qs8"), "Q4_0": ("d", "qs4"), "Q4_1": ("d", "m", "qs4"),
                "Q5_0": ("d", "qh", "qs4"), "Q5_1": ("d", "m", "qh", "qs4"), "IQ4_NL": ("d", "qs4")}
FIELD_BYTES = {"d": 8, "m": 8, "qh": 16, "qs8": 128, "qs4": 64}


def split_group(t: str, blk: np.ndarray) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for f in GROUP_FIELDS[t]:
        out[f] = blk[at:at + FIELD_BYTES[f]]
        at += FIELD_BYTES[f]
    assert at == blk.size
    return out


def decode_group(t: str, blk: np.ndarray) -> np.ndarray:
    """One group block (4 rows) → float32 [4, 32] as gguf-py computes it: d·v, or d·q + m."""
    g = split_group(t, blk)
    d = f16(g["d"])[:, None]
    if t == "Q8_0":
        # qs[32c + 8r + t] = row r's element 8c + t
        v = g["qs8"].view(np.int8).reshape(4, 4, 8).transpose(1, 0, 2).reshape(4, 32)
        return d * v.astype(np.float32)
    # qs[32h + 8r + t] = row r's qs byte 8h + t: low nibble element 8h + t, high 16 + 8h + t
    b = g["qs4"].astype(np.int64).reshape(2, 4, 8).transpose(1, 0, 2).reshape(4, 16)
    q = np.concatenate([b & 15, b >> 4], axis=1)
    if "qh" in g:
        # bit 2c + p of qh byte 8s + t = bit 4 of row 2p + s's element 8c + t
        bits = (g["qh"].astype(np.int64).reshape(2, 8, 1) >> np.arange(8)) & 1  # [s, t, 2c + p]
        q = q | (bits.reshape(2, 8, 4, 2).transpose(3, 0, 2, 1).reshape(4, 32) << 4)  # [2p + s, 8c + t]
    if t == "IQ4_NL":
        return d * KVALUES_IQ4NL[q]
    if t in ("Q4_1", "Q5_1"):
        return d * q.astype(np.float32) + f16(g["m"])[:, None]
    return d * (q - (16 if t == "Q5_0" else 8)).astype(np.float32)


def decode_repacked(t: str, wp: np.ndarray, rows: int, k: int) -> np.ndarray:
    nb, groups = k // 32, -(-rows // R)
    blocks = wp.reshape(groups, nb, -1)
    out = np.zeros((groups * R, k), np.float32)
    for g in range(groups):
        for b in range(nb):
            out[g * R:(g + 1) * R, 32 * b:32 * (b + 1)] = decode_group(t, blocks[g, b])
    return out


@pytest.mark.parametrize("t,isa", PAIRS + K_PAIRS)
def test_layout_registered(t, isa):
    assert (K.repack_rows(t, isa=isa), K.repack_layout(t, isa=isa)) == (R, LAYOUT)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("rows,k", [(1, 32), (3, 64), (4, 96), (17, 160), (40, 32)])
def test_layout_decodes_to_gguf_weights(t, rows, k):
    w, _ = inputs(t, rows, k, 1, seed=rows * 31 + k, random_bytes=True)
    wp = K.repack(t, w, rows, k, isa=ARM_ISAS[0])
    assert wp.size == -(-rows // R) * R * w.shape[1]
    got = decode_repacked(t, wp, rows, k)
    want = dequantize_ref(t, w, rows, k).astype(np.float32)
    np.testing.assert_array_equal(got[:rows].view(np.uint32), want.view(np.uint32))
    assert (got[rows:] == 0).all()


@pytest.mark.parametrize("t", TYPES)
def test_repack_same_bytes_for_every_isa_and_thread_count(t):
    rows, k = 43, 32 * 7
    w, _ = inputs(t, rows, k, 1, seed=5, random_bytes=True)
    want = K.repack(t, w, rows, k, isa=ARM_ISAS[0], threads=1)
    for isa in ARM_ISAS:
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(K.repack(t, w, rows, k, isa=isa, threads=threads), want)


# (rows, k, n): decode (n = 1), odd and even n for the i8mm token pairs, partial groups (rows % 4),
# one block and many, a prefill-sized batch.
SHAPES = [(1, 32, 1), (7, 32, 3), (4, 64, 2), (17, 160, 5), (33, 1024, 2), (8, 64, 9), (40, 96, 8),
          (77, 160, 64), (130, 256, 1), (5, 32, 17)]


@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_tile_on_layout_is_plain_reference(t, isa, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows * 5 + k + n, random_bytes=True)
    want = K.matmul(t, w, rows, k, x, isa="ref")
    for threads in (1, 3):
        y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa=isa), rows, k, x, isa=isa, threads=threads)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t,isa", PAIRS)
@pytest.mark.parametrize("n", [1, 2, 7])
def test_prepared_weights_repacked_is_plain_reference(t, isa, n):
    rows, k = 37, 256
    w, x = inputs(t, rows, k, n, seed=11 + n)
    y, repacked = K.matmul_prepared(t, w, rows, k, x, isa=isa, threads=2)
    assert repacked
    np.testing.assert_array_equal(y.view(np.uint32), K.matmul(t, w, rows, k, x, isa="ref").view(np.uint32))
    y_plain, repacked = K.matmul_prepared(t, w, rows, k, x, isa=isa, threads=2, allow_repack=False)
    assert not repacked
    np.testing.assert_array_equal(y_plain.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("t,isa", PAIRS)
def test_repacked_guard_bytes(t, isa):
    """Only the n·rows floats are written (partial last group: its padding rows are not stored)."""
    rows, k, n = 6, 64, 3
    w, x = inputs(t, rows, k, n, seed=3)
    wp = K.repack(t, w, rows, k, isa=isa)
    out = np.full(n * rows + 16, 7.5, np.float32)
    K.matmul_into(t, wp, rows, k, x, out, 8, isa=isa, repacked=True)
    assert (out[:8] == 7.5).all() and (out[8 + n * rows:] == 7.5).all()
    want = K.matmul(t, w, rows, k, x, isa="ref").reshape(-1)
    np.testing.assert_array_equal(out[8:8 + n * rows].view(np.uint32), want.view(np.uint32))


# ---- Q4_K, Q6_K --------------------------------------------------------------------------------

def deinterleave8(x: np.ndarray) -> np.ndarray:
    """x[32i + 8r + t] = row r's byte 8i + t → [4, n/4] (each row's bytes)."""
    return x.reshape(-1, 4, 8).transpose(1, 0, 2).reshape(4, -1)


def k_rows_from_group(t: str, blk: np.ndarray) -> np.ndarray:
    """One K group block → the 4 rows' original blocks ([4, 144] Q4_K, [4, 210] Q6_K)."""
    if t == "Q4_K":  # d[4], dmin[4], scales[4][12], qs interleaved; block_q4_K = d, dmin, scales, qs
        d, dmin = blk[0:8].reshape(4, 2), blk[8:16].reshape(4, 2)
        return np.concatenate([d, dmin, blk[16:64].reshape(4, 12), deinterleave8(blk[64:576])], axis=1)
    # d[4], scales[4][16], ql, qh interleaved; block_q6_K = ql, qh, scales, d
    return np.concatenate([deinterleave8(blk[72:584]), deinterleave8(blk[584:840]), blk[8:72].reshape(4, 16),
                           blk[0:8].reshape(4, 2)], axis=1)


def k_weights(t: str, rows: int, k: int, seed: int) -> np.ndarray:
    return random_k_weights(t, rows, k, np.random.default_rng(seed))


@pytest.mark.parametrize("t", K_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 256), (3, 512), (4, 256), (9, 768)])
def test_k_layout_holds_the_original_blocks(t, rows, k):
    w = k_weights(t, rows, k, seed=rows + k)
    wp = K.repack(t, w, rows, k, isa=ARM_ISAS[0])
    nb, groups, size = k // 256, -(-rows // R), w.shape[1] // (k // 256)
    assert wp.size == groups * R * w.shape[1]
    blocks = wp.reshape(groups, nb, R * size)
    got = np.zeros((groups * R, nb, size), np.uint8)
    for g in range(groups):
        for b in range(nb):
            got[g * R:(g + 1) * R, b] = k_rows_from_group(t, blocks[g, b])
    np.testing.assert_array_equal(got[:rows].reshape(rows, -1), w)
    assert (got[rows:] == 0).all()
    # and so they dequantize (gguf-py) to the original weights
    np.testing.assert_array_equal(dequantize_ref(t, got[:rows].reshape(rows, -1), rows, k), dequantize_ref(t, w, rows, k))


@pytest.mark.parametrize("t", K_TYPES)
def test_k_repack_same_bytes_for_every_isa_and_thread_count(t):
    rows, k = 23, 512
    w = k_weights(t, rows, k, seed=9)
    want = K.repack(t, w, rows, k, isa=ARM_ISAS[0], threads=1)
    for isa in ARM_ISAS:
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(K.repack(t, w, rows, k, isa=isa, threads=threads), want)


K_SHAPES = [(1, 256, 1), (7, 256, 3), (4, 512, 2), (17, 256, 5), (9, 1024, 8), (33, 256, 17), (6, 768, 1)]


@pytest.mark.parametrize("t,isa", K_PAIRS)
@pytest.mark.parametrize("rows,k,n", K_SHAPES)
def test_k_tile_on_layout_is_plain_reference(t, isa, rows, k, n):
    w = k_weights(t, rows, k, seed=rows * 3 + k + n)
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    want = K.matmul(t, w, rows, k, x, isa="ref")
    for threads in (1, 3):
        y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa=isa), rows, k, x, isa=isa, threads=threads)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t,isa", K_PAIRS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_k_prepared_weights_repacked_is_plain_reference(t, isa, n):
    rows, k = 21, 512
    w = k_weights(t, rows, k, seed=n)
    x = np.random.default_rng(n + 1).standard_normal((n, k)).astype(np.float32)
    y, repacked = K.matmul_prepared(t, w, rows, k, x, isa=isa, threads=2)
    assert repacked
    np.testing.assert_array_equal(y.view(np.uint32), K.matmul(t, w, rows, k, x, isa="ref").view(np.uint32))


# ---- the forward ----------------------------------------------------------------------------------

# The tiny-model generator's 32-element weight types (models/tiny_dense.py) and how far a quantized
# tiny model's logits may be from the float64 numpy forward (test_forward.TOL_Q).
MODEL_TYPES = ["Q8_0", "Q4_0", "Q5_0"]
TOL_Q = 6e-2


@pytest.fixture
def active_isa():
    """Sets the active ISA for the test and restores the one before it."""
    before = K.active_isa()
    yield K.set_active_isa
    K.set_active_isa(before)


@pytest.mark.parametrize("wtype", MODEL_TYPES)
@pytest.mark.parametrize("isa", ARM_ISAS)
def test_forward_uses_the_layout(tmp_path, active_isa, wtype, isa):
    """A tiny model's matrices load into the arm x4 layout (prepare_weights) and the forward on
    them gives the unrepacked model's logits bit for bit (every tile is the reference's arithmetic),
    within the quantized bound of the numpy forward."""
    from models.tiny_dense import make_model, model_filename
    from reference.numpy_forward import forward as numpy_forward

    active_isa(isa)
    path = str(make_model("qwen2", tmp_path / model_filename("qwen2", wtype), wtype=wtype))
    tokens = [1] + np.random.default_rng(2).integers(3, 300, size=11).tolist()
    n = len(tokens)

    def logits(model):
        ctx = _native.Context(model, 32, 1, 32)
        return ctx.forward(np.array(tokens), np.arange(n), np.zeros(n), np.ones(n, bool))

    packed = _native.Model(path, n_threads=2, pin=False, allow_repack=True)
    plain = _native.Model(path, n_threads=2, pin=False, allow_repack=False)
    assert packed.repacked_bytes > 0 and plain.repacked_bytes == 0
    got = logits(packed)
    np.testing.assert_array_equal(got.view(np.uint32), logits(plain).view(np.uint32))
    ref = numpy_forward(path, tokens)
    assert np.max(np.abs(got - ref)) / max(1.0, float(np.max(np.abs(ref)))) < TOL_Q
