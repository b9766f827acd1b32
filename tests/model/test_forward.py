"""The native forward on tiny random models: against the independent numpy reference, consistency
of batching / slots, and load-time errors.

Bounds: F32 weights are used exactly (F32 activations), so the only difference from the float64
numpy forward is F32 arithmetic and the F16 KV cache (relative rounding 2^-11 on K and V).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from gguf_samples import rewrite_gguf
from ktd import _native
from ktd.server.engine import Engine
from ktd.errors import ContextOverflow
from models.tiny_dense import VARIANTS
from reference.numpy_forward import forward as numpy_forward

SUPPORTED = ["llama", "qwen2", "qwen3", "gemma3", "bitnet"]
N_TOKENS = 24
# max |ktd - numpy| / max(1, max |numpy|). Measured: F32 ~1e-3 (F16 KV cache dominates).
TOL_F32 = 5e-3
# Quantized weights: ktd quantizes activations to Q8_0 like llama.cpp does (test_reference_forward's
# measured 1.1-2.9e-2 for llama.cpp on the same files).
TOL_Q = 6e-2
# Same model, same tokens, different batch shapes: the kernels' GEMV (1 row) and GEMM tiles sum in a
# different order, so F32 rounding differs slightly (measured max 3e-4 on logits of magnitude ~3).
ATOL_BATCHING = 1e-3


def _tokens(n_vocab: int, n: int = N_TOKENS, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, n_vocab, size=n - 1).tolist()


def _open(path, **kw) -> Engine:
    kw.setdefault("n_ctx", 64)
    return Engine.open(path, threads=2, pin=False, **kw)


def _prefill(e: Engine, toks, seq: int = 0, start: int = 0) -> np.ndarray:
    n = len(toks)
    return e.forward(np.array(toks), np.arange(start, start + n), np.full(n, seq), np.ones(n, bool))


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a - ref)) / max(1.0, float(np.max(np.abs(ref)))))


@pytest.mark.parametrize("arch,variant", [(a, v) for a in SUPPORTED for v in VARIANTS[a]],
                         ids=lambda v: "default" if v is None else str(v))
def test_logits_match_numpy_reference_f32(tiny_model, arch, variant):
    path = tiny_model(arch, variant=variant)
    e = _open(path)
    toks = _tokens(e.n_vocab)
    ref = numpy_forward(path, toks)
    got = _prefill(e, toks)
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    err = _rel_err(got, ref)
    assert err < TOL_F32, f"{arch}/{variant}: rel err {err:.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("arch,wtype", [(a, t) for a in SUPPORTED for t in ("F16", "Q8_0", "Q4_0")]
                         + [("bitnet", "TQ2_0"), ("bitnet", "TQ1_0")])
def test_logits_match_numpy_reference_quantized(tiny_model, arch, wtype):
    path = tiny_model(arch, wtype)
    e = _open(path)
    toks = _tokens(e.n_vocab)
    ref = numpy_forward(path, toks)
    err = _rel_err(_prefill(e, toks), ref)
    assert err < (TOL_F32 if wtype == "F16" else TOL_Q), f"{arch}/{wtype}: rel err {err:.2e}"


def test_prefill_equals_token_by_token_and_mixed_batch(tiny_model):
    path = tiny_model("qwen2")
    toks = _tokens(320)
    all_at_once = _prefill(_open(path), toks)

    e = _open(path, n_seq_max=3)
    one_by_one = np.concatenate([_prefill(e, [t], start=i) for i, t in enumerate(toks)])
    np.testing.assert_allclose(one_by_one, all_at_once, rtol=0, atol=ATOL_BATCHING)

    # Sequences 1 and 2 advance together with different prompts at different positions; seq 2's
    # rows interleave with seq 1's and only some rows want logits.
    e2 = _open(path, n_seq_max=3)
    other = _tokens(320, seed=7)
    _prefill(e2, other[:5], seq=2)
    rows = []
    for i, t in enumerate(toks):
        rows.append((t, i, 1, True))
        if 5 + i < len(other):
            rows.append((other[5 + i], 5 + i, 2, i % 2 == 0))
    tk, pos, seq, want = (np.array(c) for c in zip(*rows))
    out = e2.forward(tk, pos, seq, want)
    np.testing.assert_allclose(out[(seq[want] == 1)], all_at_once, rtol=0, atol=ATOL_BATCHING)


def test_chunked_prefill_equals_one_chunk(tiny_model):
    path = tiny_model("llama")
    toks = _tokens(320, n=40)
    whole = _prefill(_open(path), toks)
    chunked = _prefill(_open(path, n_batch=7), toks)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=ATOL_BATCHING)


def test_freed_slot_leaks_nothing(tiny_model):
    path = tiny_model("qwen3")
    a, b = _tokens(320, seed=3), _tokens(320, n=10, seed=4)
    fresh = _prefill(_open(path), b)
    e = _open(path)
    _prefill(e, a)
    e.free_seq(0)
    assert e.seq_len(0) == 0
    np.testing.assert_array_equal(_prefill(e, b), fresh)


def test_rewinding_a_sequence_discards_its_tail(tiny_model):
    path = tiny_model("qwen2")
    a = _tokens(320, seed=5)
    e = _open(path)
    full = _prefill(e, a)
    again = _prefill(e, a[10:], start=10)  # positions 10.. replace the old tail
    np.testing.assert_allclose(again, full[10:], rtol=0, atol=ATOL_BATCHING)


def test_copy_seq_shares_a_prefix(tiny_model):
    path = tiny_model("qwen2")
    a = _tokens(320, seed=6)
    ref = _prefill(_open(path), a)
    e = _open(path, n_seq_max=2)
    _prefill(e, a[:12], seq=0)
    e.copy_seq(0, 1, 12)
    np.testing.assert_allclose(_prefill(e, a[12:], seq=1, start=12), ref[12:], rtol=0, atol=ATOL_BATCHING)
    with pytest.raises(ValueError, match="exceeds"):
        e.copy_seq(0, 1, 13)


def test_context_overflow_is_typed(tiny_model):
    e = _open(tiny_model("llama"), n_ctx=16)
    _prefill(e, _tokens(320, n=16))
    with pytest.raises(ContextOverflow, match="n_ctx = 16"):
        _prefill(e, [5], start=16)
    assert e.seq_len(0) == 16  # a rejected batch changes nothing


@pytest.mark.parametrize("rows,match", [
    (([1], [0], [3], [True]), "sequence id 3"),
    (([400], [0], [0], [True]), "token id 400"),
    (([1, 2], [0, 2], [0, 0], [True, True]), "consecutive"),
    (([1], [5], [0], [True]), "at most 0"),
])
def test_bad_rows_are_rejected(tiny_model, rows, match):
    e = _open(tiny_model("llama"), n_seq_max=2)
    with pytest.raises(ValueError, match=match):
        e.forward(*(np.array(r) for r in rows))


# ---- load-time errors on edited files ----

_rewrite = rewrite_gguf


def test_unknown_architecture_lists_supported(tiny_model, tmp_path):
    p = _rewrite(tiny_model("llama"), tmp_path / "x.gguf", arch="falcon")
    listed = _native.Model.supported_archs()
    assert set(SUPPORTED) <= set(listed.split(", "))
    with pytest.raises(_native.GGUFError, match=rf"unsupported architecture 'falcon' \(supported: {re.escape(listed)}\)"):
        _native.Model(str(p), n_threads=1, pin=False)


def test_copy_without_edits_loads(tiny_model, tmp_path):
    """Control for the edit tests: the rewrite itself keeps a loadable, equal model."""
    src = tiny_model("qwen2")
    p = _rewrite(src, tmp_path / "same.gguf")
    toks = _tokens(320, n=5)
    np.testing.assert_array_equal(_prefill(_open(p), toks), _prefill(_open(src), toks))


def test_missing_tensor_is_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("qwen2"), tmp_path / "x.gguf", drop={"blk.1.attn_k.bias"})
    with pytest.raises(_native.GGUFError, match=r"missing tensor blk\.1\.attn_k\.bias"):
        _native.Model(str(p), n_threads=1, pin=False)


def test_misshaped_tensor_is_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("llama"), tmp_path / "x.gguf", reshape=("blk.0.ffn_up.weight", (95, 64)))
    with pytest.raises(_native.GGUFError, match=r"blk\.0\.ffn_up\.weight has shape \[64, 95\], expected \[64, 96\]"):
        _native.Model(str(p), n_threads=1, pin=False)


def test_type_without_kernels_is_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("llama"), tmp_path / "x.gguf", retype="blk.1.attn_q.weight")
    with pytest.raises(_native.GGUFError, match=r"blk\.1\.attn_q\.weight has type Q8_1"):
        _native.Model(str(p), n_threads=1, pin=False)


def test_long_context_spans_many_attention_tiles(tiny_model):
    """150 positions = several 64-key tiles of the online softmax; gemma3's window (8) inside."""
    for arch in ("qwen2", "gemma3"):
        path = tiny_model(arch)
        e = _open(path, n_ctx=160, n_batch=37)
        toks = _tokens(e.n_vocab, n=150, seed=11)
        err = _rel_err(_prefill(e, toks), numpy_forward(path, toks))
        assert err < TOL_F32, f"{arch}: rel err {err:.2e}"


def test_thread_count_does_not_change_logits(tiny_model):
    path = tiny_model("llama", "Q8_0")
    toks = _tokens(320, n=20)
    one = _prefill(Engine.open(path, n_ctx=32, threads=1, pin=False), toks)
    three = _prefill(Engine.open(path, n_ctx=32, threads=3, pin=False), toks)
    np.testing.assert_array_equal(one, three)


def test_daemon_factory_loads_from_config(tiny_model):
    from ktd.ops import config
    from ktd.server.engine import load

    path = tiny_model("qwen3")
    cfg = config.load(text=f"model:\n  path: {path}\n  n_ctx: 128\n  n_seq_max: 3\n  threads: 1\n")
    seen = []
    e = load(cfg, lambda what, frac: seen.append(what))
    assert (e.n_ctx, e.n_seq_max) == (128, 3)
    assert seen and e.info()["architecture"] == "qwen3"
    assert e.tokenizer.n_vocab == 320
