"""Attention kernels (ktd._native.attention): every ISA the machine runs against the scalar
reference and against an independent float64 numpy softmax attention; the forward's attention
against the thread count.

Bounds: the kernels read F16 keys/values (the numpy reference uses the same F16 values, widened
exactly), so the only differences are F32 rounding of the dot products and sums, and the SIMD
exp (Cephes polynomial, ~2 ulp): measured max |kernel - numpy| / max |numpy| 1.2e-6 over
SHAPES (ref and avx2 alike); bound 2e-5. Kernel vs reference: same bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from ktd import _native
from ktd.server.engine import Engine

A = _native.attention
ISAS = [i for i in A.kernel_isas() if _native.kernels.isa_supported(i)]
SIMD_ISAS = [i for i in ISAS if i != "ref"]
TOL = 2e-5


def _numpy_attention(q, k16, v16, lo, hi, head_kv):
    """softmax(q · k^T) v per query row and group head over keys [lo, hi), in float64."""
    k = k16.view(np.float16).astype(np.float64)[:, head_kv]  # [n_keys, hd_k]
    v = v16.view(np.float16).astype(np.float64)[:, head_kv]
    out = np.empty((q.shape[0], q.shape[1], v.shape[1]))
    for r in range(q.shape[0]):
        s = q[r].astype(np.float64) @ k[lo[r]:hi[r]].T  # [n_group, n_keys_r]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[r] = (p / p.sum(axis=1, keepdims=True)) @ v[lo[r]:hi[r]]
    return out


def _case(n_rows, n_group, hdk, hdv, n_keys, n_kv=2, window=0, seed=0, scale=1.0):
    """Causal prefill rows: the last n_rows positions of n_keys, optionally a sliding window."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((n_rows, n_group, hdk)) * scale / np.sqrt(hdk)).astype(np.float32)
    k = rng.standard_normal((n_keys, n_kv, hdk)).astype(np.float16).view(np.uint16)
    v = rng.standard_normal((n_keys, n_kv, hdv)).astype(np.float16).view(np.uint16)
    hi = np.arange(n_keys - n_rows + 1, n_keys + 1, dtype=np.int64)
    lo = np.maximum(0, hi - window) if window else np.zeros(n_rows, np.int64)
    return q, k, v, lo, hi


def _rel(a, ref):
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.max(np.abs(a - ref)) / max(1e-30, np.max(np.abs(ref))))


SHAPES = [  # (n_rows, n_group, hd_k, hd_v, n_keys, window)
    (1, 1, 64, 64, 1, 0),
    (1, 7, 64, 64, 17, 0),
    (3, 7, 64, 64, 65, 0),
    (9, 7, 64, 64, 200, 0),
    (8, 8, 128, 128, 129, 0),
    (5, 8, 128, 128, 1000, 0),
    (2, 1, 256, 256, 333, 0),
    (64, 1, 256, 256, 127, 0),
    (4, 2, 72, 40, 300, 0),    # head dims multiples of 8 but not of 64; hd_k != hd_v
    (6, 3, 20, 12, 90, 0),     # not multiples of 8: the SIMD kernels hand over to the reference
    (7, 7, 64, 64, 1000, 100), # sliding window inside a tile and across tile boundaries
    (16, 4, 64, 64, 257, 64),
    (9, 8, 128, 128, 70, 1),   # window of 1: each query sees only itself
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "r{}g{}k{}v{}n{}w{}".format(*s))
def test_attention_matches_numpy_and_reference(isa, shape):
    n_rows, n_group, hdk, hdv, n_keys, window = shape
    q, k, v, lo, hi = _case(n_rows, n_group, hdk, hdv, n_keys, window=window, seed=n_keys)
    for head_kv in (0, 1):
        out = A.attend(q, k, v, lo, hi, head_kv=head_kv, isa=isa)
        assert out.shape == (n_rows, n_group, hdv)
        ref_np = _numpy_attention(q, k, v, lo, hi, head_kv)
        assert _rel(out, ref_np) < TOL, f"{isa} vs numpy"
        if isa != "ref":
            assert _rel(out, A.attend(q, k, v, lo, hi, head_kv=head_kv, isa="ref")) < TOL, f"{isa} vs ref"


def _numpy_latent_attention(q, k16, lo, hi, latent_v):
    """MLA: one latent head; the values are the first latent_v entries of each key row."""
    return _numpy_attention(q, k16, k16[:, :, :latent_v], lo, hi, 0)


LATENT_SHAPES = [  # (n_rows, n_head, kv_lora_rank + rope, kv_lora_rank, n_keys)
    (4, 16, 576, 512, 300),  # DeepSeek-V2/V3: 4 rows × 16 heads per block
    (1, 16, 576, 512, 1),
    (3, 5, 80, 64, 130),
    (2, 3, 20, 12, 70),      # not multiples of 8: the SIMD kernels hand over to the reference
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", LATENT_SHAPES, ids=lambda s: "r{}h{}k{}v{}n{}".format(*s))
def test_latent_values_match_numpy_and_reference(isa, shape):
    """MLA's latent cache: v is None, the kernel reads the values from the key rows (the SIMD
    kernels from the converted K tile)."""
    n_rows, n_head, hdk, hdv, n_keys = shape
    q, k, _, lo, hi = _case(n_rows, n_head, hdk, 8, n_keys, n_kv=1, seed=n_keys + 1)
    out = A.attend(q, k, None, lo, hi, latent_v=hdv, isa=isa)
    assert out.shape == (n_rows, n_head, hdv)
    assert _rel(out, _numpy_latent_attention(q, k, lo, hi, hdv)) < TOL, f"{isa} vs numpy"
    # the same values passed as a separate V cache give the same bits
    v = np.ascontiguousarray(k[:, :, :hdv])
    np.testing.assert_array_equal(A.attend(q, k, v, lo, hi, isa=isa), out)


SPLIT_SHAPES = [  # (n_rows, n_group, hd_k, hd_v, n_keys, window, split_keys)
    (1, 7, 64, 64, 4000, 0, 256),  # Qwen2.5-0.5B's group over a 4k context
    (2, 8, 128, 128, 1500, 0, 256),
    (3, 4, 64, 64, 1000, 300, 256),  # a window whose start is not on a range boundary
    (1, 16, 576, 512, 700, 0, 64),   # MLA shape (latent values), ranges of one tile
    (1, 2, 64, 64, 300, 0, 1),       # one key per range
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "r{}g{}k{}v{}n{}w{}s{}".format(*s))
def test_split_keys_merge_matches_numpy_and_unsplit(isa, shape):
    """Decode over a long context: a row's keys in ranges computed apart, merged (attn_merge).
    Not bitwise equal to one range (the merge reassociates the sums): bound TOL against both
    numpy and the unsplit kernel; measured <= 1.1e-6 vs numpy (closer than one range: shorter
    running sums) and <= 2.1e-6 vs unsplit."""
    n_rows, n_group, hdk, hdv, n_keys, window, split = shape
    latent = hdk == 576
    q, k, v, lo, hi = _case(n_rows, n_group, hdk, hdv, n_keys, n_kv=1 if latent else 2, window=window,
                            seed=n_keys + 2)
    if latent:
        out = A.attend(q, k, None, lo, hi, latent_v=hdv, isa=isa, split_keys=split)
        whole = A.attend(q, k, None, lo, hi, latent_v=hdv, isa=isa)
        ref_np = _numpy_latent_attention(q, k, lo, hi, hdv)
    else:
        out = A.attend(q, k, v, lo, hi, isa=isa, split_keys=split)
        whole = A.attend(q, k, v, lo, hi, isa=isa)
        ref_np = _numpy_attention(q, k, v, lo, hi, 0)
    assert _rel(out, ref_np) < TOL, f"{isa} split vs numpy"
    assert _rel(out, whole) < TOL, f"{isa} split vs unsplit"


@pytest.mark.parametrize("isa", ISAS)
def test_split_keys_with_peaked_scores(isa):
    """Ranges whose maxima differ by ~100: the merge rescales by exp(m_c - M) without overflow."""
    q, k, v, lo, hi = _case(1, 7, 64, 64, 900, seed=4, scale=60.0)
    out = A.attend(q, k, v, lo, hi, isa=isa, split_keys=128)
    assert _rel(out, _numpy_attention(q, k, v, lo, hi, 0)) < TOL


@pytest.mark.parametrize("isa", ISAS)
def test_large_scores_stay_finite(isa):
    """Peaked softmax (scores ~ ±100): the running-max rescaling must keep exp in range."""
    q, k, v, lo, hi = _case(5, 7, 64, 64, 300, seed=3, scale=60.0)
    out = A.attend(q, k, v, lo, hi, isa=isa)
    assert _rel(out, _numpy_attention(q, k, v, lo, hi, 0)) < TOL


@pytest.mark.parametrize("isa", ISAS)
def test_rows_are_independent_of_their_block(isa):
    """A query's result depends only on its own key range: computing rows one at a time or in any
    block gives the same bits (this is what makes the forward independent of the thread count)."""
    q, k, v, lo, hi = _case(13, 7, 64, 64, 150, seed=5, window=90)
    whole = A.attend(q, k, v, lo, hi, isa=isa)
    for r0, r1 in ((0, 1), (3, 4), (12, 13), (2, 9), (5, 13)):
        part = A.attend(q[r0:r1], k, v, lo[r0:r1], hi[r0:r1], isa=isa)
        np.testing.assert_array_equal(part, whole[r0:r1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(3, 7, 64, 64, 150, 90), (1, 16, 576, 512, 77, 0), (2, 6, 128, 128, 70, 0)],
                         ids=lambda s: "r{}g{}k{}v{}n{}w{}".format(*s))
def test_heads_are_independent_of_their_block(isa, shape):
    """The SIMD kernels compute a row's query heads several at a time: each head's result is the
    same bits as when it is the group's only head (and so does not depend on the group size)."""
    n_rows, n_group, hdk, hdv, n_keys, window = shape
    latent = hdk == 576
    q, k, v, lo, hi = _case(n_rows, n_group, hdk, hdv, n_keys, n_kv=1, window=window, seed=6)
    v, kw = (None, {"latent_v": hdv}) if latent else (v, {})
    whole = A.attend(q, k, v, lo, hi, isa=isa, **kw)
    for g in range(n_group):
        alone = A.attend(np.ascontiguousarray(q[:, g:g + 1]), k, v, lo, hi, isa=isa, **kw)
        np.testing.assert_array_equal(alone[:, 0], whole[:, g])


def _before_a_guard_page(a: np.ndarray):
    """A copy of `a` whose last byte is the last one before an inaccessible page (PROT_NONE):
    a kernel that reads past the end of the cache rows it was given crashes instead of passing."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    size = -(-a.nbytes // page) * page
    m = mmap.mmap(-1, size + page)
    buf = np.frombuffer(m, np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(buf.ctypes.data + size, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    out = buf[size - a.nbytes:size].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_keys", [2, 5, 13, 66, 131])
def test_kernels_read_no_key_past_the_last(isa, n_keys):
    """The SIMD kernels read the keys straight from the cache, 8 (AVX2) or 4 (NEON) at a time:
    the group that holds the last key must come from a padded copy, never from the rows after it
    (which need not exist). K and V end right before a PROT_NONE page; the results match numpy."""
    q, k, v, lo, hi = _case(2, 5, 64, 40, n_keys, n_kv=1, seed=n_keys)
    k, v = _before_a_guard_page(k), _before_a_guard_page(v)
    out = A.attend(q, k, v, lo, hi, isa=isa)
    assert _rel(out, _numpy_attention(q, k, v, lo, hi, 0)) < TOL
    q, k, _, lo, hi = _case(1, 16, 576, 8, n_keys, n_kv=1, seed=n_keys)
    k = _before_a_guard_page(k)
    out = A.attend(q, k, None, lo, hi, latent_v=512, isa=isa, split_keys=64)
    assert _rel(out, _numpy_latent_attention(q, k, lo, hi, 512)) < TOL


@pytest.mark.parametrize("isa", SIMD_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason="this machine runs no SIMD attention kernel"))])
def test_simd_kernel_registered(isa):
    q, k, v, lo, hi = _case(2, 2, 64, 64, 10)
    A.attend(q, k, v, lo, hi, isa=isa)  # raises if not registered


@pytest.mark.parametrize("kw, match", [
    (dict(lo=np.array([0, 5]), hi=np.array([4, 5])), "lo < hi"),
    (dict(lo=np.array([0, 0]), hi=np.array([4, 11])), "hi <= n_keys"),
    (dict(lo=np.array([-1, 0]), hi=np.array([4, 4])), "0 <= lo"),
    (dict(lo=np.array([0]), hi=np.array([4])), "one entry per query row"),
    (dict(head_kv=2), "head_kv out of range"),
    (dict(isa="sse9"), "unknown ISA"),
    (dict(split_keys=-1), "split_keys"),
    (dict(latent_v=8), "either v or latent_v"),
])
def test_bad_arguments_are_rejected(kw, match):
    q, k, v, lo, hi = _case(2, 3, 16, 16, 10)
    args = dict(lo=lo, hi=hi)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        A.attend(q, k, v, **args)


def test_bad_shapes_are_rejected():
    q, k, v, lo, hi = _case(2, 3, 16, 16, 10)
    with pytest.raises(ValueError, match="3-D"):
        A.attend(q[0], k, v, lo, hi)
    with pytest.raises(ValueError, match="head_dim_k"):
        A.attend(q, k[:, :, :8], v, lo, hi)


@pytest.fixture(scope="module")
def tiny_models(tiny_model):
    """llama "mistral" (8 query heads over 2 KV heads) and gemma3 (4 over 1, sliding-window layers)."""
    return [tiny_model(arch, variant=variant) for arch, variant in (("llama", "mistral"), ("gemma3", None))]


def test_decode_over_long_context_splits_keys(tiny_models):
    """Decode steps at positions 600-609 (one row: its keys are split into 256-key ranges and
    merged) against the same rows computed in one prefill (one range each)."""
    for path in tiny_models:
        e = Engine.open(path, n_ctx=640, threads=2, pin=False, n_batch=512)
        toks = np.random.default_rng(1).integers(3, e.n_vocab, size=610)
        full = e.forward(toks, np.arange(610), np.zeros(610), np.ones(610, bool))[600:]
        e.free_seq(0)
        e.forward(toks[:600], np.arange(600), np.zeros(600), np.zeros(600, bool))
        steps = np.concatenate([e.forward(toks[p:p + 1], np.array([p]), np.zeros(1), np.ones(1, bool))
                                for p in range(600, 610)])
        assert np.max(np.abs(steps - full)) / np.max(np.abs(full)) < 1e-4


@pytest.mark.parametrize("n_batch", [512, 37])
def test_forward_is_identical_for_1_2_3_threads(tiny_models, n_batch):
    """Prefill of 300 tokens (blocks of rows of very different cost, handed out dynamically) and
    a decode step after it: the same bits whatever the thread count."""
    for path in tiny_models:
        results = []
        for threads in (1, 2, 3):
            e = Engine.open(path, n_ctx=320, threads=threads, pin=False, n_batch=n_batch)
            toks = np.random.default_rng(0).integers(3, e.n_vocab, size=300)
            n = len(toks)
            pre = e.forward(toks, np.arange(n), np.zeros(n), np.ones(n, bool))
            dec = e.forward(np.array([5]), np.array([n]), np.zeros(1), np.ones(1, bool))
            results.append((pre, dec))
        for pre, dec in results[1:]:
            np.testing.assert_array_equal(pre, results[0][0])
            np.testing.assert_array_equal(dec, results[0][1])
