"""Independent numpy forward of MoE models (qwen2moe, qwen3moe, llama/Mixtral, deepseek2).

Written from the architectures' definitions (DeepSeek-V2/V3 papers and HF modeling_deepseek.py,
HF Qwen2-MoE / Qwen3-MoE / Mixtral modelling code), not from any engine's C++: it is the oracle
a native MoE forward is tested against, and it is itself checked against llama.cpp
(tests/model/test_reference_moe.py). Everything is computed in float64 so the reference's own rounding
is negligible next to an engine's float32/float16 arithmetic.

Weights come from the GGUF file through gguf-py (`GGUFReader` + `gguf.quants.dequantize`).
Shapes: numpy order (GGML order reversed), so a weight stored [n_in, n_out] is W (n_out, n_in) and
y = x @ W.T; activations are (n_tokens, n_embd); expert stacks are (n_expert, n_out, n_in).

RoPE follows the GGUF convention: "norm" rotates adjacent pairs (llama, deepseek2; llama.cpp's
converter permutes q/k of HF llama checkpoints into this layout), "neox" rotates (i, i + n_rot/2)
(qwen). YaRN/linear rope scaling is not modelled: files that declare it are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf

ARCHS = ("qwen2moe", "qwen3moe", "llama", "deepseek2")


# ---- building blocks ----------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) / sqrt(mean(x^2) + eps) * w (n,)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def swiglu_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * up x); x (T, n_embd), gate/up (n_ff, n_embd), down (n_embd, n_ff)."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool) -> np.ndarray:
    """Rotate the first n_rot dims of x (T, n_head, d) at positions pos (T,)."""
    half = n_rot // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)  # (half,)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]  # (T, half)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q (T, n_head, dk), k (T, n_head_kv, dk), v (T, n_head_kv, dv) -> (T, n_head * dv).

    Query head h reads kv head h // (n_head / n_head_kv) (grouped-query attention)."""
    n_tokens, n_head, _ = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    mask = np.triu(np.ones((n_tokens, n_tokens), dtype=bool), 1)
    scores[:, mask] = -np.inf
    out = np.einsum("hqk,khd->qhd", softmax(scores, axis=-1), v)
    return out.reshape(n_tokens, -1)


# ---- MoE ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Routing:
    """How a router turns logits into (experts, weights) per token.

    gating: "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3) scores per expert.
    norm_topk: divide the chosen weights by their sum (Mixtral, Qwen3 norm_topk_prob, V3).
    scale: routed_scaling_factor, applied after normalisation.
    exp_probs_b: (n_expert,) bias added to the scores only to choose experts (V3's
      auxiliary-loss-free balancing); the weights use the unbiased scores.
    n_group / topk_group: group-limited routing (V3): experts split into n_group contiguous groups,
      a group scores the sum of its two best biased scores, only the topk_group best groups compete.
    """

    n_expert_used: int
    gating: str = "softmax"
    norm_topk: bool = False
    scale: float = 1.0
    exp_probs_b: np.ndarray | None = None
    n_group: int = 0
    topk_group: int = 0


def route(logits: np.ndarray, r: Routing) -> tuple[np.ndarray, np.ndarray]:
    """logits (T, n_expert) -> expert ids (T, n_expert_used) best first, weights (T, n_expert_used)."""
    n_tokens, n_expert = logits.shape
    if not 0 < r.n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used {r.n_expert_used} not in 1..{n_expert}")
    if r.gating == "softmax":
        scores = softmax(logits, axis=-1)
    elif r.gating == "sigmoid":
        scores = sigmoid(logits)
    else:
        raise ValueError(f"unknown gating {r.gating!r}")
    choice = scores + r.exp_probs_b if r.exp_probs_b is not None else scores.copy()
    if r.n_group > 1:
        if n_expert % r.n_group or not 0 < r.topk_group <= r.n_group:
            raise ValueError(f"bad groups: n_expert {n_expert}, n_group {r.n_group}, topk_group {r.topk_group}")
        grouped = choice.reshape(n_tokens, r.n_group, n_expert // r.n_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (T, n_group)
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, : r.topk_group]
        masked = np.full_like(grouped, -np.inf)
        rows = np.arange(n_tokens)[:, None]
        masked[rows, keep] = grouped[rows, keep]
        choice = masked.reshape(n_tokens, n_expert)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, : r.n_expert_used]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if r.norm_topk:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 6.103515625e-5)
    return ids, weights * r.scale


def moe_ffn(x: np.ndarray, gate_inp: np.ndarray, gate_exps: np.ndarray, up_exps: np.ndarray,
            down_exps: np.ndarray, routing: Routing, *, shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
            shared_gate_inp: np.ndarray | None = None) -> np.ndarray:
    """Routed SwiGLU experts plus optional shared experts; x (T, n_embd) -> (T, n_embd).

    gate_inp (n_expert, n_embd); gate_exps/up_exps (n_expert, n_ff_exp, n_embd);
    down_exps (n_expert, n_embd, n_ff_exp). shared = (gate, up, down) of the always-on FFN (all
    DeepSeek shared experts fused into one, as GGUF stores them); shared_gate_inp (n_embd,) scales
    it by sigmoid(x . w) per token (qwen2moe). Works for any T, including experts no token chose.
    """
    x = np.asarray(x, dtype=np.float64)
    ids, weights = route(x @ gate_inp.T, routing)
    y = np.zeros_like(x)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        y[tok] += weights[tok, slot][:, None] * swiglu_ffn(x[tok], gate_exps[e], up_exps[e], down_exps[e])
    if shared is not None:
        s = swiglu_ffn(x, *shared)
        if shared_gate_inp is not None:
            s = s * sigmoid(x @ shared_gate_inp)[:, None]
        y += s
    return y


# ---- model --------------------------------------------------------------------------------------

class Model:
    """Hyperparameters and dequantized (float64) weights of a GGUF MoE model."""

    def __init__(self, path: str | Path):
        reader = gguf.GGUFReader(path)
        self.kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
        self.arch = self.kv["general.architecture"]
        if self.arch not in ARCHS:
            raise ValueError(f"{path}: architecture {self.arch!r} is not one of {ARCHS}")
        if self._get("rope.scaling.type", "none") not in ("none",) or self._get("rope.scaling.factor", 1.0) != 1.0:
            raise ValueError(f"{path}: rope scaling is not modelled by the reference")
        self.w: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.asarray(a, dtype=np.float64).reshape(tuple(int(n) for n in reversed(t.shape)))

    def _get(self, key: str, default=None):
        return self.kv.get(f"{self.arch}.{key}", default)

    def hp(self, key: str):
        v = self._get(key)
        if v is None:
            raise ValueError(f"missing GGUF key {self.arch}.{key}")
        return v


def layer_routing(m: Model, il: int) -> Routing:
    """The routing parameters of MoE layer il, from the GGUF metadata and the layer's tensors."""
    arch = m.arch
    scale = float(m._get("expert_weights_scale", 0.0) or 1.0)  # 0 / absent: no scaling
    if arch == "deepseek2":
        gating = {1: "softmax", 2: "sigmoid"}.get(int(m._get("expert_gating_func", 1)))
        if gating is None:
            raise ValueError(f"unsupported expert_gating_func {m._get('expert_gating_func')}")
        return Routing(n_expert_used=int(m.hp("expert_used_count")), gating=gating,
                       norm_topk=bool(m._get("expert_weights_norm", False)), scale=scale,
                       exp_probs_b=m.w.get(f"blk.{il}.exp_probs_b.bias"),
                       n_group=int(m._get("expert_group_count", 0)), topk_group=int(m._get("expert_group_used_count", 0)))
    # Mixtral and Qwen3-MoE renormalise the top-k (norm_topk_prob=True); Qwen2-MoE does not.
    # llama.cpp (the pinned oracle) ignores expert_weights_scale for these architectures (it reads
    # the key only for the DeepSeek family), but applies expert_group_count to any of them
    # (test_moe_forward.test_routing_keys_as_llama_cpp_reads_them).
    return Routing(n_expert_used=int(m.hp("expert_used_count")), norm_topk=arch in ("llama", "qwen3moe"),
                   n_group=int(m._get("expert_group_count", 0)), topk_group=int(m._get("expert_group_used_count", 0)))


def _attention_gqa(m: Model, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Multi-head attention with grouped KV (qwen2moe, qwen3moe, llama); x (T, n_embd)."""
    b, w = f"blk.{il}.", m.w
    n_head, n_head_kv = int(m.hp("attention.head_count")), int(m.hp("attention.head_count_kv"))
    n_embd_head = int(m._get("attention.key_length", int(m.hp("embedding_length")) // n_head))
    n_rot = int(m._get("rope.dimension_count", n_embd_head))
    theta = float(m._get("rope.freq_base", 10000.0))
    eps = float(m.hp("attention.layer_norm_rms_epsilon"))
    q, k, v = x @ w[b + "attn_q.weight"].T, x @ w[b + "attn_k.weight"].T, x @ w[b + "attn_v.weight"].T
    if b + "attn_q.bias" in w:
        q, k, v = q + w[b + "attn_q.bias"], k + w[b + "attn_k.bias"], v + w[b + "attn_v.bias"]
    n_tokens = x.shape[0]
    q = q.reshape(n_tokens, n_head, n_embd_head)
    k = k.reshape(n_tokens, n_head_kv, n_embd_head)
    v = v.reshape(n_tokens, n_head_kv, n_embd_head)
    if b + "attn_q_norm.weight" in w:  # Qwen3: RMS norm per head before RoPE
        q = rms_norm(q, w[b + "attn_q_norm.weight"], eps)
        k = rms_norm(k, w[b + "attn_k_norm.weight"], eps)
    neox = m.arch in ("qwen2moe", "qwen3moe")
    q, k = rope(q, pos, n_rot, theta, neox), rope(k, pos, n_rot, theta, neox)
    out = causal_attention(q, k, v, 1.0 / np.sqrt(n_embd_head))
    return out @ w[b + "attn_output.weight"].T


def _attention_mla(m: Model, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """DeepSeek multi-head latent attention, computed naively by decompressing the latent to K/V.

    q = W_q x (or W_qb rms(W_qa x) with q LoRA), split per head into q_nope (qk_nope) and q_pe
    (qk_rope); [c; k_pe] = W_kva x with c the kv_lora_rank latent (what the cache stores) and k_pe
    one rope key shared by all heads; k_nope_h = W_kb_h rms(c), v_h = W_vb_h rms(c);
    score = (q_nope.k_nope + q_pe.k_pe) / sqrt(qk_nope + qk_rope).
    """
    b, w = f"blk.{il}.", m.w
    n_head = int(m.hp("attention.head_count"))
    kv_lora_rank = int(m.hp("attention.kv_lora_rank"))
    n_rot = int(m.hp("rope.dimension_count"))  # qk_rope_head_dim
    theta = float(m._get("rope.freq_base", 10000.0))
    eps = float(m.hp("attention.layer_norm_rms_epsilon"))
    n_tokens = x.shape[0]
    if b + "attn_q_a.weight" in w:
        q = rms_norm(x @ w[b + "attn_q_a.weight"].T, w[b + "attn_q_a_norm.weight"], eps) @ w[b + "attn_q_b.weight"].T
    else:
        q = x @ w[b + "attn_q.weight"].T
    q = q.reshape(n_tokens, n_head, -1)
    n_embd_head_k = q.shape[-1]
    qk_nope = n_embd_head_k - n_rot
    q_nope, q_pe = q[..., :qk_nope], q[..., qk_nope:]
    ckv = x @ w[b + "attn_kv_a_mqa.weight"].T  # (T, kv_lora_rank + n_rot)
    c = rms_norm(ckv[:, :kv_lora_rank], w[b + "attn_kv_a_norm.weight"], eps)
    k_pe = ckv[:, None, kv_lora_rank:]  # (T, 1, n_rot)
    q_pe, k_pe = rope(q_pe, pos, n_rot, theta, neox=False), rope(k_pe, pos, n_rot, theta, neox=False)
    if b + "attn_k_b.weight" in w:
        k_nope = np.einsum("tc,hcd->thd", c, w[b + "attn_k_b.weight"])  # k_b (n_head, kv_lora, qk_nope)
        v = np.einsum("tc,hvc->thv", c, w[b + "attn_v_b.weight"])  # v_b (n_head, v_head, kv_lora)
    else:  # legacy files: one attn_kv_b (n_head * (qk_nope + v_head), kv_lora)
        kv = (c @ w[b + "attn_kv_b.weight"].T).reshape(n_tokens, n_head, -1)
        k_nope, v = kv[..., :qk_nope], kv[..., qk_nope:]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (n_tokens, n_head, n_rot))], axis=-1)
    qf = np.concatenate([q_nope, q_pe], axis=-1)
    out = causal_attention(qf, k, v, 1.0 / np.sqrt(n_embd_head_k))
    return out @ w[b + "attn_output.weight"].T


def _ffn(m: Model, il: int, x: np.ndarray) -> np.ndarray:
    b, w = f"blk.{il}.", m.w
    if b + "ffn_gate_inp.weight" not in w:  # leading dense layer
        return swiglu_ffn(x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
    shared = None
    if b + "ffn_gate_shexp.weight" in w:
        shared = (w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"], w[b + "ffn_down_shexp.weight"])
    return moe_ffn(x, w[b + "ffn_gate_inp.weight"], w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"],
                   w[b + "ffn_down_exps.weight"], layer_routing(m, il), shared=shared,
                   shared_gate_inp=w.get(b + "ffn_gate_inp_shexp.weight"))


def forward(path_or_model: str | Path | Model, tokens) -> np.ndarray:
    """Teacher-forced logits (n_tokens, n_vocab) of a causal sequence starting at position 0."""
    m = path_or_model if isinstance(path_or_model, Model) else Model(path_or_model)
    tokens = np.asarray(tokens, dtype=np.int64)
    n_vocab = m.w["token_embd.weight"].shape[0]
    if tokens.ndim != 1 or len(tokens) == 0 or tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ValueError(f"tokens must be a non-empty 1-D sequence of ids in [0, {n_vocab})")
    eps = float(m.hp("attention.layer_norm_rms_epsilon"))
    attention = _attention_mla if m.arch == "deepseek2" else _attention_gqa
    pos = np.arange(len(tokens))
    x = m.w["token_embd.weight"][tokens]
    for il in range(int(m.hp("block_count"))):
        b = f"blk.{il}."
        x = x + attention(m, il, rms_norm(x, m.w[b + "attn_norm.weight"], eps), pos)
        x = x + _ffn(m, il, rms_norm(x, m.w[b + "ffn_norm.weight"], eps))
    x = rms_norm(x, m.w["output_norm.weight"], eps)
    return x @ m.w.get("output.weight", m.w["token_embd.weight"]).T
