"""Perplexity (ktd.model.perplexity, Context.score, `ktd perplexity`).

Oracles: the independent numpy reference forward on tiny F32 models of every dense architecture
(tests/reference/numpy_forward.py, float64) and llama.cpp through llama-cpp-python on the three
real models: the same text, the same tokens, the same chunks, llama-perplexity's quantity
computed in numpy from llama.cpp's logits (log-softmax in float64).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ktd.model import perplexity as P
from ktd.server.engine import Engine
from models.tiny_dense import ARCHS
from reference.numpy_forward import forward as numpy_forward
from paths import ROOT

ROOT = str(ROOT)
REAL = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]
# |ktd PPL / llama.cpp PPL - 1| on tests/data/perplexity.txt (2 threads), the bound 0.5%
# for all three. Measured: Qwen 0.5B +0.24%, 1.5B +0.37% (6 chunks of 256); Gemma-3-270M -0.41%
# with chunks of 512 (llama-perplexity's default n_ctx; 3 chunks, 765 scored tokens). With chunks
# of 256 Gemma is +1.03% (128: -0.95%): the quantized Gemma is numerically fragile (outlier
# activations through Q8 activation quantization; test_forward_oracle.py documents its logit noise
# floor, and llama.cpp's own PPL moves 0.39% on this text between flash attention on and off), so
# on short chunks the two engines' per-token differences do not average out. On 4,096 tokens of
# the repository's docs at 512, all three are within 0.41%.
PPL_CTX = {"qwen2.5-coder-0.5b": 256, "qwen2.5-coder-1.5b": 256, "gemma-3-270m": 512}
PPL_REL_TOL = 0.005


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_ppl(logits_of, tokens: list[int], n_ctx: int, bos: int | None, n_chunks: int | None = None):
    """llama-perplexity's method written out on plain logits: ``logits_of(chunk, first)`` -> the
    logits of the scored rows first .. n_ctx - 2 of the chunk, [n_ctx - 1 - first, n_vocab]."""
    n = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    nll = []
    for i in range(n):
        c = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        orig = list(c)
        if bos is not None:
            c[0] = bos
        lp = log_softmax(logits_of(c, first))
        for j in range(first, n_ctx - 1):
            nll.append(-lp[j - first, orig[j + 1]])
    nll = np.array(nll)
    return math.exp(nll.mean()), nll


def test_chunks_and_targets_follow_llama_perplexity():
    toks = list(range(100, 100 + 50))
    ch = P.chunks(toks, 16, bos_id=1)
    assert len(ch) == 3                                   # 50 // 16, the tail unused
    assert [c[0] for c in ch] == [1, 1, 1]                # BOS first in every chunk
    assert ch[1][1:].tolist() == toks[17:32]
    assert [c[0] for c in P.chunks(toks, 16, bos_id=None)] == [100, 116, 132]
    assert len(P.chunks(toks, 16, 1, n_chunks=2)) == 2
    tg = P.targets(ch[1], np.array(toks[16:32]))
    assert tg[:8].tolist() == [-1] * 8 and tg[-1] == -1   # rows 8..14 score tokens 9..15
    assert tg[8:15].tolist() == toks[16 + 9:16 + 16]
    with pytest.raises(P.PerplexityError, match="at least 64 are needed"):
        P.chunks(toks, 32, 1)
    with pytest.raises(P.PerplexityError, match="chunks"):
        P.chunks(toks, 16, 1, n_chunks=0)
    ppl, err = P.summarize(np.array([1.0, 2.0, 3.0]))
    assert ppl == pytest.approx(math.exp(2.0)) and err == pytest.approx(math.exp(2.0) * math.sqrt((14 / 3 - 4) / 2))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_perplexity_matches_the_numpy_reference(tiny_model, arch):
    path = tiny_model(arch)
    e = Engine.open(path, n_ctx=32, n_seq_max=1, threads=2, pin=False, n_batch=12)  # several pieces per chunk
    rng = np.random.default_rng(3)
    toks = [1] + rng.integers(3, e.n_vocab, 100).tolist()
    bos = e.tokenizer.bos_id if e.tokenizer.add_bos else None
    ref, ref_nll = reference_ppl(lambda c, first: numpy_forward(path, c)[first:-1], toks, 32, bos)
    r = P.evaluate(e, toks, 32)
    assert (r.n_chunks, r.n_scored) == (3, 3 * 15)
    # F32 weights: F32 arithmetic and the F16 KV cache against float64 (test_forward's TOL_F32)
    assert abs(r.ppl / ref - 1) < 5e-3, (r.ppl, ref)
    assert r.chunk_ppl[-1] == pytest.approx(r.ppl)


def test_score_equals_log_softmax_of_forward_logits(tiny_model):
    """The native NLL against numpy's log-softmax of the same engine's logits, row by row; pieces
    of more than kScoreRows (128) scored rows."""
    e = Engine.open(tiny_model("qwen2"), n_ctx=300, n_seq_max=1, threads=2, pin=False)
    rng = np.random.default_rng(4)
    toks = rng.integers(3, e.n_vocab, 300).astype(np.int32)
    tg = np.full(300, -1, np.int32)
    tg[10:299] = toks[11:300]
    tg[5] = 7
    pos, seq = np.arange(300, dtype=np.int32), np.zeros(300, np.int32)
    nll = e.score(toks, pos, seq, tg)
    logits = e.forward(toks, pos, seq, np.ones(300, bool))
    rows = np.flatnonzero(tg >= 0)
    want = -log_softmax(logits[rows])[np.arange(len(rows)), tg[rows]]
    assert nll.shape == (len(rows),)
    # same engine, different row pieces: the GEMM's summation order (test_forward's ATOL_BATCHING)
    np.testing.assert_allclose(nll, want, rtol=0, atol=2e-3)
    with pytest.raises(ValueError, match="target"):
        e.score(toks[:4], pos[:4], seq[:4], np.array([-1, e.n_vocab, -1, -1], np.int32))
    with pytest.raises(ValueError, match="same length"):
        e.score(toks[:4], pos[:4], seq[:4], np.array([-1], np.int32))


def test_cli_errors_are_one_line(tmp_path, tiny_model):
    path = tiny_model("llama")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "daemon")}

    def ktd(*args):
        return subprocess.run([sys.executable, "-m", "ktd", "perplexity", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=120)
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    r = ktd(path, short, "--ctx", 64)
    assert r.returncode == 1 and "at least 128 are needed" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xff\xfe")
    r = ktd(path, bad)
    assert r.returncode == 1 and "not UTF-8" in r.stderr
    r = ktd(path, tmp_path / "missing.txt")
    assert r.returncode == 1 and "cannot read" in r.stderr
    r = ktd(path, short, "--ctx", 2)
    assert r.returncode == 1 and "--ctx" in r.stderr
    text = tmp_path / "t.txt"
    text.write_text(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()[:3000])
    r = ktd(path, text, "--ctx", 32, "--chunks", 3, "--threads", 1, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_chunks"] == 3 and out["n_scored"] == 3 * 15 and math.isfinite(out["ppl"]) and out["ppl"] > 1


# --- llama.cpp ----------------------------------------------------------------------------------

def llama_ppl(path, tokens: list[int], n_ctx: int, bos: int | None, threads: int = 2):
    """llama.cpp driven as llama-perplexity drives it (llama.cpp's C API): each chunk one
    llama_decode from a cleared KV cache, logits requested for the second half of the chunk only."""
    L = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama.cpp oracle) is not installed; "
                            "run tools/oracle.sh")
    llm = L.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=False, n_threads=threads,
                  verbose=False)
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    b = L.llama_batch_init(n_ctx, 0, 1)

    def logits_of(c, first):
        for k in range(n_ctx):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = c[k], k, 1, k >= first
            b.seq_id[k][0] = 0
        b.n_tokens = n_ctx
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        assert L.llama_decode(ctx, b) == 0
        rows = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float)),
                                     shape=(n_ctx - first, n_vocab))
        return rows[:-1]  # the last row scores no token
    try:
        return llm, reference_ppl(logits_of, tokens, n_ctx, bos)
    finally:
        L.llama_batch_free(b)


def oracle_text() -> str:
    # ~1,800 tokens of English prose written for this test (tests/data/perplexity.txt), fixed so
    # that the figures do not move when documentation changes
    return open(os.path.join(ROOT, "tests", "data", "perplexity.txt"), encoding="utf-8").read()


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_perplexity_matches_llama_cpp_within_half_a_percent(real_model, name):
    path = real_model(name)
    # 6 chunks, 762 scored tokens: the two engines' per-token NLLs differ by 0.06 (Qwen) to 0.14
    # (Gemma) nats RMS (different kernels, activation quantization), which averages out over the
    # tokens to well under the 0.5% bound
    n_ctx = PPL_CTX[name]
    e = Engine.open(path, n_ctx=n_ctx, n_seq_max=1, threads=2, pin=False)
    toks = e.tokenizer.encode(oracle_text(), add_special=True)
    bos = e.tokenizer.bos_id if e.tokenizer.add_bos else None
    llm, (ref, _) = llama_ppl(path, toks, n_ctx, bos)
    # llama.cpp tokenizes the text the same way (so this is the number llama-perplexity would print)
    assert llm.tokenize(oracle_text().encode(), add_bos=True, special=False) == toks
    r = P.evaluate(e, toks, n_ctx)
    print(f"\n{name}: ktd PPL {r.ppl:.4f}, llama.cpp {ref:.4f} ({(r.ppl / ref - 1) * 100:+.3f}%)")
    assert r.n_chunks == len(toks) // n_ctx == 6 * 256 // n_ctx
    assert abs(r.ppl / ref - 1) < PPL_REL_TOL


def test_bench_perplexity_agrees_with_llama_cpp_on_a_tiny_model(tiny_model, tmp_path):
    """ktd.bench.perplexity's llama.cpp side (llama_decode with logits for the second half only)
    on a tiny F32 model: both engines near-exact, so the PPLs agree closely."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama.cpp oracle) is not installed; "
                        "run tools/oracle.sh")
    from ktd.bench import perplexity as B

    text = tmp_path / "t.txt"
    text.write_text(open(os.path.join(ROOT, "tests", "data", "perplexity.txt"), encoding="utf-8").read()[:2000])
    r = B.compare("tiny-llama", str(tiny_model("llama")), str(text), n_ctx=64, threads=1, n_chunks=4)
    assert r["n_chunks"] == 4 and r["n_scored"] == 4 * 31
    assert abs(r["rel_diff"]) < 5e-3, r["ppl"]
