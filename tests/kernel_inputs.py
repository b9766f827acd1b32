"""Inputs of the kernel tests and the error bounds that go with them: valid random weight blocks
of every quantized type, activations, and the shapes the kernels are run on.

- 256-element blocks (K-quants, IQ4_XS, ternary TQ1_0/TQ2_0): ``random_k_weights``, random bytes
  for the packed values and scales, the fp16 d (and dmin) set to finite halves around 1/64
  (random bytes there would give Inf/NaN/huge values).
- i-quants (IQ1_S ... IQ3_S): ``random_iq_weights``, likewise; every bit pattern of their index,
  sign, scale and shift fields is a valid code, only the block scale is set.
- 32-element blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) and the float types (F32, F16, BF16):
  ``q32_inputs``, gguf-py's quantizer where it has one (or random bytes with sane scales), and the
  bounds ``oracle_bound`` (against gguf-py + float64) and ``order_bound`` (two summation orders).

Error bounds of the 32-element and float types:
- vs gguf-py + float64: the 32-element types dot against Q8_0 activations. Activation element a_j
  of a block with scale d = amax/127 is off by at most d/2 (rounding) plus |q_j|·|d - fp16(d)| ≤
  127·d·2^-11 (the stored scale is fp16), i.e. ≤ 0.5625·d. So |y - y64| ≤ Σ_b 0.5625·d_b·Σ_{j∈b}|w_j|
  plus float32 accumulation (≤ 2·nb·2^-24·Σ|w·a|). Float types use F32 activations: only the float32
  accumulation error, ≤ 2·k·2^-24·Σ|w·x|.
- two kernels on the same activations (quantized bitwise identically, tested) differ only in the
  float32 summation order of the per-block partial sums: ≤ 2·(nb + 8)·2^-24·S with S the sum of
  the magnitudes of all partial products (for Q4_1/Q5_1 the d·q and m terms separately).
"""

from __future__ import annotations

import numpy as np
from gguf.quants import quantize

from kernel_oracle import qtype, row_bytes

QK_K = 256
EPS32 = 2.0**-24

# --- 256-element blocks -------------------------------------------------------------------------

# Block bytes and the byte offsets of the fp16 fields in each block (ggml-common.h): scale d, and
# dmin where present.
K_FP16_FIELDS = {
    "Q2_K": (84, [80], [82]),
    "Q3_K": (110, [108], []),
    "Q4_K": (144, [0], [2]),
    "Q5_K": (176, [0], [2]),
    "Q6_K": (210, [208], []),
    "IQ4_XS": (136, [0], []),
    "TQ1_0": (54, [52], []),
    "TQ2_0": (66, [64], []),
}
K_TYPES = list(K_FP16_FIELDS)


def random_k_weights(qt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] random blocks of a K_TYPES type with finite positive d (and dmin)."""
    size, d_off, dmin_off = K_FP16_FIELDS[qt]
    nb = rows * k // QK_K
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in d_off + dmin_off:
        h = (rng.uniform(0.5, 1.5, nb) / 64).astype(np.float16)
        blocks[:, off : off + 2] = h.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, row_bytes(qt, k))


# --- i-quants -----------------------------------------------------------------------------------

# Block size and the byte offset of the fp16 block scale d (None: IQ1_M, whose d is split over
# the top nibbles of the 4 uint16 at bytes 48..55).
IQ_BLOCKS = {
    "IQ1_S": (50, 0),
    "IQ1_M": (56, None),
    "IQ2_XXS": (66, 0),
    "IQ2_XS": (74, 0),
    "IQ2_S": (82, 0),
    "IQ3_XXS": (98, 0),
    "IQ3_S": (110, 0),
}
IQ_TYPES = list(IQ_BLOCKS)


def set_iq_block_scale(qt: str, blocks: np.ndarray, h: np.ndarray) -> None:
    """Write the fp16 values h [nb] as the block scale d of blocks [nb, size] (in place)."""
    size, off = IQ_BLOCKS[qt]
    bits = h.astype(np.float16).view(np.uint16).astype(np.uint16)
    if off is not None:
        blocks[:, off : off + 2] = bits.view(np.uint8).reshape(-1, 2)
        return
    sc = blocks[:, 48:56].copy().view(np.uint16).reshape(-1, 4)  # IQ1_M
    for i in range(4):
        nib = (bits >> (4 * i)) & 0xF
        sc[:, i] = (sc[:, i] & 0x0FFF) | (nib << 12)
    blocks[:, 48:56] = sc.view(np.uint8).reshape(-1, 8)


def random_iq_weights(qt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] random blocks of an IQ_TYPES type with a finite positive block scale."""
    size, _ = IQ_BLOCKS[qt]
    nb = rows * k // QK_K
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    set_iq_block_scale(qt, blocks, rng.uniform(0.5, 1.5, nb) / 64)
    return blocks.reshape(rows, row_bytes(qt, k))


# --- 32-element blocks and float types ----------------------------------------------------------

Q32_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
# Byte offset of the fp16 m (min) field in the blocks that have one.
M_OFFSET = {"Q4_1": 2, "Q5_1": 2}

# rows x n pairs covering the GEMV (n = 1) and GEMM paths, the column tile (4) edges and a
# prefill size; rows cover partial row chunks (16) and partial thread ranges.
ROWS_N = [(1, 1), (3, 2), (7, 3), (17, 4), (33, 5), (129, 6), (7, 7), (17, 8), (33, 9), (129, 64)]
K_Q32 = [32, 160, 1024]
K_FLOAT = [1, 7, 33, 100, 1024]


def make_q32_weights(t: str, rows: int, k: int, rng: np.random.Generator, random_bytes: bool = False) -> np.ndarray:
    """[rows, row_bytes] uint8 weights: gguf-py's quantizer where it has one, else (or when asked)
    random bytes with sane fp16 scale fields (every q bit pattern occurs)."""
    if t == "F32":
        return rng.standard_normal((rows, k)).astype(np.float32).view(np.uint8)
    if t in ("F16", "BF16") or (t != "IQ4_NL" and not random_bytes):
        w = rng.standard_normal((rows, k)).astype(np.float32)
        return np.ascontiguousarray(quantize(w, qtype(t))).view(np.uint8).reshape(rows, -1)
    nb = k // 32
    bsize = row_bytes(t, 32)
    w = rng.integers(0, 256, (rows, nb, bsize), dtype=np.uint8)
    d = (rng.uniform(0.002, 0.05, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
    w[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    if t in M_OFFSET:
        m = rng.uniform(-0.5, 0.5, (rows, nb)).astype(np.float16)
        w[:, :, 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
    return w.reshape(rows, -1)


def q32_inputs(t: str, rows: int, k: int, n: int, seed: int, random_bytes: bool = False):
    """Weights of type t (make_q32_weights) and standard-normal F32 activations [n, k]."""
    rng = np.random.default_rng(seed)
    w = make_q32_weights(t, rows, k, rng, random_bytes)
    x = rng.standard_normal((n, k)).astype(np.float32)
    return w, x


def act_dequant(xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 activation rows (uint8 [n, row_bytes]) -> float64 [n, k] and the per-block scales."""
    n = xq.shape[0]
    blocks = xq.reshape(n, k // 32, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float64)  # [n, nb, 1]
    q = blocks[:, :, 2:].copy().view(np.int8).astype(np.float64)
    return (d * q).reshape(n, k), d[:, :, 0]


def m_fields(t: str, w: np.ndarray, k: int) -> np.ndarray:
    """|m| of each block broadcast to elements, float64 [rows, k] (zeros for types without m)."""
    rows = w.shape[0]
    if t not in M_OFFSET:
        return np.zeros((rows, k))
    blocks = w.reshape(rows, k // 32, -1)
    m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64)
    return np.repeat(np.abs(m[:, :, 0]), 32, axis=1)


def oracle_bound(t: str, w_deq: np.ndarray, x: np.ndarray, xq: np.ndarray, k: int) -> np.ndarray:
    """Per-element bound on |y - W·x (float64)| from the activation format (module docstring)."""
    absw = np.abs(w_deq)
    if t in FLOAT_TYPES:
        return 2 * k * EPS32 * (np.abs(x.astype(np.float64)) @ absw.T) + 1e-30
    a, d = act_dequant(xq, k)
    nb = k // 32
    wsum = absw.reshape(absw.shape[0], nb, 32).sum(axis=2)  # [rows, nb]
    act_err = 0.5625 * d @ wsum.T  # [n, rows]
    acc_err = 2 * (nb + 8) * EPS32 * (np.abs(a) @ absw.T)
    return act_err * (1 + 1e-6) + acc_err + 1e-30


def order_bound(t: str, w: np.ndarray, w_deq: np.ndarray, x: np.ndarray, xq: np.ndarray, k: int) -> np.ndarray:
    """Bound on the difference of two summation orders of the same products (module docstring)."""
    if t in FLOAT_TYPES:
        return 2 * (k + 8) * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(w_deq).T) + 1e-30
    a, _ = act_dequant(xq, k)
    mag = np.abs(w_deq) + 2 * m_fields(t, w, k)
    return 2 * (k // 32 + 8) * EPS32 * (np.abs(a) @ mag.T) + 1e-30
