"""Synthetic MoE models and the numpy MoE reference.

1. The routing/MoE building blocks against explicit per-token loops written here.
2. The generator against the tensor table llama.cpp's loader expects (src/models/<arch>.cpp
   create_tensor calls, transcribed below in GGML order from the file's own metadata).
3. The numpy forward against llama.cpp (llama-cpp-python) on every tiny architecture/variant:
   teacher-forced logits must agree (top-1, max-abs, KL). This is what validates both the file
   layout and the reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from pathlib import Path

import numpy as np
import pytest

import gguf
from models import synthetic_moe as S
from reference import numpy_moe as R

TINY = [(a, v) for a in S.ARCHS for v in S.VARIANTS[a]]
TINY_IDS = [f"{a}-{v}" if v else a for a, v in TINY]


# ---- routing and moe_ffn ------------------------------------------------------------------------

def _experts(rng, n_expert, n_embd, n_ff):
    s = 1 / np.sqrt(n_embd)
    return (rng.standard_normal((n_expert, n_embd)) * s, rng.standard_normal((n_expert, n_ff, n_embd)) * s,
            rng.standard_normal((n_expert, n_ff, n_embd)) * s, rng.standard_normal((n_expert, n_embd, n_ff)) / np.sqrt(n_ff))


def _expert_out(x, g, u, d):
    h = x @ g.T
    return (h / (1 + np.exp(-h)) * (x @ u.T)) @ d.T


def test_all_experts_softmax_is_dense_mixture():
    """With every expert used and no renormalisation, MoE = sum_e softmax_e(x) * FFN_e(x)."""
    rng = np.random.default_rng(1)
    gi, ge, ue, de = _experts(rng, 6, 16, 8)
    x = rng.standard_normal((5, 16))
    y = R.moe_ffn(x, gi, ge, ue, de, R.Routing(n_expert_used=6))
    logits = x @ gi.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = sum(p[:, e:e + 1] * _expert_out(x, ge[e], ue[e], de[e]) for e in range(6))
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_tokens", [1, 2, 7, 33])
@pytest.mark.parametrize("routing", [
    R.Routing(n_expert_used=2),
    R.Routing(n_expert_used=3, norm_topk=True),
    R.Routing(n_expert_used=3, gating="sigmoid", norm_topk=True, scale=2.5, n_group=4, topk_group=2),
], ids=["softmax", "softmax-norm", "sigmoid-groups"])
def test_moe_ffn_matches_per_token_loop(n_tokens, routing):
    """Prefill (many tokens, some experts chosen by no token) equals a per-token decode loop."""
    rng = np.random.default_rng(n_tokens)
    gi, ge, ue, de = _experts(rng, 8, 32, 16)
    if routing.gating == "sigmoid":
        routing = R.Routing(**{**routing.__dict__, "exp_probs_b": rng.uniform(0, 0.2, 8)})
    x = rng.standard_normal((n_tokens, 32))
    y = R.moe_ffn(x, gi, ge, ue, de, routing)
    for t in range(n_tokens):
        scores = x[t] @ gi.T
        scores = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum() if routing.gating == "softmax" \
            else 1 / (1 + np.exp(-scores))
        choice = scores + (routing.exp_probs_b if routing.exp_probs_b is not None else 0)
        allowed = list(range(8))
        if routing.n_group:
            size = 8 // routing.n_group
            gscore = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(routing.n_group)]
            groups = sorted(range(routing.n_group), key=lambda g: -gscore[g])[:routing.topk_group]
            allowed = [e for e in range(8) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:routing.n_expert_used]
        w = np.array([scores[e] for e in chosen])
        if routing.norm_topk:
            w = w / w.sum()
        want = routing.scale * sum(w[i] * _expert_out(x[t:t + 1], ge[e], ue[e], de[e]) for i, e in enumerate(chosen))
        np.testing.assert_allclose(y[t:t + 1], want, rtol=1e-10, atol=1e-12)


def test_selection_bias_picks_experts_but_not_weights():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 8))
    bias = np.zeros(8)
    bias[5] = 10.0
    ids, w = R.route(logits, R.Routing(n_expert_used=2, gating="sigmoid", exp_probs_b=bias))
    assert (ids[:, 0] == 5).all()
    np.testing.assert_allclose(w[:, 0], 1 / (1 + np.exp(-logits[:, 5])))


def test_group_limited_routing_stays_in_chosen_groups():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((64, 16))
    ids, _ = R.route(logits, R.Routing(n_expert_used=4, gating="sigmoid", n_group=8, topk_group=2))
    assert all(len(set(row // 2)) <= 2 for row in ids)


def test_shared_expert_gate():
    rng = np.random.default_rng(5)
    gi, ge, ue, de = _experts(rng, 4, 16, 8)
    sh = (rng.standard_normal((12, 16)) / 4, rng.standard_normal((12, 16)) / 4, rng.standard_normal((16, 12)) / 4)
    gate = rng.standard_normal(16)
    x = rng.standard_normal((3, 16))
    routed = R.moe_ffn(x, gi, ge, ue, de, R.Routing(n_expert_used=2))
    y = R.moe_ffn(x, gi, ge, ue, de, R.Routing(n_expert_used=2), shared=sh, shared_gate_inp=gate)
    np.testing.assert_allclose(y - routed, _expert_out(x, *sh) / (1 + np.exp(-(x @ gate)))[:, None], atol=1e-12)


def test_route_rejects_bad_parameters():
    with pytest.raises(ValueError):
        R.route(np.zeros((1, 8)), R.Routing(n_expert_used=9))
    with pytest.raises(ValueError):
        R.route(np.zeros((1, 8)), R.Routing(n_expert_used=2, n_group=3, topk_group=1))
    with pytest.raises(ValueError):
        R.route(np.zeros((1, 8)), R.Routing(n_expert_used=2, gating="relu"))


# ---- generator ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_files(tiny_model):
    """(arch, variant, wtype) -> path of the shared tiny MoE model (llama: Mixtral)."""
    return lambda arch, variant, wtype="F32": tiny_model(arch, wtype, variant=variant, moe=True)


def _llama_cpp_shapes(kv: dict, arch: str, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes (GGML order) that llama.cpp's load_arch_tensors creates, from the metadata."""
    g = lambda k, d=None: kv.get(f"{arch}.{k}", d)  # noqa: E731
    n_embd, n_layer, n_head = g("embedding_length"), g("block_count"), g("attention.head_count")
    n_head_kv, n_expert, n_ff = g("attention.head_count_kv"), g("expert_count"), g("feed_forward_length")
    shapes = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab)}
    for i in range(n_layer):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (n_embd,)
        shapes[b + "ffn_norm.weight"] = (n_embd,)
        if arch == "deepseek2":
            q_lora, kv_lora = g("attention.q_lora_rank"), g("attention.kv_lora_rank")
            hk, hv, rope = g("attention.key_length_mla"), g("attention.value_length_mla"), g("rope.dimension_count")
            if q_lora:
                shapes |= {b + "attn_q_a_norm.weight": (q_lora,), b + "attn_q_a.weight": (n_embd, q_lora),
                           b + "attn_q_b.weight": (q_lora, n_head * hk)}
            else:
                shapes[b + "attn_q.weight"] = (n_embd, n_head * hk)
            shapes |= {b + "attn_kv_a_norm.weight": (kv_lora,), b + "attn_kv_a_mqa.weight": (n_embd, kv_lora + rope),
                       b + "attn_k_b.weight": (hk - rope, kv_lora, n_head), b + "attn_v_b.weight": (kv_lora, hv, n_head),
                       b + "attn_output.weight": (n_head * hv, n_embd)}
            if i < g("leading_dense_block_count"):
                shapes |= {b + "ffn_gate.weight": (n_embd, n_ff), b + "ffn_down.weight": (n_ff, n_embd),
                           b + "ffn_up.weight": (n_embd, n_ff)}
                continue
            n_ff_exp = g("expert_feed_forward_length")
            n_sh = n_ff_exp * g("expert_shared_count")
            if g("expert_gating_func") == 2:
                shapes[b + "exp_probs_b.bias"] = (n_expert,)
            shapes |= {b + "ffn_gate_shexp.weight": (n_embd, n_sh), b + "ffn_down_shexp.weight": (n_sh, n_embd),
                       b + "ffn_up_shexp.weight": (n_embd, n_sh)}
        else:
            hd = g("attention.key_length")
            shapes |= {b + "attn_q.weight": (n_embd, n_head * hd), b + "attn_k.weight": (n_embd, n_head_kv * hd),
                       b + "attn_v.weight": (n_embd, n_head_kv * hd), b + "attn_output.weight": (n_head * hd, n_embd)}
            if arch == "qwen2moe":
                shapes |= {b + "attn_q.bias": (n_head * hd,), b + "attn_k.bias": (n_head_kv * hd,),
                           b + "attn_v.bias": (n_head_kv * hd,)}
                n_sh = g("expert_shared_feed_forward_length")
                shapes |= {b + "ffn_gate_inp_shexp.weight": (n_embd,), b + "ffn_gate_shexp.weight": (n_embd, n_sh),
                           b + "ffn_down_shexp.weight": (n_sh, n_embd), b + "ffn_up_shexp.weight": (n_embd, n_sh)}
            if arch == "qwen3moe":
                shapes |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
            n_ff_exp = n_ff if arch == "llama" else g("expert_feed_forward_length")
        shapes |= {b + "ffn_gate_inp.weight": (n_embd, n_expert),
                   b + "ffn_gate_exps.weight": (n_embd, n_ff_exp, n_expert),
                   b + "ffn_up_exps.weight": (n_embd, n_ff_exp, n_expert),
                   b + "ffn_down_exps.weight": (n_ff_exp, n_embd, n_expert)}
    return shapes


@pytest.mark.parametrize("arch,variant", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_generated_tensors_match_llama_cpp_table(tiny_files, arch, variant, wtype):
    r = gguf.GGUFReader(tiny_files(arch, variant, wtype))
    kv = {k: f.contents() for k, f in r.fields.items() if k != "tokenizer.ggml.tokens"}
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    assert kv["general.architecture"] == arch
    got = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert got == _llama_cpp_shapes(kv, arch, n_vocab)
    for t in r.tensors:
        v = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(v).all(), t.name


def test_generator_is_deterministic(tmp_path):
    a = S.make_model("deepseek2", tmp_path / "a.gguf", variant="v3", seed=7)
    b = S.make_model("deepseek2", tmp_path / "b.gguf", variant="v3", seed=7)
    c = S.make_model("deepseek2", tmp_path / "c.gguf", variant="v3", seed=8)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b) != digest(c)


@pytest.mark.parametrize("arch, variant, layers, experts, real_experts, used, bench_factor", [
    ("qwen3moe", None, 48, 32, 128, 8, 3),      # Qwen3-30B-A3B
    ("deepseek2", "v2-lite", 27, 16, 64, 6, 2),  # DeepSeek-V2-Lite (no q LoRA, as the real one)
])
def test_the_dram_presets_read_what_the_real_models_read_a_token(arch, variant, layers, experts, real_experts, used,
                                                                  bench_factor):
    """A dram preset is the bench one with the real model's layers and a quarter of its experts per
    layer: each matrix keeps its shape, and the weights a token reads (attention, routed and shared
    experts, dense layers, output head) are the real model's; only the router is smaller (n_expert
    rows of n_embd a layer)."""
    bench, dram = S.config(arch, "bench"), S.config(arch, "dram")
    assert S.default_variant(arch, "dram") == variant
    assert (dram.n_layer, dram.n_expert, dram.n_expert_used) == (layers, experts, used)
    assert dram.q_lora_rank == 0 or arch != "deepseek2"  # llama.cpp loads a 27-layer deepseek2 as V2-Lite
    full = dataclasses.replace(dram, n_expert=real_experts)

    def shapes(cfg):
        return {t.name: t.shape for t in S.tensor_table(cfg)}

    def read_per_token(cfg):
        n = 0
        for t in S.tensor_table(cfg):
            if t.name == "token_embd.weight" or "ffn_gate_inp." in t.name or "exp_probs_b" in t.name:
                continue  # one row a token; the router has n_expert rows
            size = int(np.prod(t.shape))
            n += size * cfg.n_expert_used // cfg.n_expert if "_exps." in t.name else size
        return n

    routed = lambda cfg: {k: v[1:] for k, v in shapes(cfg).items() if "_exps." in k}  # noqa: E731
    rest = lambda cfg: {k: v for k, v in shapes(cfg).items()  # noqa: E731
                        if "_exps." not in k and "ffn_gate_inp." not in k and "exp_probs_b" not in k}
    assert routed(dram) == routed(full) and routed(full)
    assert rest(dram) == rest(full)
    assert read_per_token(dram) == read_per_token(full) > bench_factor * read_per_token(bench)
    assert arch in S.PRESET_ARCHS["dram"]


def test_the_cli_takes_each_presets_archs_and_variant(tmp_path, capsys, monkeypatch):
    """Without --arch a preset writes the archs it has (dram: deepseek2 as V2-Lite, and qwen3moe);
    an arch it lacks is an error on stderr, before anything is written."""
    written = []

    def fake_make_model(arch, out, **kw):
        written.append((arch, kw["variant"], Path(out).name))
        Path(out).write_bytes(b"GGUF")
        return Path(out)

    monkeypatch.setattr(S, "make_model", fake_make_model)
    monkeypatch.setattr(S, "cache_dir", lambda: tmp_path)
    assert S.main(["--preset", "dram"]) == 0
    assert written == [("deepseek2", "v2-lite", "deepseek2-v2-lite-dram-q4_k_m-s0.gguf"),
                       ("qwen3moe", None, "qwen3moe-dram-q4_k_m-s0.gguf")]
    monkeypatch.undo()
    assert S.main(["--preset", "dram", "--arch", "llama", "--out", str(tmp_path / "x.gguf")]) == 1
    assert "no dram preset for arch 'llama'" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_generator_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        S.make_model("mamba", tmp_path / "x.gguf")
    with pytest.raises(ValueError):
        S.make_model("qwen3moe", tmp_path / "x.gguf", variant="v3")
    with pytest.raises(ValueError):
        S.make_model("llama", tmp_path / "x.gguf", preset="huge")
    with pytest.raises(ValueError):
        S.make_model("llama", tmp_path / "x.gguf", preset="bench")
    with pytest.raises(ValueError, match="no dram preset"):
        S.make_model("llama", tmp_path / "x.gguf", preset="dram")
    with pytest.raises((ValueError, RuntimeError)):  # RuntimeError: no llama-cpp-python to ask
        S.make_model("llama", tmp_path / "x.gguf", wtype="Q9_Z")
    assert list(tmp_path.iterdir()) == []


# ---- against llama.cpp --------------------------------------------------------------------------

def _llama(path, n_ctx):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (tools/oracle.sh builds it)")
    kwargs = dict(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2, logits_all=True,
                  verbose=False, type_k=gguf.GGMLQuantizationType.F32, type_v=gguf.GGMLQuantizationType.F32,
                  flash_attn=False)
    accepted = inspect.signature(llama_cpp.Llama.__init__).parameters
    return llama_cpp.Llama(**{k: v for k, v in kwargs.items() if k in accepted})


# Logits have std ~4 (synthetic_moe.MoeConfig.logit_gain). Per position: max |logit difference|
# and KL(reference || llama.cpp).
# F32: llama.cpp computes in float32 with an F32 KV cache, the reference in float64; measured max
#   ~6e-6, KL ~3e-12, so a 20x margin.
# Q8_0: the reference uses the same dequantized weights, but llama.cpp also rounds every activation
#   to Q8_0 before a quantized matmul (typical max error 0.1-0.3), and where two experts' router
#   scores nearly tie that rounding can flip the choice, a discrete jump at a few positions
#   (measured: <= 6% of positions above 0.5, top-1 >= 0.92). So the median error and the top-1 rate
#   are bounded, not the worst position; a layout error gives errors ~ the logit scale everywhere.
BOUNDS = {"F32": dict(max_abs=1e-4, median_abs=1e-4, kl=1e-9, top1=1.0),
          "Q8_0": dict(max_abs=np.inf, median_abs=0.5, kl=np.inf, mean_kl=0.2, top1=0.85)}


@pytest.mark.parametrize("arch,variant", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_reference_matches_llama_cpp(tiny_files, arch, variant, wtype):
    path = tiny_files(arch, variant, wtype)
    n_tokens = 48
    tokens = np.random.default_rng(11).integers(3, S.config(arch, variant=variant).n_vocab, n_tokens).tolist()
    llm = _llama(path, 64)
    llm.eval(tokens)
    got = np.array(llm.scores[:n_tokens], dtype=np.float64)
    want = R.forward(path, tokens)
    assert np.isfinite(got).all()
    bound = BOUNDS[wtype]
    err = np.abs(got - want).max(axis=-1)  # (n_tokens,)
    log_p = want - np.logaddexp.reduce(want, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).mean()
    stats = f"max_abs {err.max():.3g} median_abs {np.median(err):.3g} kl max {kl.max():.3g} mean {kl.mean():.3g} top1 {top1:.3f}"
    assert err.max() <= bound["max_abs"] and np.median(err) <= bound["median_abs"], stats
    assert kl.max() <= bound["kl"] and kl.mean() <= bound.get("mean_kl", np.inf), stats
    assert top1 >= bound["top1"], stats


@pytest.mark.parametrize("arch,variant", TINY, ids=TINY_IDS)
def test_reference_matches_llama_cpp_decode(tiny_files, arch, variant):
    """llama.cpp decoding one token at a time from its KV cache (for deepseek2 the latent cache
    with absorbed k_b/v_b) against the reference's full causal forward."""
    path = tiny_files(arch, variant, "F32")
    tokens = np.random.default_rng(12).integers(3, S.config(arch, variant=variant).n_vocab, 16).tolist()
    llm = _llama(path, 32)
    llm.eval(tokens[:5])
    for t in tokens[5:]:
        llm.eval([t])
    got = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    want = R.forward(path, tokens)
    err = np.abs(got - want).max(axis=-1)
    assert err.max() <= BOUNDS["F32"]["max_abs"], f"per-position max_abs {err}"


def test_check_llama_cpp_accepts_generated_and_rejects_truncated(tiny_files, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (tools/oracle.sh builds it)")
    path = tiny_files("deepseek2", "v3", "Q8_0")
    assert S.check_llama_cpp(path, n_tokens=4).shape == (4, S.config("deepseek2", variant="v3").n_vocab)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="cannot load"):
        S.check_llama_cpp(bad)
