"""The 32-element types' row-interleaved ("repacked") layouts (native/src/kernels/repacked_q32.h):
the scalar specification in kernels/ref/repacked_q32.cpp (the repacks every ISA uses, the reference
tile on the x8 layouts) and the SIMD tiles held against it.

- An independent numpy decoder of each layout, written from the header's description, decodes the
  repacked bytes to exactly gguf-py's dequantization of the original rows (float32, bitwise: both
  compute d·v (+ m) once per element).
- The reference tile on the x8 layout does the plain reference's integer sums and float operations:
  bitwise equal to the plain reference tile.
- The SIMD tiles compute each block's integer dot exactly and then round d·da·Σ once per block, as
  the reference does: with one block per row (k = 32) the types without a min term (w = d·v) give
  the reference's bits. Otherwise they differ from it only in float32 summation order (and, for
  Q4_1/Q5_1, in how the m·da·Σa term is rounded): order_bound of kernel_inputs.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_checks import Q32_ISAS as ISAS
from kernel_inputs import Q32_TYPES, order_bound
from kernel_inputs import q32_inputs as inputs
from kernel_oracle import dequantize_ref
from ktd import _native

K = _native.kernels
HAVE_AVX512 = K.isa_compiled("avx512") and K.isa_supported("avx512")
X16_TYPES = ["Q5_0", "Q8_0"]  # the AVX-512 kernels' 16-row layouts
MIN_TYPES = ["Q4_1", "Q5_1"]  # w = d·q + m
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray, rows: int) -> np.ndarray:
    """Nibble layout of R rows (bytes [4 i, R r, 4 t]) → int [R, 32]: the low nibble of byte
    (i, r, t) is element 4i + t, the high nibble element 16 + 4i + t."""
    q = qs.reshape(4, rows, 4).astype(np.int64).transpose(1, 0, 2).reshape(rows, 16)
    return np.concatenate([q & 15, q >> 4], axis=1)


def bits_x8(qh: np.ndarray) -> np.ndarray:
    """qh of the x8 layouts: bit j of byte 4r + t = bit 4 of element 4j + t → int [8, 32]."""
    h = qh.reshape(8, 4).astype(np.int64)  # [r, t]
    return np.stack([(h >> j) & 1 for j in range(8)], axis=1).reshape(8, 32) << 4  # [r, j, t]


def bits_x16(qh: np.ndarray) -> np.ndarray:
    """qh of block_q5_0x16: bit 4r + t of u64 j = bit 4 of row r's element 4j + t → int [16, 32]."""
    h = qh.view(np.uint64).astype(np.uint64)  # [j]
    b = np.array([[[(int(h[j]) >> (4 * r + t)) & 1 for t in range(4)] for j in range(8)] for r in range(16)])
    return b.reshape(16, 32) << 4


def decode_group(t: str, rows: int, blk: np.ndarray) -> np.ndarray:
    """One group block → float32 [rows, 32], the weights w = d·v (+ m) as gguf-py computes them."""
    d = f16(blk[0:2 * rows])[:, None]
    if rows == 16:  # x16: d[16], then qh (Q5_0) or qs
        if t == "Q5_0":
            v = (nibbles(blk[96:352], 16) | bits_x16(blk[32:96])) - 16
        else:
            v = (blk[32:544].reshape(8, 16, 4) ^ 0x80).view(np.int8).astype(np.int64)
            v = v.transpose(1, 0, 2).reshape(16, 32)
        return d * v.astype(np.float32)
    off = 16
    m = None
    if t in MIN_TYPES:
        m, off = f16(blk[16:32])[:, None], 32
    if t == "Q8_0":
        v = blk[16:272].view(np.int8).astype(np.int64).reshape(8, 8, 4).transpose(1, 0, 2).reshape(8, 32)
        return d * v.astype(np.float32)
    if t in ("Q5_0", "Q5_1"):
        q = nibbles(blk[off + 32:off + 160], 8) | bits_x8(blk[off:off + 32])
    else:
        q = nibbles(blk[off:off + 128], 8)
    if t == "IQ4_NL":
        return d * IQ4NL_VALUES[q]
    if m is not None:
        return d * q.astype(np.float32) + m
    return d * (q - {"Q4_0": 8, "Q5_0": 16}[t]).astype(np.float32)


def decode_repacked(t: str, rows_per_group: int, wp: np.ndarray, rows: int, k: int) -> np.ndarray:
    nb, groups = k // 32, -(-rows // rows_per_group)
    blocks = wp.reshape(groups, nb, -1)
    out = np.zeros((groups * rows_per_group, k), np.float32)
    for g in range(groups):
        for b in range(nb):
            out[g * rows_per_group:(g + 1) * rows_per_group, 32 * b:32 * (b + 1)] = decode_group(t, rows_per_group, blocks[g, b])
    return out


# (type, isa that makes the layout, rows per group)
LAYOUTS = [(t, "ref", 8) for t in Q32_TYPES] + [(t, "avx512", 16) for t in X16_TYPES]


def layout_or_skip(isa: str) -> None:
    if isa == "avx512" and not HAVE_AVX512:
        pytest.skip("AVX-512 kernels not compiled or this CPU lacks AVX-512 VNNI/VBMI")


@pytest.mark.parametrize("t", Q32_TYPES)
def test_layouts_registered(t):
    """The reference has the x8 layout (version 1), every AVX2 entry shares it; the AVX-512 Q5_0/Q8_0
    entries have the x16 one (version 2)."""
    assert (K.repack_rows(t, isa="ref"), K.repack_layout(t, isa="ref")) == (8, 1)
    for isa in ISAS:
        assert (K.repack_rows(t, isa=isa), K.repack_layout(t, isa=isa)) == (8, 1)
    if HAVE_AVX512 and t in X16_TYPES:
        assert (K.repack_rows(t, isa="avx512"), K.repack_layout(t, isa="avx512")) == (16, 2)


@pytest.mark.parametrize("t,isa,R", LAYOUTS)
@pytest.mark.parametrize("rows,k", [(1, 32), (3, 64), (8, 96), (17, 160), (40, 32)])
def test_layout_decodes_to_gguf_weights(t, isa, R, rows, k):
    layout_or_skip(isa)
    w, _ = inputs(t, rows, k, 1, seed=rows * 31 + k, random_bytes=True)
    wp = K.repack(t, w, rows, k, isa=isa)
    assert wp.size == -(-rows // R) * R * w.shape[1]
    got = decode_repacked(t, R, wp, rows, k)
    want = dequantize_ref(t, w, rows, k).astype(np.float32)
    np.testing.assert_array_equal(got[:rows].view(np.uint32), want.view(np.uint32))
    assert (got[rows:] == 0).all()  # the zero rows padding the last group


@pytest.mark.parametrize("t,isa,R", LAYOUTS)
def test_repack_same_bytes_for_every_isa_and_thread_count(t, isa, R):
    layout_or_skip(isa)
    rows, k = 43, 32 * 7
    w, _ = inputs(t, rows, k, 1, seed=5, random_bytes=True)
    want = K.repack(t, w, rows, k, isa=isa, threads=1)
    users = [isa] if R == 16 else ISAS  # the x8 repack is the reference's on every ISA
    for u in users:
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(K.repack(t, w, rows, k, isa=u, threads=threads), want)


def encode_x16(t: str, w: np.ndarray, rows: int, k: int) -> np.ndarray:
    """The x16 layout (kernels/repacked_q32.h) written with numpy from the header's description:
    d[16]; Q5_0: qh u64[8] with bit 4r + t of u64 j = bit 4 of row r's element 4j + t, then
    qs[64i + 4r + t] = row r's qs byte 4i + t; Q8_0: qs[64j + 4r + t] = row r's element 4j + t
    XOR 0x80. Rows past the end of the matrix are zero bytes."""
    nb, groups, bs = k // 32, -(-rows // 16), w.shape[1] // (k // 32)
    blocks = np.zeros((groups * 16, nb, bs), np.uint8)
    blocks[:rows] = w.reshape(rows, nb, bs)
    B = blocks.reshape(groups, 16, nb, bs).transpose(0, 2, 1, 3)  # [g, b, r, bytes]
    out = np.zeros((groups, nb, 16 * bs), np.uint8)
    out[..., :32] = B[..., :2].reshape(groups, nb, 32)
    present = (np.arange(groups * 16) < rows).reshape(groups, 1, 16, 1)
    if t == "Q8_0":
        q = np.where(present, B[..., 2:34] ^ 0x80, 0).astype(np.uint8)  # [g, b, r, 32]
        out[..., 32:] = q.reshape(groups, nb, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nb, 512)
    else:
        bits = np.ascontiguousarray(B[..., 2:6]).view("<u4")[..., 0].astype(np.uint64)  # [g, b, r]
        shift = (4 * np.arange(16)).astype(np.uint64)
        qh = np.stack([(((bits >> np.uint64(4 * j)) & np.uint64(15)) << shift).sum(axis=-1, dtype=np.uint64)
                       for j in range(8)], axis=-1)  # [g, b, 8]
        out[..., 32:96] = qh.astype("<u8").view(np.uint8).reshape(groups, nb, 64)
        out[..., 96:] = B[..., 6:22].reshape(groups, nb, 16, 4, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nb, 256)
    return out.reshape(-1)


@pytest.mark.parametrize("t", X16_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 32), (7, 64), (15, 32), (16, 96), (17, 160), (31, 32), (33, 1024), (70, 224)])
def test_x16_repack_is_the_layout_bitwise(t, rows, k):
    """The AVX-512 entries' x16 repacks (AVX2 code, kernels/avx2/repack_q32.cpp) against the
    layout encoded independently with numpy: every byte, partial last groups, the pool's group
    ranges (threads 1 and 3)."""
    layout_or_skip("avx512")
    w, _ = inputs(t, rows, k, 1, seed=rows * 5 + k, random_bytes=True)
    want = encode_x16(t, w, rows, k)
    for threads in (1, 3):
        np.testing.assert_array_equal(K.repack(t, w, rows, k, isa="avx512", threads=threads), want)


SHAPES = [(1, 32, 1), (7, 32, 3), (17, 160, 5), (33, 1024, 2), (8, 64, 9), (40, 96, 8), (77, 160, 64)]


@pytest.mark.parametrize("t", Q32_TYPES)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_reference_tile_on_layout_is_plain_reference(t, rows, k, n):
    w, x = inputs(t, rows, k, n, seed=rows * 7 + k + n, random_bytes=True)
    y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa="ref"), rows, k, x, isa="ref", threads=2)
    np.testing.assert_array_equal(y.view(np.uint32), K.matmul(t, w, rows, k, x, isa="ref").view(np.uint32))


SIMD_LAYOUTS = ([(t, isa) for t in Q32_TYPES for isa in ISAS if isa != "ref"]
                + [(t, "avx512") for t in X16_TYPES])


@pytest.mark.parametrize("t,isa", SIMD_LAYOUTS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_simd_tile_on_layout_vs_scalar(t, isa, rows, k, n):
    layout_or_skip(isa)
    w, x = inputs(t, rows, k, n, seed=rows * 5 + k + n, random_bytes=True)
    y = K.matmul_repacked(t, K.repack(t, w, rows, k, isa=isa), rows, k, x, isa=isa)
    y_ref = K.matmul_repacked(t, K.repack(t, w, rows, k, isa="ref"), rows, k, x, isa="ref")
    if k == 32 and t not in MIN_TYPES:
        np.testing.assert_array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    else:
        bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, K.quantize_act(t, x, isa="ref"), k)
        assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all()


@pytest.mark.parametrize("t,isa", SIMD_LAYOUTS)
def test_decode_prefetch_changes_no_bits(t, isa):
    """The decode GEMV (n = 1) in every software prefetch mode (k_decode_prefetch: off, l1, l2):
    the same arithmetic, so the same bits, and within the order bound of the scalar tile each way."""
    layout_or_skip(isa)
    try:
        for rows, k in [(1, 32), (19, 96), (40, 896), (133, 2048)]:
            w, x = inputs(t, rows, k, 1, seed=rows + k, random_bytes=True)
            wp = K.repack(t, w, rows, k, isa=isa)
            y_ref = K.matmul_repacked(t, K.repack(t, w, rows, k, isa="ref"), rows, k, x, isa="ref")
            bound = order_bound(t, w, dequantize_ref(t, w, rows, k), x, K.quantize_act(t, x, isa="ref"), k)
            got = []
            for mode in (1, 2, 0):
                K.set_decode_prefetch(mode)
                y = K.matmul_repacked(t, wp, rows, k, x, isa=isa, threads=2)
                assert (np.abs(y.astype(np.float64) - y_ref) <= bound).all()
                got.append(y)
            for y in got[1:]:
                np.testing.assert_array_equal(got[0].view(np.uint32), y.view(np.uint32))
    finally:
        K.set_decode_prefetch(-1)
