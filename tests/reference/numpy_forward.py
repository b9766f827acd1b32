"""Independent numpy forward of the dense architectures, a test oracle (clarity over speed).

Written from the architectures' definitions (the papers and the Hugging Face modelling code), not
from ktd's C++: RMSNorm, rotary embeddings (GPT-J "normal" pairs for llama, GPT-NeoX halves for the
others), grouped-query causal attention, sliding windows, SwiGLU / GeGLU / squared-ReLU FFNs.
Weights come from the GGUF file through gguf-py (GGUFReader + gguf.quants.dequantize), so the
oracle sees exactly the (dequantized) numbers the file holds; everything is computed in float64.

GGUF conventions this file relies on (they are conversion-time facts, not forward choices):
- llama q/k weights were permuted by convert_hf_to_gguf so that llama.cpp's "normal" rope (rotate
  adjacent pairs) reproduces HF's rotate_half; the other archs keep HF order and use NeoX rope.
- gemma norm weights already hold HF's (1 + w); they multiply as is.

Shapes: x [n_tokens, n_embd]; q [n_tokens, n_head, head_dim]; weights [n_out, n_in] (numpy order).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

# Rotary embedding layout per arch, as llama.cpp's llama_model_rope_type assigns it.
ROPE_NORM = "norm"  # rotate (x[2i], x[2i+1])
ROPE_NEOX = "neox"  # rotate (x[i], x[i + n_rot/2])
ROPE_TYPE = {"llama": ROPE_NORM, "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX, "gemma3": ROPE_NEOX, "bitnet": ROPE_NEOX}

# Gemma 3 defaults when the file does not say: 5 local layers then 1 global, local rope base 1e4.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0
# YaRN correction range (HF rope_scaling defaults beta_fast / beta_slow).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


@dataclasses.dataclass(frozen=True)
class HParams:
    """Model hyperparameters as the GGUF metadata gives them (llama.cpp names)."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_type: str
    rope_freq_base: float
    rope_scaling: str  # "none", "linear" or "yarn"
    rope_scaling_factor: float  # 1.0 when not scaled
    n_ctx_orig_yarn: int
    rope_attn_factor: float
    n_swa: int  # sliding window in tokens; 0 = none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window (and the local rope base)
    rope_freq_base_swa: float
    final_logit_softcap: float  # 0 = none
    ffn_act: str  # "silu", "gelu" (tanh approximation) or "relu2"
    embd_scale: float  # input embeddings are multiplied by this


def _kv(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF metadata key {key} missing")
        return default
    return field.contents()


def load_hparams(reader: GGUFReader) -> HParams:
    arch = _kv(reader, "general.architecture")
    if arch not in ROPE_TYPE:
        raise ValueError(f"numpy reference has no forward for arch {arch!r}")

    def k(name, default=None):
        return _kv(reader, f"{arch}.{name}", default)

    n_embd = int(k("embedding_length"))
    n_layer = int(k("block_count"))
    n_head = int(k("attention.head_count"))
    head_dim_k = int(k("attention.key_length", n_embd // n_head))
    # llama.cpp's defaults: type "linear", factor absent (0) = unscaled.
    rope_scaling = str(k("rope.scaling.type", "linear"))
    factor = float(k("rope.scaling.factor", 0.0))
    if rope_scaling == "none" or factor in (0.0, 1.0):
        rope_scaling, factor = "none", 1.0
    if rope_scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"rope scaling {rope_scaling!r} not implemented in the numpy reference")
    n_ctx_train = int(k("context_length"))

    n_swa = int(k("attention.sliding_window", 0))
    swa_layers = (False,) * n_layer
    if arch == "gemma3" and n_swa > 0:
        pattern = k("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
        if isinstance(pattern, list):  # explicit per-layer flags
            swa_layers = tuple(bool(p) for p in pattern)
        else:  # every `pattern`-th layer is global, the others local
            swa_layers = tuple(il % pattern < pattern - 1 for il in range(n_layer))
    else:
        n_swa = 0

    ffn_act = {"gemma3": "gelu"}.get(arch, "silu")
    if arch == "bitnet":
        # BitNet b1.58 2B4T uses squared ReLU; older bitnet GGUFs (no key) SwiGLU.
        ffn_act = str(k("hidden_activation", "silu"))
        if ffn_act not in ("silu", "relu2"):
            raise ValueError(f"bitnet activation {ffn_act!r} not implemented in the numpy reference")

    tok_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return HParams(
        arch=arch,
        n_vocab=int(tok_embd.shape[1]),
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=int(k("feed_forward_length")),
        n_head=n_head,
        n_head_kv=int(k("attention.head_count_kv", n_head)),
        head_dim_k=head_dim_k,
        head_dim_v=int(k("attention.value_length", n_embd // n_head)),
        n_rot=int(k("rope.dimension_count", head_dim_k)),
        rms_eps=float(k("attention.layer_norm_rms_epsilon")),
        rope_type=ROPE_TYPE[arch],
        rope_freq_base=float(k("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rope_scaling_factor=factor,
        n_ctx_orig_yarn=int(k("rope.scaling.original_context_length", n_ctx_train)),
        rope_attn_factor=float(k("rope.scaling.attn_factor", 1.0)),
        n_swa=n_swa,
        swa_layers=swa_layers,
        rope_freq_base_swa=float(k("rope.freq_base_swa", GEMMA3_ROPE_FREQ_BASE_SWA)),
        final_logit_softcap=float(k("final_logit_softcapping", 0.0)) if arch == "gemma3" else 0.0,
        ffn_act=ffn_act,
        embd_scale=math.sqrt(n_embd) if arch == "gemma3" else 1.0,
    )


def load_weights(reader: GGUFReader) -> dict[str, np.ndarray]:
    """All tensors dequantized to float64, numpy shape = reversed GGML ne (e.g. [n_ff, n_embd])."""
    weights = {}
    for t in reader.tensors:
        data = dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weights[t.name] = np.asarray(data, dtype=np.float64).reshape(shape)
    return weights


class Model:
    """A GGUF file loaded for the reference forward (from its path, or gguf-py's reader of it)."""

    def __init__(self, source: str | Path | GGUFReader):
        reader = source if isinstance(source, GGUFReader) else GGUFReader(str(source))
        self.hp = load_hparams(reader)
        self.w = load_weights(reader)

    def hidden_states(self, tokens: list[int]) -> list[np.ndarray]:
        """The residual stream [n_tokens, n_embd] after the (scaled) embedding and after each layer.

        n_layer + 1 arrays; for locating the first layer where another forward diverges.
        """
        hp, w = self.hp, self.w
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= hp.n_vocab:
            raise ValueError(f"token id out of range [0, {hp.n_vocab})")
        pos = np.arange(len(tokens))

        states = [w["token_embd.weight"][tokens] * hp.embd_scale]
        for il in range(hp.n_layer):
            states.append(self._layer(il, states[-1], pos))
        return states

    def forward(self, tokens: list[int]) -> np.ndarray:
        """Logits [n_tokens, n_vocab] for every position of `tokens` (teacher-forced, from pos 0)."""
        hp, w = self.hp, self.w
        x = rms_norm(self.hidden_states(tokens)[-1], w["output_norm.weight"], hp.rms_eps)
        head = w.get("output.weight", w["token_embd.weight"])  # tied head when no output.weight
        logits = x @ head.T  # [n_tokens, n_vocab]
        if "output.bias" in w:
            logits = logits + w["output.bias"]
        if hp.final_logit_softcap:
            logits = hp.final_logit_softcap * np.tanh(logits / hp.final_logit_softcap)
        return logits

    def _linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """x @ W.T, times the BitNet per-tensor `.scale` and plus `.bias` when the file has them."""
        y = x @ self.w[f"{name}.weight"].T
        if f"{name}.scale" in self.w:
            y = y * self.w[f"{name}.scale"].reshape(())
        if f"{name}.bias" in self.w:
            y = y + self.w[f"{name}.bias"]
        return y

    def _layer(self, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        hp, w, b = self.hp, self.w, f"blk.{il}"
        n_tokens = x.shape[0]

        # --- attention block
        h = rms_norm(x, w[f"{b}.attn_norm.weight"], hp.rms_eps)
        q = self._linear(f"{b}.attn_q", h).reshape(n_tokens, hp.n_head, hp.head_dim_k)
        k = self._linear(f"{b}.attn_k", h).reshape(n_tokens, hp.n_head_kv, hp.head_dim_k)
        v = self._linear(f"{b}.attn_v", h).reshape(n_tokens, hp.n_head_kv, hp.head_dim_v)
        if f"{b}.attn_q_norm.weight" in w:  # qwen3 / gemma3: RMSNorm over each head's vector
            q = rms_norm(q, w[f"{b}.attn_q_norm.weight"], hp.rms_eps)
            k = rms_norm(k, w[f"{b}.attn_k_norm.weight"], hp.rms_eps)

        is_swa = hp.swa_layers[il]
        cos, sin = rope_cos_sin(hp, pos, is_swa, w.get("rope_freqs.weight"))
        q = apply_rope(q, cos, sin, hp.n_rot, hp.rope_type)
        k = apply_rope(k, cos, sin, hp.n_rot, hp.rope_type)

        attn = attention(q, k, v, pos, hp.n_swa if is_swa else 0)  # [n_tokens, n_head * head_dim_v]
        if f"{b}.attn_sub_norm.weight" in w:  # bitnet: norm before the output projection
            attn = rms_norm(attn, w[f"{b}.attn_sub_norm.weight"], hp.rms_eps)
        attn = self._linear(f"{b}.attn_output", attn)
        if f"{b}.post_attention_norm.weight" in w:  # gemma3: norm the block output
            attn = rms_norm(attn, w[f"{b}.post_attention_norm.weight"], hp.rms_eps)
        x = x + attn

        # --- feed-forward block: down(act(gate(h)) * up(h))
        h = rms_norm(x, w[f"{b}.ffn_norm.weight"], hp.rms_eps)
        a = ACTIVATIONS[hp.ffn_act](self._linear(f"{b}.ffn_gate", h)) * self._linear(f"{b}.ffn_up", h)
        if f"{b}.ffn_sub_norm.weight" in w:  # bitnet: norm before the down projection
            a = rms_norm(a, w[f"{b}.ffn_sub_norm.weight"], hp.rms_eps)
        f = self._linear(f"{b}.ffn_down", a)
        if f"{b}.post_ffw_norm.weight" in w:
            f = rms_norm(f, w[f"{b}.post_ffw_norm.weight"], hp.rms_eps)
        return x + f


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (HF "gelu_pytorch_tanh", Gemma's hidden_activation)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def relu2(x: np.ndarray) -> np.ndarray:
    """Squared ReLU (Primer; BitNet b1.58 2B4T)."""
    return np.maximum(x, 0.0) ** 2


ACTIVATIONS = {"silu": silu, "gelu": gelu_tanh, "relu2": relu2}


def rope_inv_freq(hp: HParams, is_swa: bool, freq_factors: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Per-pair angular frequency [n_rot/2] (radians per position) and the cos/sin magnitude scale.

    RoFormer: theta_i = base^(-2i/n_rot). Linear scaling divides positions by the factor; YaRN
    (Peng et al. 2023, HF _compute_yarn_parameters) blends interpolated and extrapolated
    frequencies over a ramp of pair indices and scales cos/sin by 0.1 ln(factor) + 1. Gemma 3's
    local (sliding-window) layers use their own base and no scaling.
    """
    n_pairs = hp.n_rot // 2
    base = hp.rope_freq_base_swa if is_swa else hp.rope_freq_base
    inv_freq = base ** (-np.arange(n_pairs, dtype=np.float64) * 2.0 / hp.n_rot)
    if freq_factors is not None:  # Llama 3.1 style per-pair divisors
        inv_freq = inv_freq / freq_factors
    scaling = "none" if is_swa else hp.rope_scaling
    factor = hp.rope_scaling_factor
    mscale = hp.rope_attn_factor
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "yarn":

        def correction_dim(n_rotations: float) -> float:
            # pair index whose wavelength fits n_rotations times into the original context
            return hp.n_rot * math.log(hp.n_ctx_orig_yarn / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
        high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), hp.n_rot - 1)
        ramp = np.clip((np.arange(n_pairs) - low) / max(high - low, 0.001), 0.0, 1.0)
        extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
        inv_freq = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
        if factor > 1.0:
            mscale *= 0.1 * math.log(factor) + 1.0
    return inv_freq, mscale


def rope_cos_sin(hp: HParams, pos: np.ndarray, is_swa: bool, freq_factors: np.ndarray | None):
    """cos, sin [n_tokens, n_rot/2] for positions `pos`."""
    inv_freq, mscale = rope_inv_freq(hp, is_swa, freq_factors)
    angle = pos[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(angle) * mscale, np.sin(angle) * mscale


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, rope_type: str) -> np.ndarray:
    """Rotate the first n_rot dims of each head. x [n_tokens, n_heads, head_dim]."""
    x = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if rope_type == ROPE_NORM:
        x0, x1 = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2] = x0 * c - x1 * s
        x[..., 1:n_rot:2] = x0 * s + x1 * c
    else:
        half = n_rot // 2
        x0, x1 = x[..., :half].copy(), x[..., half:n_rot].copy()
        x[..., :half] = x0 * c - x1 * s
        x[..., half:n_rot] = x0 * s + x1 * c
    return x


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, n_swa: int) -> np.ndarray:
    """Causal grouped-query attention, softmax(q k^T / sqrt(head_dim)) v.

    q [n_tokens, n_head, d_k], k [n_tokens, n_head_kv, d_k], v [n_tokens, n_head_kv, d_v]; query
    head h reads KV head h // (n_head / n_head_kv). With n_swa > 0 a query at position p sees keys
    at positions p - n_swa < j <= p (Gemma's sliding window, n_swa tokens including itself).
    Returns [n_tokens, n_head * d_v].
    """
    n_tokens, n_head, d_k = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [n_tokens, n_head, d_k]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d_k)  # [n_head, n_q, n_k]
    dist = pos[:, None] - pos[None, :]  # query pos - key pos
    masked = dist < 0
    if n_swa > 0:
        masked |= dist >= n_swa
    scores = np.where(masked[None], -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p, v)  # [n_tokens, n_head, d_v]
    return out.reshape(n_tokens, -1)


def hparams(path: str | Path) -> HParams:
    """Hyperparameters of the GGUF model at `path` (metadata only, weights not dequantized)."""
    return load_hparams(GGUFReader(str(path)))


def forward(path: str | Path, tokens: list[int]) -> np.ndarray:
    """Logits [n_tokens, n_vocab] (float64) of the GGUF model at `path` for every position."""
    return Model(path).forward(tokens)
