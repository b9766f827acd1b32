"""The native MoE forward (qwen2moe, qwen3moe, llama with experts = Mixtral) on tiny synthetic
models: against the independent numpy reference (tests/reference/numpy_moe.py) and llama.cpp, the
MoE operator alone against a numpy loop over experts, consistency (prefill / decode / batch,
thread counts), expert statistics, and load-time errors.

Bounds (measured on these files, seed 0, 2 threads; margins stated next to each):
- F32 weights use F32 activations, so the only differences from the float64 reference are F32
  arithmetic and the F16 KV cache (relative rounding 2^-11 on K and V).
- Q8_0 weights: activations are rounded to Q8_0 before each matmul (as llama.cpp does), and where
  two experts' router scores nearly tie the rounding can flip the choice at a few positions, so
  the median error and top-1 rate are bounded, not the worst position (like test_reference_moe).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from gguf import GGUFValueType

from gguf_samples import rewrite_gguf
from ktd import _native
from ktd.server.engine import Engine
from models import synthetic_moe as S
from tiny_models import k_quant_widths
from reference import numpy_moe as R

ARCHS = ["qwen2moe", "qwen3moe", "llama"]
N_TOKENS = 24
# max |ktd - numpy| / max(1, max |numpy|) over all logits; measured 1.7-4.3e-4.
TOL_F32 = 2e-3
# Q8_0: median over positions of max |Δlogit| (logits have std ~4), and top-1 agreement; measured
# against the reference 0.11-0.22 and >= 0.94, against llama.cpp 0.10-0.11 and >= 0.96.
Q8_MEDIAN_ABS = 0.5
Q8_TOP1 = 0.85
# The operator alone (one layer, fresh inputs), relative to max |y|: F32 exact weights and
# activations, float32 sums (measured 1-4e-7); Q8_0 activations, relative rounding ~1/127 per
# element of xn and of the hidden rows (measured 1.0-1.6e-2).
TOL_OP_F32 = 1e-5
TOL_OP_Q8 = 3e-2


@pytest.fixture(scope="module")
def reference():
    cache: dict = {}

    def get(path):
        if path not in cache:
            cache[path] = R.Model(path)
        return cache[path]

    return get


def _tokens(n_vocab: int, n: int = N_TOKENS, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(3, n_vocab, size=n).tolist()


def _open(path, threads: int = 2, **kw) -> Engine:
    kw.setdefault("n_ctx", 64)
    return Engine.open(path, threads=threads, pin=False, **kw)


def _prefill(e: Engine, toks, seq: int = 0, start: int = 0) -> np.ndarray:
    n = len(toks)
    return e.forward(np.array(toks), np.arange(start, start + n), np.full(n, seq), np.ones(n, bool))


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a - ref)) / max(1.0, float(np.max(np.abs(ref)))))


# ---- against the numpy reference ----------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_numpy_reference_f32(tiny_model, reference, arch):
    path = tiny_model(arch, moe=True)
    e = _open(path)
    assert e.model.arch == arch and e.model.n_expert == 8
    toks = _tokens(e.n_vocab)
    err = _rel_err(_prefill(e, toks), R.forward(reference(path), toks))
    assert err < TOL_F32, f"rel err {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_numpy_reference_q8_0(tiny_model, reference, arch):
    path = tiny_model(arch, "Q8_0", moe=True)
    e = _open(path)
    toks = _tokens(e.n_vocab, n=48)
    got = _prefill(e, toks)
    want = R.forward(reference(path), toks)
    err = np.abs(got - want).max(axis=-1)
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    stats = f"max {err.max():.3g} median {np.median(err):.3g} top1 {top1:.3f}"
    assert np.median(err) <= Q8_MEDIAN_ABS and top1 >= Q8_TOP1, stats


# ---- against llama.cpp --------------------------------------------------------------------------

def _llama(path, n_ctx):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (tools/oracle.sh builds it)")
    kwargs = dict(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2, logits_all=True,
                  verbose=False, flash_attn=False)
    accepted = inspect.signature(llama_cpp.Llama.__init__).parameters
    return llama_cpp.Llama(**{k: v for k, v in kwargs.items() if k in accepted})


# llama.cpp with its default F16 KV cache, ktd with its F16 cache; measured on 48 tokens:
# F32 max |Δlogit| 2.8-3.3e-3 with top-1 1.0; Q8_0 as above.
LLAMA_F32_MAX_ABS = 0.01


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_logits_match_llama_cpp(tiny_model, arch, wtype):
    path = tiny_model(arch, wtype, moe=True)
    toks = _tokens(S.config(arch).n_vocab, n=48, seed=11)
    llm = _llama(path, 64)
    llm.eval(toks)
    want = np.array(llm.scores[:len(toks)], dtype=np.float64)
    got = _prefill(_open(path), toks)
    err = np.abs(got - want).max(axis=-1)
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    stats = f"max {err.max():.3g} median {np.median(err):.3g} top1 {top1:.3f}"
    if wtype == "F32":
        assert err.max() <= LLAMA_F32_MAX_ABS and top1 == 1.0, stats
    else:
        assert np.median(err) <= Q8_MEDIAN_ABS and top1 >= Q8_TOP1, stats


def test_routing_keys_as_llama_cpp_reads_them(tiny_model, tmp_path):
    """On qwen3moe llama.cpp applies expert_group_count/expert_group_used_count but ignores
    expert_weights_scale, expert_gating_func and expert_weights_norm (hard-coded softmax,
    renormalised): ktd and the numpy reference must do the same."""
    src = tiny_model("qwen3moe")
    p = _rewrite(src, tmp_path / "keys.gguf", set_kv={
        "qwen3moe.expert_group_count": (4, U32), "qwen3moe.expert_group_used_count": (2, U32),
        "qwen3moe.expert_weights_scale": (3.0, GGUFValueType.FLOAT32), "qwen3moe.expert_gating_func": (2, U32),
        "qwen3moe.expert_weights_norm": (False, GGUFValueType.BOOL)})
    toks = _tokens(320, n=16, seed=11)
    llm = _llama(p, 32)
    llm.eval(toks)
    want = np.array(llm.scores[:len(toks)], dtype=np.float64)
    got = _prefill(_open(p), toks)
    assert np.abs(got - _prefill(_open(src), toks)).max() > 1.0, "the groups must change the routing"
    assert np.abs(got - want).max() <= LLAMA_F32_MAX_ABS
    assert _rel_err(got, R.forward(p, toks)) < TOL_F32


# ---- consistency --------------------------------------------------------------------------------

# Different batch shapes change the kernels' tiles (GEMV vs GEMM, experts over 1 or many tokens):
# F32 rounding, which an F16 KV-cache rounding step can amplify. Measured max 1.3e-3 (qwen2moe;
# qwen3moe and llama bitwise equal), inside the ~2-3e-3 both paths are from the float64 reference;
# a routing or layout error moves logits by O(1).
ATOL_BATCHING = 4e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_equals_token_by_token_and_mixed_batch(tiny_model, arch):
    path = tiny_model(arch, moe=True)
    toks = _tokens(320, n=16)
    other = _tokens(320, n=16, seed=5)
    e = _open(path, n_seq_max=2)
    full = _prefill(e, toks)
    e.free_seq(0)
    steps = np.concatenate([_prefill(e, [t], start=i) for i, t in enumerate(toks)])
    np.testing.assert_allclose(steps, full, atol=ATOL_BATCHING, rtol=0)
    # Sequence 0's first half, then its second half decoded next to sequence 1's prefill.
    e.free_seq(0)
    _prefill(e, toks[:8])
    n1 = len(other)
    tokens = np.array(toks[8:] + other)
    pos = np.concatenate([np.arange(8, 16), np.arange(n1)])
    seq = np.array([0] * 8 + [1] * n1)
    mixed = e.forward(tokens, pos, seq, np.ones(len(tokens), bool))
    np.testing.assert_allclose(mixed[:8], full[8:], atol=ATOL_BATCHING, rtol=0)
    e2 = _open(path)
    np.testing.assert_allclose(mixed[8:], _prefill(e2, other), atol=ATOL_BATCHING, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_thread_count_does_not_change_logits(tiny_model, arch):
    """Every output element of the MoE is computed by one work item and summed in a fixed order."""
    path = tiny_model(arch, "Q8_0", moe=True)
    toks = _tokens(320, n=20)
    one = _prefill(_open(path, threads=1, n_ctx=32), toks)
    for threads in (2, 3):
        np.testing.assert_array_equal(_prefill(_open(path, threads=threads, n_ctx=32), toks), one)


def _decode(e: Engine, toks) -> np.ndarray:
    """Token by token: every step takes the one-row (decode) path of the MoE."""
    return np.concatenate([e.forward(np.array([t]), np.array([i]), np.array([0]), np.array([True]))
                           for i, t in enumerate(toks)])


@pytest.mark.parametrize("arch", ARCHS)
def test_thread_count_does_not_change_decode(tiny_model, arch):
    """The decode path cuts the experts' rows into blocks by thread count; each output element is
    still computed by one item and summed in selection order, so 1, 2 and 3 threads agree bitwise,
    with one activation format (Q8_0) and with Q4_K_M's mix of formats."""
    for path in (tiny_model(arch, "Q8_0", moe=True), tiny_model(arch, "Q4_K_M", moe=True, **k_quant_widths(arch))):
        toks = _tokens(320, n=12, seed=3)
        one = _decode(_open(path, threads=1, n_ctx=32), toks)
        for threads in (2, 3):
            np.testing.assert_array_equal(_decode(_open(path, threads=threads, n_ctx=32), toks), one)


def test_chunked_prefill_equals_one_chunk(tiny_model):
    path = tiny_model("qwen2moe")
    toks = _tokens(320, n=30)
    whole = _prefill(_open(path), toks)
    chunked = _prefill(_open(path, n_batch=7), toks)
    np.testing.assert_allclose(chunked, whole, atol=ATOL_BATCHING, rtol=0)


# ---- the MoE operator alone ---------------------------------------------------------------------

def _layer_moe(m: R.Model, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, ids) of layer il's MoE FFN on normed rows x, as an explicit loop over experts."""
    b, w = f"blk.{il}.", m.w
    routing = R.layer_routing(m, il)
    x = x.astype(np.float64)
    ids, weights = R.route(x @ w[b + "ffn_gate_inp.weight"].T, routing)
    y = np.zeros_like(x)
    for e in range(w[b + "ffn_gate_exps.weight"].shape[0]):
        for t, slot in zip(*np.nonzero(ids == e)):
            y[t] += weights[t, slot] * R.swiglu_ffn(x[t:t + 1], w[b + "ffn_gate_exps.weight"][e],
                                                    w[b + "ffn_up_exps.weight"][e], w[b + "ffn_down_exps.weight"][e])[0]
    if b + "ffn_gate_shexp.weight" in w:
        s = R.swiglu_ffn(x, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"], w[b + "ffn_down_shexp.weight"])
        if b + "ffn_gate_inp_shexp.weight" in w:
            s *= R.sigmoid(x @ w[b + "ffn_gate_inp_shexp.weight"])[:, None]
        y += s
    return y, ids


def _inputs(m: R.Model, n: int, seed: int) -> np.ndarray:
    """n normed rows; for n > 1 each steered towards n_expert_used of experts 0..3 of layer 1 (along
    their router rows) so that experts 4.. receive (almost) no token."""
    rng = np.random.default_rng(seed)
    gate_inp = m.w["blk.1.ffn_gate_inp.weight"]
    k = R.layer_routing(m, 1).n_expert_used
    x = rng.standard_normal((n, gate_inp.shape[1]))
    if n > 1:
        for row in x:
            row += 2.0 * np.sqrt(len(row)) * gate_inp[rng.choice(4, k, replace=False)].sum(axis=0)
    return R.rms_norm(x, 1.0, 1e-6).astype(np.float32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("n", [1, 64])
def test_moe_operator_matches_loop_over_experts(tiny_model, reference, arch, wtype, n):
    path = tiny_model(arch, wtype, moe=True)
    m = reference(path)
    e = _open(path, threads=3)
    x = _inputs(m, n, seed=n)
    want, ids = _layer_moe(m, 1, x)
    n_expert = m.w["blk.1.ffn_gate_inp.weight"].shape[0]
    assert len(np.unique(ids)) < n_expert, "the inputs must leave some expert without a token"
    got = e.context._moe_ffn(1, x)
    err = _rel_err(got, want)
    assert err < (TOL_OP_F32 if wtype == "F32" else TOL_OP_Q8), f"rel err {err:.2e}"
    counts = e.context.expert_counts()
    assert counts.shape == (2, n_expert) and counts.dtype == np.uint64
    np.testing.assert_array_equal(counts[1], np.bincount(ids.ravel(), minlength=n_expert))
    assert counts[0].sum() == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 64])
def test_moe_operator_k_quants(tiny_model, reference, arch, n):
    """Q8_K activations (measured rel err 1.3-2.1e-2)."""
    path = tiny_model(arch, "Q4_K_M", moe=True, **k_quant_widths(arch))
    m = reference(path)
    x = _inputs(m, n, seed=n)
    want, ids = _layer_moe(m, 1, x)
    assert len(np.unique(ids)) < m.w["blk.1.ffn_gate_inp.weight"].shape[0]
    err = _rel_err(_open(path, threads=3).context._moe_ffn(1, x), want)
    assert err < TOL_OP_Q8, f"rel err {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_k_quants_match_llama_cpp(tiny_model, arch):
    """Measured on 32 tokens: median max|Δlogit| 0.17-0.18, top-1 >= 0.94."""
    path = tiny_model(arch, "Q4_K_M", moe=True, **k_quant_widths(arch))
    toks = _tokens(320, n=32, seed=11)
    llm = _llama(path, 64)
    llm.eval(toks)
    want = np.array(llm.scores[:len(toks)], dtype=np.float64)
    got = _prefill(_open(path), toks)
    err = np.abs(got - want).max(axis=-1)
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    stats = f"max {err.max():.3g} median {np.median(err):.3g} top1 {top1:.3f}"
    assert np.median(err) <= Q8_MEDIAN_ABS and top1 >= Q8_TOP1, stats


def test_moe_operator_rejects_bad_calls(tiny_model):
    e = _open(tiny_model("qwen3moe"), n_batch=8)
    with pytest.raises(ValueError, match="no routed experts"):
        e.context._moe_ffn(2, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="n_batch"):
        e.context._moe_ffn(0, np.zeros((9, 64), np.float32))
    with pytest.raises(ValueError, match="n_embd"):
        e.context._moe_ffn(0, np.zeros((1, 63), np.float32))


# ---- routing (every variant, including the ones only deepseek2 uses) ------------------------------

ROUTINGS = {
    "softmax": dict(n_expert_used=2),
    "softmax-norm": dict(n_expert_used=3, weights_norm=True),
    "softmax-scale": dict(n_expert_used=6, weights_scale=1.5),  # DeepSeek-V2
    "sigmoid-bias": dict(n_expert_used=4, gating="sigmoid", bias=True, weights_norm=True),
    "sigmoid-groups": dict(n_expert_used=8, gating="sigmoid", bias=True, weights_norm=True, weights_scale=2.5,
                           n_group=8, n_group_used=4),  # DeepSeek-V3 (256 experts top-8, 8 groups, 4 used)
}


def _route_both(logits, p, bias):
    got_ids, got_w = _native._moe_route(
        logits, p["n_expert_used"], gating=p.get("gating", "softmax"), weights_norm=p.get("weights_norm", False),
        weights_scale=p.get("weights_scale", 1.0), exp_probs_b=bias, n_group=p.get("n_group", 0),
        n_group_used=p.get("n_group_used", 0))
    want_ids, want_w = R.route(logits.astype(np.float64), R.Routing(
        n_expert_used=p["n_expert_used"], gating=p.get("gating", "softmax"), norm_topk=p.get("weights_norm", False),
        scale=p.get("weights_scale", 1.0), exp_probs_b=bias, n_group=p.get("n_group", 0),
        topk_group=p.get("n_group_used", 0)))
    return got_ids, got_w, want_ids, want_w


@pytest.mark.parametrize("name", ROUTINGS)
def test_routing_matches_reference(name):
    p = ROUTINGS[name]
    n_expert = 64 if p.get("n_group") else 16
    rng = np.random.default_rng(len(name))
    logits = (2 * rng.standard_normal((200, n_expert))).astype(np.float32)
    bias = rng.uniform(0, 0.2, n_expert).astype(np.float32) if p.get("bias") else None
    got_ids, got_w, want_ids, want_w = _route_both(logits, p, bias)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=2e-6, atol=1e-7)
    if p.get("n_group"):
        groups = got_ids // (n_expert // p["n_group"])
        assert max(len(set(row)) for row in groups) == p["n_group_used"]


def test_routing_ties_go_to_the_lowest_index():
    logits = np.zeros((3, 8), np.float32)
    logits[1, [2, 5, 6]] = 1.0
    logits[2] = [0, 1, 1, 0, 0, 1, 1, 0]
    ids, w = _native._moe_route(logits, 2)
    np.testing.assert_array_equal(ids, [[0, 1], [2, 5], [1, 2]])
    np.testing.assert_allclose(w[0], [1 / 8, 1 / 8], rtol=1e-6)
    # groups of 2: row 1's groups 1..3 tie (score σ(1) + σ(0)), so groups 1 and 2 win; all of row 2's
    # groups tie, so groups 0 and 1
    ids, _ = _native._moe_route(logits, 2, gating="sigmoid", n_group=4, n_group_used=2)
    np.testing.assert_array_equal(ids, [[0, 1], [2, 5], [1, 2]])
    want_ids, _ = R.route(logits.astype(np.float64), R.Routing(n_expert_used=2, gating="sigmoid", n_group=4,
                                                               topk_group=2))
    np.testing.assert_array_equal(ids, want_ids)


def test_routing_survives_non_finite_logits():
    logits = np.full((2, 8), np.nan, np.float32)
    logits[1, 3] = np.inf
    ids, _ = _native._moe_route(logits, 3, weights_norm=True)
    assert all(len(set(row)) == 3 and row.min() >= 0 and row.max() < 8 for row in ids)


# ---- expert statistics --------------------------------------------------------------------------

def _reference_routing(m: R.Model, tokens) -> list[np.ndarray]:
    """Per layer, the expert ids (n_tokens, n_expert_used) the reference forward routes to, and the
    smallest gap between the last chosen and the first rejected selection score."""
    eps = float(m.hp("attention.layer_norm_rms_epsilon"))
    pos = np.arange(len(tokens))
    x = m.w["token_embd.weight"][np.asarray(tokens)]
    out = []
    for il in range(int(m.hp("block_count"))):
        b = f"blk.{il}."
        x = x + R._attention_gqa(m, il, R.rms_norm(x, m.w[b + "attn_norm.weight"], eps), pos)
        xn = R.rms_norm(x, m.w[b + "ffn_norm.weight"], eps)
        routing = R.layer_routing(m, il)
        logits = xn @ m.w[b + "ffn_gate_inp.weight"].T
        ids, _ = R.route(logits, routing)
        p = np.sort(R.softmax(logits), axis=-1)[:, ::-1]
        k = routing.n_expert_used
        out.append((ids, float((p[:, k - 1] - p[:, k]).min())))
        x = x + R._ffn(m, il, xn)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_counts_match_reference_routing(tiny_model, reference, arch):
    path = tiny_model(arch, moe=True)
    m = reference(path)
    e = _open(path)
    toks = _tokens(e.n_vocab, n=20, seed=11)  # no near-tie in any layer (gaps >= 1.4e-3)
    assert not e.context.expert_counts().any()
    _prefill(e, toks)
    counts = e.context.expert_counts()
    n_used = e.model.n_expert_used
    for il, (ids, gap) in enumerate(_reference_routing(m, toks)):
        assert counts[il].sum() == len(toks) * n_used
        # ktd's router probabilities differ from the reference's far less than that (F32, F16 KV)
        assert gap > 1e-3, "a near-tie in the reference routing would make this comparison luck"
        np.testing.assert_array_equal(counts[il], np.bincount(ids.ravel(), minlength=e.model.n_expert))
    e.context.reset_expert_counts()
    assert not e.context.expert_counts().any()
    _prefill(e, toks[:1], start=len(toks))
    assert (e.context.expert_counts().sum(axis=1) == n_used).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_states_match_reference(tiny_model, reference, arch):
    """Context._record_states (the next-layer prediction bench's hook): the last row's residual
    before and after each MoE layer's FFN, against the numpy reference forward."""
    path = tiny_model(arch, moe=True)
    m = reference(path)
    e = _open(path)
    toks = _tokens(e.n_vocab, n=6, seed=2)
    with pytest.raises(ValueError, match="recording is off"):
        e.context._states()
    e.context._record_states(True)
    _prefill(e, toks)
    got = e.context._states()
    eps = float(m.hp("attention.layer_norm_rms_epsilon"))
    pos = np.arange(len(toks))
    x = m.w["token_embd.weight"][np.asarray(toks)]
    assert got.shape == (int(m.hp("block_count")), 2, x.shape[1])
    for il in range(got.shape[0]):
        b = f"blk.{il}."
        x = x + R._attention_gqa(m, il, R.rms_norm(x, m.w[b + "attn_norm.weight"], eps), pos)
        before = x[-1].copy()
        x = x + R._ffn(m, il, R.rms_norm(x, m.w[b + "ffn_norm.weight"], eps))
        for which, want in ((0, before), (1, x[-1])):
            assert _rel_err(got[il, which], want) < TOL_F32, (il, which)
    e.context._record_states(False)
    with pytest.raises(ValueError, match="recording is off"):
        e.context._states()


def test_engine_status_summarises_expert_counts(tiny_model):
    e = _open(tiny_model("qwen3moe"))
    assert e.info()["experts"] == {"n_expert": 8, "n_expert_used": 3, "layers": []}
    _prefill(e, _tokens(320, n=10))
    counts = e.expert_counts()
    summary = e.info()["experts"]
    assert [d["layer"] for d in summary["layers"]] == [0, 1]
    for d in summary["layers"]:
        row = counts[d["layer"]]
        assert d["routed"] == 30 == row.sum()
        assert [c for _, c in d["top"]] == sorted(row, reverse=True)[:len(d["top"])]
        assert all(row[x] == c for x, c in d["top"])
    e.reset_expert_counts()
    assert not e.expert_counts().any() and e.info()["experts"]["layers"] == []


def test_dense_model_has_no_expert_counts(tmp_path):
    from models.tiny_dense import make_model

    e = _open(make_model("llama", tmp_path / "dense.gguf"))
    assert e.model.n_expert == 0
    _prefill(e, [1, 5, 9])
    assert e.context.expert_counts().shape == (e.model.n_layer, 0)
    assert "experts" not in e.info()


# ---- load-time errors ---------------------------------------------------------------------------

_rewrite = rewrite_gguf


def _load(path):
    return _native.Model(str(path), n_threads=1, pin=False)


def test_copy_without_edits_loads(tiny_model, tmp_path):
    """Control for the edit tests: the rewrite itself keeps a loadable, equal model."""
    src = tiny_model("qwen2moe")
    p = _rewrite(src, tmp_path / "same.gguf")
    toks = _tokens(320, n=5)
    np.testing.assert_array_equal(_prefill(_open(p), toks), _prefill(_open(src), toks))


U32 = GGUFValueType.UINT32


@pytest.mark.parametrize("used", [0, 9])
def test_bad_expert_used_count_is_named(tiny_model, tmp_path, used):
    p = _rewrite(tiny_model("qwen3moe"), tmp_path / "x.gguf", set_kv={"qwen3moe.expert_used_count": (used, U32)})
    with pytest.raises(_native.GGUFError, match=rf"qwen3moe\.expert_used_count = {used} is out of range \[1, 8\]"):
        _load(p)


def test_unsupported_gating_function_is_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("qwen2moe"), tmp_path / "x.gguf", set_kv={"qwen2moe.expert_gating_func": (3, U32)})
    with pytest.raises(_native.GGUFError, match=r"unsupported qwen2moe\.expert_gating_func 3"):
        _load(p)


def test_bad_expert_groups_are_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("qwen3moe"), tmp_path / "x.gguf", set_kv={"qwen3moe.expert_group_count": (3, U32),
                                                               "qwen3moe.expert_group_used_count": (1, U32)})
    with pytest.raises(_native.GGUFError, match=r"qwen3moe\.expert_group_count = 3 must divide expert_count 8"):
        _load(p)


def test_moe_arch_without_experts_is_named(tiny_model, tmp_path):
    p = _rewrite(tiny_model("qwen3moe"), tmp_path / "x.gguf", set_kv={"qwen3moe.expert_count": (0, U32)})
    with pytest.raises(_native.GGUFError, match=r"qwen3moe requires metadata key qwen3moe\.expert_count > 0"):
        _load(p)


@pytest.mark.parametrize("arch,name", [("qwen2moe", "blk.1.ffn_up_exps.weight"), ("llama", "blk.0.ffn_gate_inp.weight"),
                                       ("qwen2moe", "blk.0.ffn_down_shexp.weight")])
def test_missing_expert_tensor_is_named(tiny_model, tmp_path, arch, name):
    p = _rewrite(tiny_model(arch, moe=True), tmp_path / "x.gguf", drop={name})
    with pytest.raises(_native.GGUFError, match=rf"missing tensor {name}"):
        _load(p)


def test_misshaped_expert_stack_is_named(tiny_model, tmp_path):
    # numpy order (n_expert, n_embd, n_ff_exp): one expert short
    p = _rewrite(tiny_model("qwen3moe"), tmp_path / "x.gguf", reshape=("blk.0.ffn_down_exps.weight", (7, 64, 32)))
    with pytest.raises(_native.GGUFError,
                       match=r"blk\.0\.ffn_down_exps\.weight has shape \[32, 64, 7\], expected \[32, 64, 8\]"):
        _load(p)


def test_dense_ffn_in_a_moe_layer_is_rejected(tiny_model, tmp_path):
    extra = _rewrite(tiny_model("llama", moe=True), tmp_path / "x.gguf",
                     add={"blk.1.ffn_up.weight": np.zeros((48, 64), np.float32)})
    with pytest.raises(_native.GGUFError, match=r"unexpected tensor blk\.1\.ffn_up\.weight"):
        _load(extra)


def test_mixtral_expert_width_is_feed_forward_length(tiny_model):
    """Mixtral files give no expert_feed_forward_length: the stacks are [n_embd, n_ff, n_expert]."""
    m = _load(tiny_model("llama", moe=True))
    assert (m.arch, m.n_expert, m.n_expert_used, m.n_ff) == ("llama", 8, 2, 48)


# ---- the benchmark-sized file -------------------------------------------------------------------

@pytest.mark.slow
def test_bench_file_matches_llama_cpp():
    """The Qwen3-30B-A3B-shaped Q4_K_M file (128 experts top-8, 12 layers; ~5 GB, ~12 GB of RAM
    with both engines): measured on 24 tokens top-1 1.0, relative L2 error of the logits 0.049 (mean
    |Δ| 0.15 on logits of std 4; both engines round activations to Q8_K, differently)."""
    path = S.default_path("qwen3moe", "bench", "Q4_K_M")
    if not path.is_file():
        pytest.skip(f"{path} is absent (python -m tests.models.synthetic_moe --preset bench --arch qwen3moe)")
    toks = (np.arange(24) * 7919 % 150000 + 3).tolist()
    e = _open(path, n_ctx=64)
    got = _prefill(e, toks)
    assert (e.expert_counts().sum(axis=1) == 24 * 8).all()
    del e
    llm = _llama(path, 64)
    llm.eval(toks)
    want = np.array(llm.scores[:len(toks)], dtype=np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert rel < 0.1 and top1 >= 0.9, f"rel L2 {rel:.3g} top1 {top1:.3f}"
