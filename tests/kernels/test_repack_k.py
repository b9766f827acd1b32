"""The K-quants' 8-row interleaved ("repacked") layouts (native/src/kernels/repacked_k.h):
repack + gemm_repacked of every ISA this machine runs, against

- an independent numpy decoder of the layout, written from the header's description, compared
  with gguf-py's dequantization of the original rows (the layout holds the same weights);
- the plain (unrepacked) kernels and the scalar reference: the reference's repacked tile does
  the same integer sums and float operations as its plain tile, so the two agree bitwise; other
  ISAs use the same quantized activations (bitwise, tested in test_kernels_k.py) and differ only
  in float32 summation order, |y − y_ref| ≤ 1e-5 · Σ|w||x|;
- gguf-py dequantize + float64 matmul, with the Q8_K activation-quantization bound of
  test_kernels_k.py (|y − y_exact| ≤ Σ_blocks amax/254 · Σ|w| + 1e-5 · Σ|w||x|).
"""

from __future__ import annotations

import os
import platform

import numpy as np
import pytest

from kernel_checks import ISAS, exact_and_bound
from kernel_inputs import random_k_weights as random_weights
from kernel_oracle import dequantize_ref
from ktd import _native

K = _native.kernels
QK_K = 256
R = 8  # rows per group
TYPES = ["Q4_K", "Q6_K"]
GROUP_BLOCK = {"Q4_K": 8 * 144, "Q6_K": 8 * 210}


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)


def decode_q4_Kx8(blk: np.ndarray) -> np.ndarray:
    """One group block (1152 bytes) → float64 [8 rows, 256]."""
    d, dmin = f16(blk[0:16]), f16(blk[16:32])
    scl, mnl, sh = (blk[32:64].astype(np.int64), blk[64:96].astype(np.int64), blk[96:128].astype(np.int64))
    sc = np.concatenate([(scl & 15) | ((sh & 3) << 4), (scl >> 4) | (((sh >> 2) & 3) << 4)])  # index 8j + r
    mn = np.concatenate([(mnl & 15) | (((sh >> 4) & 3) << 4), (mnl >> 4) | (((sh >> 6) & 3) << 4)])
    sc, mn = sc.reshape(8, R).T, mn.reshape(8, R).T  # [r, j]
    qs = blk[128:].reshape(8, 4, R, 4).astype(np.int64)  # [j, i, r, t]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)  # [j, 8 registers, r, t]: element 4·reg + t
    q = q.transpose(2, 0, 1, 3).reshape(R, 8, 32)  # [r, j, e]
    w = d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * mn[:, :, None]
    return w.reshape(R, QK_K)


def decode_q6_Kx8(blk: np.ndarray) -> np.ndarray:
    """One group block (1680 bytes: d, then 8 chunks of 208 bytes) → float64 [8 rows, 256]."""
    d = f16(blk[0:16])
    ch = blk[16:].reshape(8, 208)  # [s, chunk bytes]
    sc = ch[:, 0:16].view(np.int8).astype(np.int64).reshape(8, R, 2).transpose(1, 0, 2).reshape(R, 16)
    b = ch[:, 16:208].reshape(8, 2, 3, R, 4).astype(np.int64)  # [s, h, j, r, t]
    top = sum(((b[:, :, j] >> 6) & 3) << (2 * j) for j in range(3))  # register 3: [s, h, r, t]
    q = np.concatenate([b & 63, top[:, :, None]], axis=2)  # [s, h, register, r, t]: element 4·reg + t
    q = q.transpose(3, 0, 1, 2, 4).reshape(R, QK_K) - 32
    return d[:, None] * np.repeat(sc, 16, axis=1) * q


DECODE = {"Q4_K": decode_q4_Kx8, "Q6_K": decode_q6_Kx8}


def decode_repacked(qt: str, wp: np.ndarray, rows: int, k: int) -> np.ndarray:
    nb, groups = k // QK_K, (rows + R - 1) // R
    blocks = wp.reshape(groups, nb, GROUP_BLOCK[qt])
    out = np.zeros((groups * R, k))
    for g in range(groups):
        for b in range(nb):
            out[g * R:(g + 1) * R, b * QK_K:(b + 1) * QK_K] = DECODE[qt](blocks[g, b])
    return out


def check_against_oracles(qt, isa, w, wp, rows, k, x, threads=1):
    y = K.matmul_repacked(qt, wp, rows, k, x, isa=isa, threads=threads)
    assert y.shape == (x.shape[0], rows) and np.isfinite(y).all()
    exact, bound, mag = exact_and_bound(qt, w, rows, k, x)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound + 1e-5 * mag + 1e-30).all(), f"max excess {np.max(err - bound - 1e-5 * mag)}"
    y_ref = K.matmul(qt, w, rows, k, x, isa="ref")
    if isa == "ref":
        np.testing.assert_array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    else:
        assert (np.abs(y.astype(np.float64) - y_ref) <= 1e-5 * mag + 1e-30).all()
        y_plain = K.matmul(qt, w, rows, k, x, isa=isa, threads=threads)
        assert (np.abs(y.astype(np.float64) - y_plain) <= 1e-5 * mag + 1e-30).all()
    return y


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_layout_present_and_versioned(qt, isa):
    assert K.repack_rows(qt, isa=isa) == R
    assert K.repack_layout(qt, isa=isa) >= 1
    # Every ISA shares the reference's layout (one repack, one version).
    assert K.repack_layout(qt, isa=isa) == K.repack_layout(qt, isa="ref")


@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k", [(1, 256), (3, 512), (8, 256), (17, 768)])
def test_layout_decodes_to_gguf_weights(qt, rows, k):
    rng = np.random.default_rng(rows * 13 + k)
    w = random_weights(qt, rows, k, rng)
    wp = K.repack(qt, w, rows, k, isa="ref")
    assert wp.size == (rows + R - 1) // R * (k // QK_K) * GROUP_BLOCK[qt]
    got = decode_repacked(qt, wp, rows, k)
    want = dequantize_ref(qt, w, rows, k)
    np.testing.assert_allclose(got[:rows], want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert (got[rows:] == 0).all()  # the padding rows of the last group


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_repack_same_bytes_on_every_isa_and_thread_count(qt, isa):
    rng = np.random.default_rng(5)
    rows, k = 43, 1280
    w = random_weights(qt, rows, k, rng)
    want = K.repack(qt, w, rows, k, isa="ref", threads=1)
    for threads in (1, 2, 3):
        np.testing.assert_array_equal(K.repack(qt, w, rows, k, isa=isa, threads=threads), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k", [(1, 256), (2, 256), (7, 512), (8, 768), (9, 256), (15, 1024), (23, 256),
                                    (64, 512), (71, 2304)])
def test_simd_repack_is_the_reference_bitwise_on_odd_shapes(qt, isa, rows, k):
    """The AVX2 repacks (kernels/avx2/repack_k.cpp, also the AVX-512 entries') against the scalar
    reference: every byte, partial last groups (rows not a multiple of 8, whose missing rows must
    be zero) and the pool's group ranges (threads) included; blocks with extreme values (all bits
    set, all clear) among random ones."""
    rng = np.random.default_rng(rows * 7 + k)
    w = random_weights(qt, rows, k, rng)
    raw = w.reshape(-1)
    n = raw.size // 4
    raw[:n // 2] = 0xFF  # whole blocks of set bits (scales, values; d becomes NaN, copied as bits)
    raw[n // 2:n] = 0
    want = K.repack(qt, w, rows, k, isa="ref", threads=1)
    for threads in (1, 3):
        np.testing.assert_array_equal(K.repack(qt, w, rows, k, isa=isa, threads=threads), want)


SHAPES = [(1, 256, 1), (3, 512, 2), (7, 256, 5), (17, 1280, 3), (33, 768, 9), (129, 512, 1), (16, 256, 64),
          (9, 2304, 4), (24, 512, 7), (40, 256, 8), (5, 256, 6),
          # MoE expert shapes: Qwen3-30B-A3B gate/up (768 x 2048) and down (2048 x 768, here one
          # group short of 8-aligned), DeepSeek-V2-Lite gate/up (1408 x 2048); decode and a few streams.
          (768, 2048, 1), (2044, 768, 2), (1403, 2048, 8)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_repacked_matmul(qt, isa, rows, k, n):
    rng = np.random.default_rng(rows * 7919 + k * 31 + n)
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    wp = K.repack(qt, w, rows, k, isa=isa)
    check_against_oracles(qt, isa, w, wp, rows, k, x)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_repacked_threads_bitwise_and_guards(qt, isa):
    rng = np.random.default_rng(8)
    rows, k, n = 77, 512, 6
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    wp = K.repack(qt, w, rows, k, isa=isa, threads=2)
    sentinel = np.float32(-1234.5)
    results = []
    for threads in (1, 2, 3):
        offset, guard = 37, 53
        out = np.full(offset + n * rows + guard, sentinel, dtype=np.float32)
        K.matmul_into(qt, wp, rows, k, x, out, offset, isa=isa, threads=threads, repacked=True)
        assert (out[:offset] == sentinel).all() and (out[offset + n * rows:] == sentinel).all()
        results.append(out[offset:offset + n * rows].copy())
    for y in results[1:]:
        np.testing.assert_array_equal(y.view(np.uint32), results[0].view(np.uint32))
    y = results[0].reshape(n, rows)
    assert np.isfinite(y).all()
    exact, bound, mag = exact_and_bound(qt, w, rows, k, x)
    assert (np.abs(y.astype(np.float64) - exact) <= bound + 1e-5 * mag + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_repacked_special_inputs(qt, isa):
    """Zero activations give exact zeros; an Inf weight scale reaches only its row (lane); a NaN
    activation only its column."""
    rng = np.random.default_rng(3)
    rows, k = 12, 512
    w = random_weights(qt, rows, k, rng)
    wp = K.repack(qt, w, rows, k, isa=isa)
    assert (K.matmul_repacked(qt, wp, rows, k, np.zeros((2, k), np.float32), isa=isa) == 0).all()
    d_off = {"Q4_K": 0, "Q6_K": 208}[qt]
    w[2, d_off:d_off + 2] = np.array([np.inf], np.float16).view(np.uint8)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 300] = np.nan
    y = K.matmul_repacked(qt, K.repack(qt, w, rows, k, isa=isa), rows, k, x, isa=isa)
    ok_rows = [r for r in range(rows) if r != 2]
    assert np.isfinite(y[np.ix_([0, 2], ok_rows)]).all()
    assert not np.isfinite(y[:, 2]).any()
    assert not np.isfinite(y[1]).any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_prepared_weights_repack(qt, isa):
    rng = np.random.default_rng(9)
    rows, k, n = 41, 512, 3
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    y, repacked = K.matmul_prepared(qt, w, rows, k, x, isa=isa, threads=2)
    assert repacked
    want = K.matmul_repacked(qt, K.repack(qt, w, rows, k, isa=isa), rows, k, x, isa=isa)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def test_default_dispatch_prefers_avx512():
    """Without KTD_ISA the default (AVX2) ISA hands Q4_K/Q6_K to their AVX-512 kernels where the
    CPU has them. The plain (unrepacked) kernels of the two ISAs sum floats in different orders,
    so the default's result is compared bitwise with each ISA's."""
    if os.environ.get("KTD_ISA"):
        pytest.skip("KTD_ISA fixes the ISA for every type")
    if K.active_isa() != "avx2":
        pytest.skip(f"the active ISA is {K.active_isa()}, not the AVX2 default")
    if not (K.isa_compiled("avx512") and K.isa_supported("avx512")):
        pytest.skip("no AVX-512 in this build or on this CPU: the AVX2 kernels stay the default")
    rng = np.random.default_rng(11)
    rows, k = 40, 1024
    for qt in TYPES:
        w = random_weights(qt, rows, k, rng)
        x = rng.standard_normal((3, k)).astype(np.float32)
        y = K.matmul(qt, w, rows, k, x)
        np.testing.assert_array_equal(y.view(np.uint32), K.matmul(qt, w, rows, k, x, isa="avx512").view(np.uint32))
    # Other types keep the active ISA's kernels.
    w = random_weights("Q5_K", rows, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_array_equal(K.matmul("Q5_K", w, rows, k, x).view(np.uint32),
                                  K.matmul("Q5_K", w, rows, k, x, isa="avx2").view(np.uint32))


def test_repacked_bad_sizes_rejected():
    rng = np.random.default_rng(1)
    w = random_weights("Q4_K", 3, 512, rng)
    wp = K.repack("Q4_K", w, 3, 512)
    with pytest.raises(ValueError):
        K.matmul_repacked("Q4_K", wp[:-1].copy(), 3, 512, np.zeros((1, 512), np.float32))
    with pytest.raises(ValueError):
        K.matmul_repacked("Q4_K", wp, 9, 512, np.zeros((1, 512), np.float32))  # 2 groups, 1 given
    with pytest.raises(ValueError):
        K.repack("Q6_K", w, 3, 512)  # Q4_K-sized rows


# Qwen2.5 FFN matrices (rows, k) whose k is a whole number of 256-blocks: 0.5B ffn_down, 1.5B
# ffn_down and ffn_up (the 0.5B model's k = 896 matrices cannot be K-quants).
REAL_SHAPES = [(896, 4864), (1536, 8960), (8960, 1536)]
# MoE experts: Qwen3-30B-A3B down (2048 x 768), DeepSeek-V2-Lite gate/up (1408 x 2048).
REAL_SHAPES += [(2048, 768), (1408, 2048)]


@pytest.mark.slow
@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("rows,k", REAL_SHAPES)
def test_real_model_shapes(qt, rows, k):
    rng = np.random.default_rng(rows + k)
    w = random_weights(qt, rows, k, rng)
    x = rng.standard_normal((4, k)).astype(np.float32)
    for isa in ISAS:
        wp = K.repack(qt, w, rows, k, isa=isa, threads=2)
        y2 = check_against_oracles(qt, isa, w, wp, rows, k, x, threads=2)
        np.testing.assert_array_equal(y2, K.matmul_repacked(qt, wp, rows, k, x, isa=isa, threads=1))
        y1 = K.matmul_repacked(qt, wp, rows, k, x[:1], isa=isa, threads=2)  # the GEMV path (n = 1)
        assert (np.abs(y1 - y2[:1]) <= 1e-5 * np.abs(y2[:1]) + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qt", TYPES)
def test_decode_prefetch_changes_no_bits(qt, isa, restore_decode_prefetch):
    """The decode GEMV (n = 1) in every software prefetch mode (k_decode_prefetch: off, l1, l2):
    the same sums in the same order, so the same bits, and all within the oracles' bounds. The
    same for prefill (n > 1), whose first column tile of each chunk prefetches in the mode: n = 5
    and 9 are a prefetching tile and untouched ones, (768, 2048) spans several chunks."""
    rng = np.random.default_rng(21)
    for rows, k in [(1, 256), (9, 512), (768, 2048), (77, 1280)]:
        w = random_weights(qt, rows, k, rng)
        wp = K.repack(qt, w, rows, k, isa=isa)
        x1 = rng.standard_normal((1, k)).astype(np.float32)
        x5 = rng.standard_normal((5, k)).astype(np.float32)
        x9 = rng.standard_normal((9, k)).astype(np.float32)
        got = {}
        for mode in (1, 2, 0):
            K.set_decode_prefetch(mode)
            assert K.decode_prefetch() == mode
            got[mode] = (check_against_oracles(qt, isa, w, wp, rows, k, x1, threads=2),
                         check_against_oracles(qt, isa, w, wp, rows, k, x5, threads=2),
                         K.matmul_repacked(qt, wp, rows, k, x9, isa=isa, threads=1))
        for mode in (1, 2):
            for a, b in zip(got[mode], got[0]):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_decode_prefetch_default_and_override(restore_decode_prefetch):
    """The CPU default (off on AMD Zen 4 and later: family 25 with AVX-512F, or above; l2 on
    Intel; l1 elsewhere), KTD_DECODE_PREFETCH=0|1|2 or off|l1|l2 read at first use, and a clear error for
    anything else."""
    import subprocess
    import sys

    f = _native.cpu_features()
    zen4_or_later = f.vendor == "AuthenticAMD" and (f.family > 25 or (f.family == 25 and f.avx512f))
    assert K.decode_prefetch_default() == (0 if zen4_or_later else 2 if f.vendor == "GenuineIntel" else 1)
    assert K.decode_prefetch_modes() == ["off", "l1", "l2"]
    K.set_decode_prefetch(-1)
    assert K.decode_prefetch() == K.decode_prefetch_default()
    for bad_mode in (3, -2):
        with pytest.raises(ValueError, match=r"expected a mode 0 \(off\), 1 \(l1\), 2 \(l2\) or -1"):
            K.set_decode_prefetch(bad_mode)
    probe = "from ktd import _native; print(_native.kernels.decode_prefetch())"
    for value, want in (("0", "0"), ("1", "1"), ("2", "2"), ("off", "0"), ("l1", "1"), ("l2", "2")):
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "KTD_DECODE_PREFETCH": value},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == want
    # A bad value is reported where the kernels are chosen (active_isa, at the model load).
    for code in (probe, "from ktd import _native; _native.kernels.active_isa()"):
        bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KTD_DECODE_PREFETCH": "yes"},
                             capture_output=True, text=True)
        assert bad.returncode != 0 and "KTD_DECODE_PREFETCH=yes: expected 0|1|2 or off|l1|l2" in bad.stderr


X86_ONLY = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                              reason="only the x86 kernels read the decode prefetch: it is not tuned elsewhere")


def _tune(step_ms: dict[int, float]) -> dict:
    """Feeds the tuning one-row steps that took step_ms[setting] ms, as Context::forward would,
    until it ends; its final state."""
    for _ in range(100):
        s = K.decode_prefetch_tune_begin()
        if s < 0:
            break
        K.decode_prefetch_tune_step(s, int(step_ms[s] * 1e6))
    return K.decode_prefetch_state()


@X86_ONLY
def test_decode_prefetch_tuning_keeps_the_faster(restore_decode_prefetch):
    """Unless fixed, the first one-row steps take the modes in turn (off, l1, l2), and after 9 of
    each the fastest stays if its median step is more than 5% faster than the default's; a
    smaller gain keeps the CPU default; a fixed mode (set_decode_prefetch) is never tuned."""
    default = K.decode_prefetch_default()
    K.set_decode_prefetch(-1)
    assert K.decode_prefetch_state()["source"] == "default"
    seen = []
    for _ in range(4):
        seen.append(K.decode_prefetch_tune_begin())
        assert K.decode_prefetch_state()["source"] == "tuning"
        K.decode_prefetch_tune_step(seen[-1], 2_000_000)
    assert seen == [0, 1, 2, 0]
    for best in (0, 1, 2):
        if best == default:
            continue
        K.set_decode_prefetch(-1)
        ms = {m: 2.0 for m in range(3)}
        ms[best] = 1.5                                          # that mode 25% faster
        ms[3 - best - default] = 1.7                            # the third one faster than the default too
        st = _tune(ms)
        assert st["source"] == "tuned" and st["mode"] == best and K.decode_prefetch() == best
        assert st["name"] == ["off", "l1", "l2"][best]
        assert st["median_ms"][best] == pytest.approx(1.5) and st["median_ms"][default] == pytest.approx(2.0)
        assert K.decode_prefetch_tune_begin() == -1             # tuned: no more alternation
    K.set_decode_prefetch(-1)                                   # back to the default: tuned again
    st = _tune({m: (2.0 if m == default else 1.94) for m in range(3)})  # 3%: inside the margin
    assert st["source"] == "tuned" and st["mode"] == default
    other = 2 if default != 2 else 0
    K.set_decode_prefetch(other)
    assert K.decode_prefetch_tune_begin() == -1 and K.decode_prefetch_state()["source"] == "set"
    assert K.decode_prefetch() == other


@X86_ONLY
def test_one_row_forwards_tune_the_decode_prefetch(tmp_path, restore_decode_prefetch):
    """Context::forward: a prompt (several rows) does not tune; 27 one-row steps do, and the
    logits are those of a fixed mode (the sums are the same in every mode)."""
    from models import tiny_dense
    from ktd.server.engine import Engine

    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")

    def run() -> np.ndarray:
        eng = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=1)
        out = [eng.forward(np.arange(4) + 40, np.arange(4), np.zeros(4), np.ones(4, bool))]
        for i in range(3 * 9):
            out.append(eng.forward(np.array([50 + i]), np.array([4 + i]), np.zeros(1), np.ones(1, bool)))
        return np.concatenate(out)

    K.set_decode_prefetch(-1)
    tuned = run()
    st = K.decode_prefetch_state()
    assert st["source"] == "tuned" and all(ms > 0 for ms in st["median_ms"])
    K.set_decode_prefetch(0)
    np.testing.assert_array_equal(run().view(np.uint32), tuned.view(np.uint32))
