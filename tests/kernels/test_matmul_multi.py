"""matmul_multi: several matrices on one input in one pool region (the forward's Q/K/V and
gate/up). Checked bit for bit against one matmul per matrix plus a numpy bias add (the per-matrix
path, itself checked against gguf-py in test_kernels_q32/test_kernels_k), against gguf-py's
dequantized weights in float64, for the decode path (few rows: activations quantized per worker)
and the batch path (shared activations behind a barrier), at several thread counts."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import quantize

from kernel_oracle import dequantize_ref, qtype, row_bytes
from ktd import _native

K = _native.kernels
# K-quant block bytes and the offsets of its fp16 scale fields (gguf-py has no K-quant quantizer:
# those weights are random bytes with sane scales).
K_FP16_FIELDS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def _weights(t: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if t in K_FP16_FIELDS:
        size, offs = K_FP16_FIELDS[t]
        nb = rows * k // 256
        blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        for off in offs:
            h = (rng.uniform(0.5, 1.5, nb) / 64).astype(np.float16)
            blocks[:, off : off + 2] = h.view(np.uint8).reshape(nb, 2)
        return blocks.reshape(-1)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    return np.ascontiguousarray(quantize(w, qtype(t))).view(np.uint8).reshape(-1)


# (type, rows): mixed activation formats (Q8_0 for Q5_0/Q8_0, Q8_K for Q4_K/Q6_K), row counts that
# are not multiples of the 16-row work unit, matrices much smaller than others.
MIXES = [
    [("Q5_0", 96), ("Q5_0", 16), ("Q8_0", 16)],  # a small model's Q, K, V
    [("Q4_K", 200), ("Q4_K", 200)],  # gate, up
    [("Q4_K", 64), ("Q4_K", 23), ("Q6_K", 41)],
    [("Q8_0", 5)],
]


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "+".join(f"{t}x{r}" for t, r in m))
@pytest.mark.parametrize("n", [1, 3, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("repack", [False, True])
def test_matches_per_matrix_matmul(mix, n, threads, repack):
    rng = np.random.default_rng(hash((len(mix), n, threads)) % 2**32)
    k = 256
    x = rng.standard_normal((n, k)).astype(np.float32)
    mats = []
    for i, (t, rows) in enumerate(mix):
        bias = rng.standard_normal(rows).astype(np.float32) if i % 2 == 0 else None
        mats.append((t, _weights(t, rows, k, rng), rows, bias))
    got = K.matmul_multi(mats, k, x, threads=threads, repack=repack)
    assert len(got) == len(mats)
    for (t, w, rows, bias), y in zip(mats, got):
        if repack and K.repack_rows(t) > 0:  # the same interleaved layout through the one-matrix path
            want = np.zeros(n * rows, np.float32)
            K.matmul_into(t, K.repack(t, w, rows, k), rows, k, x, want, 0, repacked=True)
            want = want.reshape(n, rows)
        else:
            want = K.matmul(t, w, rows, k, x, threads=1)
        if bias is not None:
            want = want + bias
        assert y.shape == (n, rows)
        np.testing.assert_array_equal(y, want)
        # Independent: gguf-py's dequantized weights in float64. The activations are quantized to
        # 8 bits (relative error ≤ 2^-7 of each block's max per element), so the dot products are
        # within 2^-6 · Σ|w|·max|x| of the exact ones.
        wf = dequantize_ref(t, w.reshape(rows, row_bytes(t, k)), rows, k)
        exact = x.astype(np.float64) @ wf.T + (0.0 if bias is None else bias)
        bound = 2.0**-6 * (np.abs(wf).sum(axis=1)[None, :] * np.abs(x).max(axis=1)[:, None]) + 1e-4
        assert np.all(np.abs(y - exact) <= bound)


def test_rejects_bad_job_lists():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    w256 = _weights("Q8_0", 16, 256, rng)
    w512 = _weights("Q8_0", 16, 512, rng)
    with pytest.raises(ValueError, match="1..8"):
        K.matmul_multi([], 256, x)
    with pytest.raises(ValueError, match="1..8"):
        K.matmul_multi([("Q8_0", w256, 16, None)] * 9, 256, x)
    with pytest.raises(ValueError, match="wrong size"):
        K.matmul_multi([("Q8_0", w256, 16, None), ("Q8_0", w512, 16, None)], 256, x)
    with pytest.raises(ValueError, match="bias"):
        K.matmul_multi([("Q8_0", w256, 16, np.zeros(3, np.float32))], 256, x)


# --- the row hook (MatmulRowHook: the greedy argmax's epilogue on the output head) ----------------

@pytest.mark.parametrize("t, rows", [("Q8_0", 5), ("Q4_K", 200), ("Q5_0", 1000), ("Q6_K", 3000)])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_hook_sees_every_final_row_once(t, rows, n, threads):
    """The hook is called for every row of Y exactly once (its calls tile [0, rows) without
    overlap), with all n columns, from the workers of the pool, and what it sees is Y's final value,
    the bias added; Y itself equals the plain matmul plus the bias bit for bit."""
    rng = np.random.default_rng(rows * 7 + n * 3 + threads)
    k = 256
    w = _weights(t, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    y, seen, calls = K.matmul_hook_calls(t, w, rows, k, x, bias=bias, threads=threads)
    plain, _ = K.matmul_prepared(t, w, rows, k, x, threads=threads)
    assert np.array_equal(y, plain + bias)
    assert np.array_equal(seen, y)
    covered = np.zeros(rows, np.int64)
    for r0, r1, nn, tid in calls:
        assert 0 <= r0 < r1 <= rows and nn == n and 0 <= tid < threads
        covered[r0:r1] += 1
    assert (covered == 1).all()


# --- matmul_pair (MatmulPairHook: an FFN's gate and up, then the GLU on each worker's rows) -------

PAIRS = [
    (("Q4_K", 200), ("Q4_K", 200)),  # rows not a multiple of the 16-row unit
    (("Q5_0", 1000), ("Q5_0", 1000)),
    (("Q4_K", 3000), ("Q6_K", 3000)),  # different types, one activation format (Q8_K)
    (("Q8_0", 48), ("Q5_0", 48)),
    (("Q4_K", 96), ("Q8_0", 96)),  # two activation formats (Q8_K and Q8_0)
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0][0]}+{p[1][0]}x{p[0][1]}")
@pytest.mark.parametrize("n", [1, 3, 40])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("repack", [False, True])
def test_pair_matches_multi_and_hook_sees_both_once(pair, n, threads, repack):
    """matmul_pair's products equal matmul_multi's on the same two matrices bit for bit (biases
    added), its hook is called for every row exactly once with the final values of both matrices'
    rows, and what the hook writes into them stays there."""
    (ta, rows), (tb, _) = pair
    rng = np.random.default_rng(rows * 11 + n * 5 + threads + 2 * repack)
    k = 256
    x = rng.standard_normal((n, k)).astype(np.float32)
    a = (ta, _weights(ta, rows, k, rng), rows, rng.standard_normal(rows).astype(np.float32))
    b = (tb, _weights(tb, rows, k, rng), rows, None)
    ya, yb, seen_a, seen_b, calls = K.matmul_pair_calls(a, b, k, x, threads=threads, repack=repack)
    want_a, want_b = K.matmul_multi([a, b], k, x, threads=1, repack=repack)
    np.testing.assert_array_equal(yb, want_b)
    np.testing.assert_array_equal(seen_a, want_a)
    np.testing.assert_array_equal(seen_b, want_b)
    np.testing.assert_array_equal(ya, want_a + np.float32(2.0) * want_b)
    covered = np.zeros(rows, np.int64)
    for r0, r1, nn, tid in calls:
        assert 0 <= r0 < r1 <= rows and nn == n and 0 <= tid < threads
        assert r0 % 16 == 0  # a unit boundary: the GLU's lanes line up as over the whole row
        covered[r0:r1] += 1
    assert (covered == 1).all()


def test_pair_rejects_different_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    a = ("Q8_0", _weights("Q8_0", 32, 256, rng), 32, None)
    b = ("Q8_0", _weights("Q8_0", 16, 256, rng), 16, None)
    with pytest.raises(ValueError, match="same rows"):
        K.matmul_pair_calls(a, b, 256, x, threads=2)
