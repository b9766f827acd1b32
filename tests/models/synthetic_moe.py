"""Synthetic MoE GGUF models with the exact tensor names, shapes and metadata of real architectures.

Architectures (names as llama.cpp's `general.architecture`):
  qwen2moe   routed experts + one shared expert behind a sigmoid gate (`ffn_gate_inp_shexp`),
             q/k/v biases, softmax routing without renormalisation.
  qwen3moe   routed experts, top-k renormalisation (norm_topk_prob), per-head q/k RMS norm.
  llama      Mixtral: `llama.expert_count`, experts of width `feed_forward_length`, renormalised
             softmax top-k.
  deepseek2  MLA attention (optional q LoRA, latent KV with a rope/no-rope head split, stored as the
             split `attn_k_b`/`attn_v_b` that convert_hf_to_gguf writes today), leading dense
             layers, shared experts; variant "v2" / "v2-lite" (softmax, with / without q LoRA) or
             "v3" (sigmoid + `exp_probs_b` selection bias, group-limited top-k, renormalised and
             scaled weights).

Shapes follow llama.cpp's `create_tensor` calls (src/models/<arch>.cpp). Comments give them in GGML
order [ne0, ne1, ...] like llama.cpp; numpy arrays are the reverse (a weight [n_in, n_out] in GGML
order is an (n_out, n_in) numpy array; an expert stack [n_embd, n_ff_exp, n_expert] is
(n_expert, n_ff_exp, n_embd)).

Weights are deterministic (seeded per tensor name) and scaled by 1/sqrt(fan_in) so every matmul
keeps unit-variance activations; RMS norms keep the residual stream bounded. The output head is
scaled up so the logits have a clear top-1 (a flat distribution would make top-1 comparisons a
coin toss).

Files are written tensor by tensor (the writer never holds more than one tensor), so bench
presets of several GB fit in a few hundred MB of RAM. Types F32/F16/BF16/Q8_0 are written
directly; any other llama.cpp file type (Q4_K_M, ...) is produced from an F16 file with
llama.cpp's quantizer through llama-cpp-python.

    python -m tests.models.synthetic_moe --preset bench --arch deepseek2 --wtype Q4_K_M
writes to ${KTD_CACHE:-~/.cache/ktd}/synthetic/ (never into the repository). Presets: tiny (the
tests'), bench (a few layers of Qwen3-30B-A3B and DeepSeek-V2-Lite, for the benchmarks) and dram
(their real layer counts with a quarter of the experts: a token reads what the real model reads,
1.6-1.9 GB, so decode streams from DRAM even on a CPU with a 300-480 MiB L3).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

ARCHS = ("qwen2moe", "qwen3moe", "llama", "deepseek2")
VARIANTS = {"qwen2moe": (None,), "qwen3moe": (None,), "llama": (None,), "deepseek2": ("v2", "v2-lite", "v3")}

# Tokens 0..2 are <unk>, <s>, </s>; then the 256 byte tokens llama.cpp's SPM vocabulary needs
# (it looks up <0x0A> for the newline token); the rest are filler pieces.
_N_SPECIAL = 3
_N_BYTE = 256


@dataclass(frozen=True)
class MoeConfig:
    """Hyperparameters of one synthetic model. Names follow llama.cpp's llama_hparams."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head: int  # head size (q/k/v) for non-MLA archs
    n_ff: int  # dense FFN width (deepseek2 leading layers, qwen2moe metadata); Mixtral expert width
    n_expert: int
    n_expert_used: int
    n_ff_exp: int = 0  # routed expert width (qwen*, deepseek2)
    n_expert_shared: int = 0  # deepseek2: shared experts, fused into one FFN of n_ff_exp * count
    n_ff_shexp: int = 0  # qwen2moe: shared expert width
    n_layer_dense_lead: int = 0
    q_lora_rank: int = 0  # 0: plain wq (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    gating: str = "softmax"  # "softmax" | "sigmoid"
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    n_expert_groups: int = 0
    n_group_used: int = 0
    exp_probs_b: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    n_ctx_train: int = 4096
    logit_gain: float = 4.0  # output head scale over 1/sqrt(n_embd): logits with std ~ logit_gain


def _tiny(arch: str, variant: str | None) -> MoeConfig:
    common = dict(arch=arch, n_vocab=320, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_embd_head=16,
                  n_ff=96, n_expert=8, n_expert_used=2)
    if arch == "qwen2moe":
        return MoeConfig(**common, n_ff_exp=32, n_ff_shexp=48, qkv_bias=True)
    if arch == "qwen3moe":
        # head size 32: q is 128 wide while n_embd is 64, as in Qwen3-30B-A3B (4096 vs 2048)
        return MoeConfig(**{**common, "n_embd_head": 32, "n_expert_used": 3}, n_ff_exp=32, qk_norm=True,
                         expert_weights_norm=True, rope_theta=1e6)
    if arch == "llama":
        return MoeConfig(**{**common, "n_ff": 48}, expert_weights_norm=True)
    if arch == "deepseek2":
        mla = dict(n_layer_dense_lead=1, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                   v_head_dim=32, n_ff_exp=32, n_expert_shared=2)
        base = {**common, "n_layer": 3, "n_head_kv": 1}
        if variant == "v2":
            return MoeConfig(**base, **mla, q_lora_rank=64, expert_weights_scale=1.5)
        if variant == "v2-lite":
            return MoeConfig(**base, **mla, q_lora_rank=0)
        if variant == "v3":
            return MoeConfig(**{**base, "n_expert_used": 3}, **mla, q_lora_rank=64, gating="sigmoid",
                             exp_probs_b=True, n_expert_groups=4, n_group_used=2, expert_weights_norm=True,
                             expert_weights_scale=2.5)
    raise ValueError(f"no tiny preset for arch {arch!r} variant {variant!r}")


def _bench(arch: str, variant: str | None) -> MoeConfig:
    if arch == "deepseek2" and variant in (None, "v2"):
        # DeepSeek-V2-Lite shape with the q LoRA of the full V2 (docs/MODELS.md), 10 layers instead of 27.
        # No YaRN (the real file has factor 40): it changes rope frequencies and the kq scale, not the work.
        return MoeConfig(arch="deepseek2", n_vocab=102400, n_embd=2048, n_layer=10, n_head=16, n_head_kv=1,
                         n_embd_head=0, n_ff=10944, n_expert=64, n_expert_used=6, n_ff_exp=1408,
                         n_expert_shared=2, n_layer_dense_lead=1, q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_ctx_train=163840)
    if arch == "qwen3moe":
        # Qwen3-30B-A3B shape, 12 layers instead of 48
        return MoeConfig(arch="qwen3moe", n_vocab=151936, n_embd=2048, n_layer=12, n_head=32, n_head_kv=4,
                         n_embd_head=128, n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, qk_norm=True,
                         expert_weights_norm=True, rope_theta=1e6, n_ctx_train=40960)
    if arch == "deepseek2" and variant == "v3":
        # DeepSeek-V3/R1 shaped (the dynamic i-quant check, `--dynamic-iq`): its MLA (q LoRA 1536, kv
        # LoRA 512, 128 + 64 / 128 head dims), vocabulary, sigmoid routing with the selection bias,
        # group-limited top-8 (4 of 8 groups), one shared expert, renormalised x2.5 weights; narrower
        # (2048 wide, 64 experts of 768, 4 layers) so it is a few minutes to make. Expert rows are
        # whole 256-blocks, as the i-quants need.
        return MoeConfig(arch="deepseek2", n_vocab=129280, n_embd=2048, n_layer=4, n_head=16, n_head_kv=1,
                         n_embd_head=0, n_ff=6144, n_expert=64, n_expert_used=8, n_ff_exp=768,
                         n_expert_shared=1, n_layer_dense_lead=1, q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, gating="sigmoid",
                         exp_probs_b=True, n_expert_groups=8, n_group_used=4, expert_weights_norm=True,
                         expert_weights_scale=2.5, n_ctx_train=163840)
    raise ValueError(f"no bench preset for arch {arch!r} variant {variant!r} (bench presets: deepseek2 v2 and v3, "
                     "qwen3moe)")


def _dram(arch: str, variant: str | None) -> MoeConfig:
    # Decode from DRAM on a CPU with a large last-level cache: the bench files read 665-713 MB a
    # token, which a 300-480 MiB L3 holds in good part. These read what the real models read a
    # token and keep the files small enough to write in minutes and map in RAM by holding a quarter
    # of the experts per layer: Qwen3-30B-A3B's 48 layers, 8 routed experts of 768 (~1.9 GB at
    # Q4_K_M, 32 of 128 experts, a 5.3 GB file); DeepSeek-V2-Lite's 27 layers, plain wq (no q
    # LoRA: llama.cpp takes a 27-layer deepseek2 for V2-Lite and will not load one with it), 6
    # routed + 2 shared experts of 1408 (~1.6 GB, 16 of 64, a 3.2 GB file). Every matrix has the
    # real shape, so per-matrix costs are the real model's.
    if arch == "qwen3moe":
        return dataclasses.replace(_bench(arch, variant), n_layer=48, n_expert=32)
    if arch == "deepseek2" and variant == "v2-lite":
        return dataclasses.replace(_bench(arch, "v2"), n_layer=27, n_expert=16, q_lora_rank=0)
    raise ValueError(f"no dram preset for arch {arch!r} variant {variant!r} (dram presets: qwen3moe, "
                     "deepseek2 v2-lite)")


PRESETS = {"tiny": _tiny, "bench": _bench, "dram": _dram}
# The archs a preset writes when --arch is not given, and the variant of an arch a preset takes
# when none is given (else the arch's first).
PRESET_ARCHS = {"tiny": ARCHS, "bench": ("deepseek2", "qwen3moe"), "dram": ("deepseek2", "qwen3moe")}
PRESET_VARIANTS = {("dram", "deepseek2"): "v2-lite"}


def default_variant(arch: str, preset: str = "tiny") -> str | None:
    """The variant `config` and `make_model` use for (arch, preset) when none is given."""
    return PRESET_VARIANTS.get((preset, arch), VARIANTS[arch][0])


def config(arch: str, preset: str = "tiny", variant: str | None = None) -> MoeConfig:
    """The hyperparameters `make_model` uses for (arch, preset, variant)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    if variant is None:
        variant = default_variant(arch, preset)
    if variant not in VARIANTS[arch]:
        raise ValueError(f"arch {arch!r} has variants {VARIANTS[arch]}, not {variant!r}")
    return PRESETS[preset](arch, variant)


# ---- tensor table -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGML order reversed)
    kind: str  # "matrix" (scaled 1/sqrt(fan_in)), "norm" (around 1), "bias", "embd", "output", "probs_b"
    fan_in: int = 1


def _m(name: str, n_in: int, *outer: int) -> _Tensor:
    """A weight [n_in, *reversed(outer)] in GGML order; numpy shape (*outer, n_in)."""
    return _Tensor(name, (*outer, n_in), "matrix", n_in)


def tensor_table(cfg: MoeConfig) -> list[_Tensor]:
    """Every tensor of the model, in the order llama.cpp's converter writes them."""
    n_embd, n_head = cfg.n_embd, cfg.n_head
    t: list[_Tensor] = [_Tensor("token_embd.weight", (cfg.n_vocab, n_embd), "embd")]
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        t.append(_Tensor(b + "attn_norm.weight", (n_embd,), "norm"))
        if cfg.arch == "deepseek2":
            n_embd_head_k = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.q_lora_rank > 0:
                t += [_m(b + "attn_q_a.weight", n_embd, cfg.q_lora_rank),                # [n_embd, q_lora_rank]
                      _Tensor(b + "attn_q_a_norm.weight", (cfg.q_lora_rank,), "norm"),
                      _m(b + "attn_q_b.weight", cfg.q_lora_rank, n_head * n_embd_head_k)]  # [q_lora_rank, n_head*n_embd_head_k]
            else:
                t.append(_m(b + "attn_q.weight", n_embd, n_head * n_embd_head_k))        # [n_embd, n_head*n_embd_head_k]
            t += [_m(b + "attn_kv_a_mqa.weight", n_embd, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                  _Tensor(b + "attn_kv_a_norm.weight", (cfg.kv_lora_rank,), "norm"),
                  # [qk_nope, kv_lora_rank, n_head]: per head, latent -> k_nope (stored transposed)
                  _Tensor(b + "attn_k_b.weight", (n_head, cfg.kv_lora_rank, cfg.qk_nope_head_dim), "matrix",
                          cfg.kv_lora_rank),
                  # [kv_lora_rank, v_head_dim, n_head]: per head, latent -> v
                  _m(b + "attn_v_b.weight", cfg.kv_lora_rank, n_head, cfg.v_head_dim),
                  _m(b + "attn_output.weight", n_head * cfg.v_head_dim, n_embd)]
        else:
            n_q = n_head * cfg.n_embd_head
            n_kv = cfg.n_head_kv * cfg.n_embd_head
            t += [_m(b + "attn_q.weight", n_embd, n_q), _m(b + "attn_k.weight", n_embd, n_kv),
                  _m(b + "attn_v.weight", n_embd, n_kv)]
            if cfg.qkv_bias:
                t += [_Tensor(b + "attn_q.bias", (n_q,), "bias"), _Tensor(b + "attn_k.bias", (n_kv,), "bias"),
                      _Tensor(b + "attn_v.bias", (n_kv,), "bias")]
            if cfg.qk_norm:
                t += [_Tensor(b + "attn_q_norm.weight", (cfg.n_embd_head,), "norm"),
                      _Tensor(b + "attn_k_norm.weight", (cfg.n_embd_head,), "norm")]
            t.append(_m(b + "attn_output.weight", n_q, n_embd))
        t.append(_Tensor(b + "ffn_norm.weight", (n_embd,), "norm"))
        if il < cfg.n_layer_dense_lead:
            t += [_m(b + "ffn_gate.weight", n_embd, cfg.n_ff), _m(b + "ffn_up.weight", n_embd, cfg.n_ff),
                  _m(b + "ffn_down.weight", cfg.n_ff, n_embd)]
            continue
        n_ff_exp = cfg.n_ff if cfg.arch == "llama" else cfg.n_ff_exp
        t.append(_m(b + "ffn_gate_inp.weight", n_embd, cfg.n_expert))                   # [n_embd, n_expert]
        if cfg.exp_probs_b:
            t.append(_Tensor(b + "exp_probs_b.bias", (cfg.n_expert,), "probs_b"))
        t += [_m(b + "ffn_gate_exps.weight", n_embd, cfg.n_expert, n_ff_exp),          # [n_embd, n_ff_exp, n_expert]
              _m(b + "ffn_up_exps.weight", n_embd, cfg.n_expert, n_ff_exp),            # [n_embd, n_ff_exp, n_expert]
              _m(b + "ffn_down_exps.weight", n_ff_exp, cfg.n_expert, n_embd)]          # [n_ff_exp, n_embd, n_expert]
        n_ff_shexp = cfg.n_ff_shexp if cfg.arch == "qwen2moe" else cfg.n_ff_exp * cfg.n_expert_shared
        if cfg.arch == "qwen2moe":
            t.append(_Tensor(b + "ffn_gate_inp_shexp.weight", (n_embd,), "matrix", n_embd))  # [n_embd]
        if n_ff_shexp > 0:
            t += [_m(b + "ffn_gate_shexp.weight", n_embd, n_ff_shexp), _m(b + "ffn_up_shexp.weight", n_embd, n_ff_shexp),
                  _m(b + "ffn_down_shexp.weight", n_ff_shexp, n_embd)]
    t += [_Tensor("output_norm.weight", (n_embd,), "norm"), _Tensor("output.weight", (cfg.n_vocab, n_embd), "output", n_embd)]
    return t


def _values(cfg: MoeConfig, spec: _Tensor, seed: int) -> np.ndarray:
    """Deterministic float32 values of one tensor: seeded by (seed, name), independent of order."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
    if spec.kind == "bias":
        return (0.1 * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
    if spec.kind == "probs_b":
        # positive and comparable to the sigmoid scores, so it changes which experts win
        return rng.uniform(0.0, 0.2, spec.shape).astype(np.float32)
    if spec.kind == "embd":
        return rng.standard_normal(spec.shape, dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(spec.fan_in))
    if spec.kind == "output":
        scale *= np.float32(cfg.logit_gain)
    out = np.empty(spec.shape, dtype=np.float32)
    rng.standard_normal(out=out.reshape(-1), dtype=np.float32)
    out *= scale
    return out


# ---- metadata -----------------------------------------------------------------------------------

def _add_metadata(w: gguf.GGUFWriter, cfg: MoeConfig, name: str) -> None:
    a = cfg.arch
    w.add_name(name)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_vocab_size(cfg.n_vocab)
    if a == "deepseek2":
        # MLA as convert_hf_to_gguf writes it now: the cache holds one "kv head" of the latent
        # (kv_lora_rank) plus the shared rope part; *_mla give the decompressed head sizes.
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)
        # llama.cpp requires the key unless n_layer says "Lite"; 0 selects the plain wq path.
        w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_leading_dense_block_count(cfg.n_layer_dense_lead)
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
        w.add_expert_shared_count(cfg.n_expert_shared)
        w.add_expert_weights_scale(cfg.expert_weights_scale)
        w.add_expert_weights_norm(cfg.expert_weights_norm)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.gating == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
        if cfg.n_expert_groups > 0:
            w.add_expert_group_count(cfg.n_expert_groups)
            w.add_expert_group_used_count(cfg.n_group_used)
    else:
        w.add_key_length(cfg.n_embd_head)
        w.add_value_length(cfg.n_embd_head)
        w.add_rope_dimension_count(cfg.n_embd_head)
        if a in ("qwen2moe", "qwen3moe"):
            w.add_expert_feed_forward_length(cfg.n_ff_exp)
        if a == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    _add_tokenizer(w, cfg.n_vocab)


def _add_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A minimal SentencePiece vocabulary llama.cpp accepts; tests feed token ids directly."""
    if n_vocab < _N_SPECIAL + _N_BYTE:
        raise ValueError(f"n_vocab {n_vocab} < {_N_SPECIAL + _N_BYTE} (special + byte tokens)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(_N_BYTE)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * _N_BYTE + [gguf.TokenType.NORMAL] * (n_vocab - _N_SPECIAL - _N_BYTE))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * _N_SPECIAL + [0.0] * _N_BYTE + [-float(i) for i in range(n_vocab - _N_SPECIAL - _N_BYTE)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


# ---- writing ------------------------------------------------------------------------------------

_DIRECT = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0}


def _tensor_type(spec: _Tensor, wtype: QT) -> QT:
    """1-D tensors (norms, biases, the shared-expert gate vector) stay F32, as the converter keeps
    them; a matrix whose rows do not fill whole blocks of `wtype` falls back to F16."""
    if len(spec.shape) < 2 or wtype == QT.F32:
        return QT.F32
    block, _ = gguf.GGML_QUANT_SIZES[wtype]
    return wtype if spec.shape[-1] % block == 0 else QT.F16


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def _write_direct(cfg: MoeConfig, path: Path, wtype: QT, seed: int, name: str) -> None:
    table = tensor_table(cfg)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, cfg.arch)
    _add_metadata(w, cfg, name)
    w.add_file_type({QT.F32: gguf.LlamaFileType.ALL_F32, QT.F16: gguf.LlamaFileType.MOSTLY_F16,
                     QT.BF16: gguf.LlamaFileType.MOSTLY_BF16, QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[wtype])
    types = [_tensor_type(s, wtype) for s in table]
    for spec, qtype in zip(table, types):
        n_elem = int(np.prod(spec.shape))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = n_elem // block * type_size
        if qtype in (QT.F32, QT.F16):
            w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32 if qtype == QT.F32 else np.float16), nbytes)
        else:
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * type_size)
            w.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    written = False
    try:
        for spec, qtype in zip(table, types):
            w.write_tensor_data(_encode(_values(cfg, spec, seed), qtype))
        written = True
    finally:
        w.close()
        if not written:
            tmp.unlink(missing_ok=True)
    tmp.replace(path)


def _llama_ftype(wtype: str) -> int:
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(f"wtype {wtype} needs llama.cpp's quantizer (llama-cpp-python): {e}") from e
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{wtype}", None)
    if ftype is None:
        raise ValueError(f"unknown wtype {wtype!r}: not one of {tuple(_DIRECT)} nor a llama.cpp file type")
    return ftype


def quantize(src: Path, dst: Path, wtype: str) -> None:
    """Quantize GGUF `src` to llama.cpp file type `wtype` (e.g. "Q4_K_M") at `dst` with llama.cpp's quantizer."""
    ftype = _llama_ftype(wtype)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {wtype}) failed with {rc}")
    tmp.replace(dst)


def make_model(arch: str, path: str | os.PathLike[str], *, preset: str = "tiny", wtype: str = "F32", seed: int = 0,
               variant: str | None = None, cfg: MoeConfig | None = None) -> Path:
    """Write a synthetic `arch` model to `path` and return the path.

    `variant` picks a deepseek2 flavour ("v2", "v2-lite", "v3"); `cfg` overrides the preset
    entirely (e.g. `dataclasses.replace(config(...), n_layer=1)`). Same arguments, same bytes.
    """
    if variant is None and arch in VARIANTS:
        variant = default_variant(arch, preset)
    cfg = cfg if cfg is not None else config(arch, preset, variant)
    if cfg.arch != arch:
        raise ValueError(f"cfg is for arch {cfg.arch!r}, not {arch!r}")
    if cfg.n_expert_groups and (cfg.n_expert % cfg.n_expert_groups or cfg.n_group_used >= cfg.n_expert_groups
                                or cfg.n_expert // cfg.n_expert_groups < 2):
        raise ValueError("n_expert_groups must divide n_expert into groups of >= 2 and exceed n_group_used")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = f"synthetic-{arch}{'-' + variant if variant else ''}-{preset}"
    if wtype not in _DIRECT:
        _llama_ftype(wtype)  # fail before writing GB of F16
    # the direct write, or the F16 input of the quantizer plus its (smaller) output
    n_params = sum(int(np.prod(t.shape)) for t in tensor_table(cfg))
    n_bytes = n_params * ({"F32": 4, "F16": 2, "BF16": 2, "Q8_0": 1.0625}[wtype] if wtype in _DIRECT else 4)
    free = shutil.disk_usage(path.parent).free
    if n_bytes > free:
        raise RuntimeError(f"{path.parent}: {free / 1e9:.1f} GB free, writing this model needs ~{n_bytes / 1e9:.1f} GB")
    if wtype in _DIRECT:
        _write_direct(cfg, path, _DIRECT[wtype], seed, name)
        return path
    f16 = path.with_name(path.name + ".f16.tmp")
    try:
        _write_direct(cfg, f16, QT.F16, seed, name)
        quantize(f16, path, wtype)
    finally:
        f16.unlink(missing_ok=True)
    return path


# ---- "dynamic" i-quant files (DeepSeek-V3/R1, Qwen3-235B low-bit GGUFs) -------------------------

# The expert stacks' types of the 1.58-bit DeepSeek dynamic quants: gate/up in IQ1_S, down one
# step up. Everything else comes from llama.cpp's Q4_K_M (Q4_K/Q6_K, with its fallbacks for rows
# that are no whole number of 256-blocks).
DYNAMIC_EXPERT_TYPES = {"ffn_gate_exps": "IQ1_S", "ffn_up_exps": "IQ1_S", "ffn_down_exps": "IQ2_XXS"}

# Bytes per 256-block and the offset of the fp16 block scale d (None: IQ1_M, whose d is split over
# the top nibbles of the 4 uint16 at bytes 48..55).
_IQ_BLOCKS = {"IQ1_S": (50, 0), "IQ1_M": (56, None), "IQ2_XXS": (66, 0), "IQ2_XS": (74, 0), "IQ2_S": (82, 0),
              "IQ3_XXS": (98, 0), "IQ3_S": (110, 0)}


def set_iq_block_scale(qt: str, blocks: np.ndarray, d: np.ndarray) -> None:
    """Write fp16 block scales d [nb] into i-quant blocks [nb, size] (in place)."""
    _, off = _IQ_BLOCKS[qt]
    bits = d.astype(np.float16).view(np.uint16)
    if off is not None:
        blocks[:, off:off + 2] = bits.view(np.uint8).reshape(-1, 2)
        return
    sc = blocks[:, 48:56].copy().view(np.uint16).reshape(-1, 4)
    for i in range(4):
        sc[:, i] = (sc[:, i] & np.uint16(0x0FFF)) | (((bits >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12))
    blocks[:, 48:56] = sc.view(np.uint8).reshape(-1, 8)


def random_scaled_blocks(qt: str, size: int, set_scale, n_rows: int, k: int, rng: np.random.Generator,
                         std: float) -> np.ndarray:
    """Random valid `qt` blocks of 256 weights and `size` bytes for n_rows rows of k weights
    ([n_rows, row bytes] uint8) whose dequantized values have about standard deviation `std`, for
    a type where every bit pattern but the fp16 block scale is a valid code: those bytes are random,
    and set_scale(blocks, d) writes the scales d [nb], set from gguf-py's dequantization of the same
    blocks at scale 1 (times a random 0.75..1.25)."""
    if k % 256:
        raise ValueError(f"{qt} rows need a multiple of 256 weights, not {k}")
    nb = n_rows * k // 256
    blocks = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    set_scale(blocks, np.ones(nb, np.float32))
    unit = gguf.quants.dequantize(blocks[: min(nb, 4096)], QT[qt]).astype(np.float64)
    set_scale(blocks, std / max(float(unit.std()), 1e-30) * rng.uniform(0.75, 1.25, nb))
    return blocks.reshape(n_rows, k // 256 * size)


def random_iq_blocks(qt: str, n_rows: int, k: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random valid `qt` i-quant blocks (random_scaled_blocks): every bit pattern of the index,
    sign, scale and shift fields is a valid code."""
    return random_scaled_blocks(qt, _IQ_BLOCKS[qt][0], lambda b, d: set_iq_block_scale(qt, b, d), n_rows, k, rng,
                                std)


def make_dynamic_iq(arch: str, path: str | os.PathLike[str], *, cfg: MoeConfig, seed: int = 0,
                    expert_types: dict[str, str] | None = None, base_wtype: str = "Q4_K_M") -> Path:
    """A file laid out like the low-bit "dynamic" quants: llama.cpp's Q4_K_M of the model (or
    `base_wtype`: F32 isolates the i-quant experts as the only quantized weights), then the
    routed expert stacks replaced by random valid i-quant blocks (llama.cpp's quantizer refuses
    IQ1/IQ2 types without an importance matrix), `expert_types` {tensor suffix: type}, default
    DYNAMIC_EXPERT_TYPES, scaled like the float weights (1/sqrt(fan_in)). Written tensor by tensor."""
    expert_types = dict(DYNAMIC_EXPERT_TYPES if expert_types is None else expert_types)
    path = Path(path)
    base = path.with_name(path.name + ".base.tmp")
    try:
        make_model(arch, base, wtype=base_wtype, cfg=cfg, seed=seed)
        r = gguf.GGUFReader(str(base))
        tmp = path.with_name(path.name + ".part")
        w = gguf.GGUFWriter(tmp, arch)
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
            else:
                w.add_key_value(key, f.contents(), f.types[0])
        plan = []  # (tensor, new type name or None)
        for t in r.tensors:
            suffix = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
            qt = expert_types.get(suffix)
            k = int(t.shape[0])
            if qt is not None and k % 256 == 0:
                outer = tuple(int(x) for x in reversed(t.shape[1:]))
                size, _ = _IQ_BLOCKS[qt]
                byte_shape = (*outer, k // 256 * size)
                w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=QT[qt])
                plan.append((t, qt))
            else:
                data = t.data
                raw = None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type
                w.add_tensor_info(t.name, data.shape, data.dtype, int(t.n_bytes), raw_dtype=raw)
                plan.append((t, None))
        if not any(qt for _, qt in plan):
            w.close()
            tmp.unlink(missing_ok=True)
            raise ValueError(f"no routed expert stack of {arch} has rows of whole 256-blocks: nothing to make an i-quant")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, qt in plan:
            if qt is None:
                w.write_tensor_data(np.asarray(t.data))
                continue
            k = int(t.shape[0])
            n_rows = int(np.prod([int(x) for x in t.shape[1:]]))
            rng = np.random.default_rng([seed, zlib.crc32(t.name.encode()), 1])
            outer = tuple(int(x) for x in reversed(t.shape[1:]))
            w.write_tensor_data(random_iq_blocks(qt, n_rows, k, rng, 1.0 / np.sqrt(k)).reshape(*outer, -1))
        w.close()
        tmp.replace(path)
    finally:
        base.unlink(missing_ok=True)
    return path


def check_llama_cpp(path: str | os.PathLike[str], n_tokens: int = 8) -> np.ndarray:
    """Load `path` in llama.cpp and run `n_tokens` teacher-forced tokens; return their logits
    (n_tokens, n_vocab). Raises RuntimeError if llama.cpp cannot load or run the file or the
    logits are not finite: the proof that the layout is one llama.cpp accepts."""
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(f"checking with llama.cpp needs llama-cpp-python: {e}") from e
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(32, n_tokens), n_batch=max(32, n_tokens),
                              logits_all=True, n_threads=os.cpu_count() or 1, verbose=False)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        raise RuntimeError(f"llama.cpp cannot load {path}: {e}") from e
    tokens = (np.arange(n_tokens) * 7919 % (llm.n_vocab() - _N_SPECIAL) + _N_SPECIAL).tolist()
    llm.eval(tokens)
    logits = np.array(llm.scores[:n_tokens])
    llm.close()
    if not np.isfinite(logits).all():
        raise RuntimeError(f"llama.cpp produced non-finite logits for {path}")
    return logits


def cache_dir() -> Path:
    """${KTD_CACHE:-~/.cache/ktd}/synthetic: generated files live outside the repository."""
    return Path(os.environ.get("KTD_CACHE") or Path.home() / ".cache" / "ktd") / "synthetic"


def default_path(arch: str, preset: str, wtype: str, variant: str | None = None, seed: int = 0) -> Path:
    v = f"-{variant}" if variant else ""
    return cache_dir() / f"{arch}{v}-{preset}-{wtype.lower()}-s{seed}.gguf"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.models.synthetic_moe", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    p.add_argument("--arch", choices=ARCHS, action="append", help="repeatable; default: all with the preset")
    p.add_argument("--variant", default=None)
    p.add_argument("--wtype", default=None, help="F32, F16, BF16, Q8_0 or a llama.cpp file type such as Q4_K_M "
                                                  "(default: F32 for tiny, Q4_K_M for the others)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="output file (one arch only)")
    p.add_argument("--check", action="store_true", help="then load and run each file in llama.cpp")
    p.add_argument("--dynamic-iq", action="store_true",
                   help="lay the file out like the low-bit dynamic quants: routed experts as random valid i-quant "
                        "blocks (gate/up IQ1_S, down IQ2_XXS) over the --wtype file (default Q4_K_M)")
    args = p.parse_args(argv)
    wtype = args.wtype or ("F32" if args.preset == "tiny" and not args.dynamic_iq else "Q4_K_M")
    archs = args.arch or list(PRESET_ARCHS[args.preset])
    if args.out and len(archs) != 1:
        p.error("--out needs exactly one --arch")
    for arch in archs:
        variant = args.variant if args.variant is not None else default_variant(arch, args.preset)
        out = args.out or default_path(arch, args.preset, ("dyn-iq-" if args.dynamic_iq else "") + wtype, variant, args.seed)
        t0 = time.monotonic()
        try:
            if args.dynamic_iq:
                make_dynamic_iq(arch, out, cfg=config(arch, args.preset, variant), seed=args.seed, base_wtype=wtype)
            else:
                make_model(arch, out, preset=args.preset, wtype=wtype, seed=args.seed, variant=variant)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"{out}  {out.stat().st_size / 1e9:.3f} GB  {time.monotonic() - t0:.0f} s", flush=True)
        if args.check:
            t0 = time.monotonic()
            try:
                check_llama_cpp(out)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"  llama.cpp loads and runs it ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
