"""Tiny random GGUF models of every dense architecture, laid out exactly as llama.cpp loads them.

Each file has the tensor names of gguf-py's MODEL_TENSORS table, the shapes llama.cpp's
`load_arch_tensors` creates, and the metadata its `load_hparams` reads, with deterministic random
weights (seeded) scaled so that activations stay O(1). The files are test fixtures for the native
forward and for the numpy reference (tests/reference/numpy_forward.py); llama.cpp loading and
running them is what shows the layout is right (tests/model/test_reference_forward.py).

Shapes: numpy arrays are [out_features, in_features] (row-major), i.e. GGML ne = {in, out}:
`blk.N.ffn_gate.weight` is numpy [n_ff, n_embd] == llama.cpp {n_embd, n_ff}.

Usage as a script: `python tests/models/tiny_dense.py [--arch A] [--wtype T] [--out DIR]` writes
files into ${KTD_CACHE:-~/.cache/ktd}/tiny/ (never into the repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import numpy as np
from gguf import (MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter,
                  LlamaFileType, RopeScalingType, TokenType)
from gguf.quants import quantize

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "bitnet"]

# Variants per arch (None is the default layout of the arch).
#   mistral:     llama metadata with a Mistral-like shape (GQA 4:1, rope base 1e6)
#   rope_linear: linear rope scaling (factor 4) in metadata
#   rope_yarn:   YaRN rope scaling (factor 4, original context 4096)
#   rope_freqs:  Llama-3.1-style per-dimension frequency factors in a `rope_freqs.weight` tensor
#   tied:        no output.weight; the head is token_embd
#   softcap:     gemma3 with final_logit_softcapping = 30 in metadata
#   swa_layers:  gemma3 with an explicit per-layer sliding_window_pattern array (every 3rd layer
#                global) instead of llama.cpp's default of every 6th
#   relu2:       bitnet with `bitnet.hidden_activation = "relu2"` (BitNet b1.58 2B4T); the default
#                bitnet is SwiGLU, which is what llama.cpp's bitnet graph uses when the key is absent
#   folded:      bitnet without per-tensor `.scale` tensors, the scale folded into the weights
#                (what convert_hf_to_gguf writes for 1bitLLM/bitnet_b1_58 checkpoints)
VARIANTS: dict[str, list[str | None]] = {
    "llama": [None, "mistral", "rope_linear", "rope_yarn", "rope_freqs"],
    "qwen2": [None, "tied"],
    "qwen3": [None, "tied"],
    "gemma3": [None, "softcap", "rope_linear", "swa_layers"],
    "bitnet": [None, "relu2", "folded"],
}

# Weight types the generator writes for 2-D matmul weights (norms, biases and scales stay F32).
# Q*_0 need rows that are multiples of 32, TQ*_0 multiples of 256 (only bitnet has those dims).
WTYPES_COMMON = ["F32", "F16", "Q8_0", "Q5_0", "Q4_0"]
WTYPES_TERNARY = ["TQ2_0", "TQ1_0"]
# Accepted by make_model but not listed by wtypes_for (so tests that go over every type skip it):
# a type the CPU runs and the CUDA device has no kernel for (its refusal is tested).
WTYPES_EXTRA = ["Q4_1"]


def wtypes_for(arch: str) -> list[str]:
    """Weight types make_model accepts for `arch`."""
    return WTYPES_COMMON + (WTYPES_TERNARY if arch == "bitnet" else [])


_QTYPE = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "Q8_0": GGMLQuantizationType.Q8_0,
    "Q5_0": GGMLQuantizationType.Q5_0,
    "Q4_0": GGMLQuantizationType.Q4_0,
    "Q4_1": GGMLQuantizationType.Q4_1,
    "TQ2_0": GGMLQuantizationType.TQ2_0,
    "TQ1_0": GGMLQuantizationType.TQ1_0,
}
_FTYPE = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "TQ2_0": LlamaFileType.MOSTLY_TQ2_0,
    "TQ1_0": LlamaFileType.MOSTLY_TQ1_0,
}


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """Hyperparameters of one tiny model (llama.cpp names)."""

    n_vocab: int = 320
    n_ctx_train: int = 4096
    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 96
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None: n_embd / n_head, no key_length/value_length in metadata
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0


def shape_for(arch: str, variant: str | None = None) -> TinyShape:
    """The shape make_model uses for (arch, variant)."""
    if arch == "llama":
        if variant == "mistral":
            return TinyShape(n_embd=128, n_head=8, n_head_kv=2, n_ff=160, rope_freq_base=1e6, rms_eps=1e-5)
        return TinyShape(rms_eps=1e-5)
    if arch == "qwen2":
        return TinyShape(n_head=4, n_head_kv=2, n_ff=128, rope_freq_base=1e6)
    if arch == "qwen3":
        # Qwen3 has an explicit head_dim: n_head * head_dim (128) != n_embd (64).
        return TinyShape(n_head=4, n_head_kv=2, head_dim=32, n_ff=128, rope_freq_base=1e6)
    if arch == "gemma3":
        # 6 layers: llama.cpp's default gemma3 pattern makes layers 0-4 sliding-window, 5 global.
        # head_dim 32 with 4 heads (q dim 128 != n_embd 64), one KV head (like gemma-3-270m).
        return TinyShape(n_layer=6, n_head=4, n_head_kv=1, head_dim=32, n_ff=128, rope_freq_base=1e6)
    if arch == "bitnet":
        # Every matmul row (n_embd, n_ff) is a multiple of 256 so TQ1_0/TQ2_0 apply.
        return TinyShape(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, rms_eps=1e-5, rope_freq_base=500000.0)
    raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")


GEMMA3_SLIDING_WINDOW = 8  # tokens; short so a 24-token test sequence exercises the window
GEMMA3_ROPE_FREQ_BASE_SWA = 10000.0  # llama.cpp's default for gemma3 local layers
GEMMA3_SOFTCAP = 30.0
ROPE_SCALING_FACTOR = 4.0
ROPE_YARN_ORIG_CTX = 4096


def _tokenizer(w: GGUFWriter, n_vocab: int) -> None:
    """A minimal SentencePiece ("llama") vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces.

    Byte fallback covers every input, so llama.cpp's SPM tokenizer accepts any text.
    """
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581"] + [f"\u2581{c}" for c in letters] + list(letters)
    pieces += [f"\u2581{a}{b}" for a in letters for b in letters]
    need = n_vocab - len(tokens)
    if need > len(pieces):
        raise ValueError(f"n_vocab {n_vocab} too large for the tiny tokenizer")
    tokens += pieces[:need]
    types += [TokenType.NORMAL] * need
    # SPM merges by score: earlier (shorter) pieces score higher; specials/bytes score 0.
    scores = [0.0] * (len(tokens) - need) + [-float(i) for i in range(need)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


class _Weights:
    """Deterministic weights: one RNG stream per tensor name, so adding a tensor changes no other."""

    def __init__(self, seed: int):
        self.seed = seed

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])

    def linear(self, name: str, n_out: int, n_in: int) -> np.ndarray:
        # std 1/sqrt(fan_in) keeps each projection's output at the scale of its input.
        return (self.rng(name).standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(self, name: str, n: int) -> np.ndarray:
        # Around 1 (not exactly 1) so that a forward which skips a norm weight fails.
        return (1.0 + 0.1 * self.rng(name).standard_normal(n)).astype(np.float32)

    def bias(self, name: str, n: int) -> np.ndarray:
        return (0.1 * self.rng(name).standard_normal(n)).astype(np.float32)

    def embedding(self, name: str, n_vocab: int, n_embd: int, std: float) -> np.ndarray:
        return (std * self.rng(name).standard_normal((n_vocab, n_embd))).astype(np.float32)

    def ternary(self, name: str, n_out: int, n_in: int) -> tuple[np.ndarray, float]:
        """BitNet b1.58 weight: entries in {-1, 0, +1} (each 1/3) and a per-tensor scale."""
        t = self.rng(name).integers(-1, 2, size=(n_out, n_in)).astype(np.float32)
        # E[t^2] = 2/3, so this scale keeps the projection's output at its input's scale.
        return t, float(1.0 / np.sqrt(2.0 / 3.0 * n_in))


def _known_tensor_names(arch: str, n_layer: int) -> set[str]:
    """Tensor base names (without .weight/.bias/.scale) that gguf-py's tables allow for `arch`."""
    arch_id = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    names = set()
    for t in MODEL_TENSORS[arch_id]:
        fmt = TENSOR_NAMES[t]
        if "{bid}" in fmt:
            names.update(fmt.format(bid=il) for il in range(n_layer))
        else:
            names.add(fmt)
    return names


class _Writer:
    """Adds tensors, converting 2-D matmul weights to the requested type.

    Every name is checked against gguf-py's MODEL_TENSORS table for the arch, the authority on names.
    """

    def __init__(self, w: GGUFWriter, wtype: str, arch: str, n_layer: int):
        self.w = w
        self.qtype = _QTYPE[wtype]
        self.arch = arch
        self.known = _known_tensor_names(arch, n_layer)

    def _check(self, name: str) -> None:
        base, _, suffix = name.rpartition(".")
        if base not in self.known or suffix not in ("weight", "bias", "scale"):
            raise AssertionError(f"tensor {name} is not in gguf-py's MODEL_TENSORS for {self.arch}")

    def f32(self, name: str, data: np.ndarray) -> None:
        self._check(name)
        self.w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    def matmul(self, name: str, data: np.ndarray, qtype: GGMLQuantizationType | None = None) -> None:
        self._check(name)
        qtype = self.qtype if qtype is None else qtype
        if qtype == GGMLQuantizationType.F32:
            self.f32(name, data)
        elif qtype == GGMLQuantizationType.F16:
            self.w.add_tensor(name, data.astype(np.float16))
        else:
            self.w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def make_model(arch: str, path: str | os.PathLike, *, wtype: str = "F32", seed: int = 0,
               variant: str | None = None) -> Path:
    """Write a tiny random `arch` model to `path` and return the path.

    wtype: type of the 2-D matmul weights (see wtypes_for(arch)); token_embd follows it except for
    the ternary types, where it stays F32 (it is not ternary). Norms, biases and scales are F32.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")
    if variant not in VARIANTS[arch]:
        raise ValueError(f"unknown variant {variant!r} for {arch}; known: {VARIANTS[arch]}")
    if wtype not in wtypes_for(arch) + WTYPES_EXTRA:
        raise ValueError(f"weight type {wtype!r} not available for {arch}; known: {wtypes_for(arch)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hp = shape_for(arch, variant)
    head_dim = hp.head_dim or hp.n_embd // hp.n_head
    n_q = hp.n_head * head_dim  # rows of attn_q, columns of attn_output
    n_kv = hp.n_head_kv * head_dim

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}" + (f"-{variant}" if variant else ""))
    w.add_file_type(_FTYPE[wtype])
    w.add_context_length(int(hp.n_ctx_train * (ROPE_SCALING_FACTOR if variant == "rope_yarn" else 1)))
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    if hp.head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":  # convert_hf_to_gguf writes it for llama only; others default to head_dim
        w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_rope_freq_base(hp.rope_freq_base)
    w.add_vocab_size(hp.n_vocab)
    if variant == "rope_linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(ROPE_SCALING_FACTOR)
    elif variant == "rope_yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(ROPE_SCALING_FACTOR)
        w.add_rope_scaling_orig_ctx_len(ROPE_YARN_ORIG_CTX)
    if arch == "gemma3":
        w.add_sliding_window(GEMMA3_SLIDING_WINDOW)
        if variant == "softcap":
            w.add_final_logit_softcapping(GEMMA3_SOFTCAP)
        if variant == "swa_layers":
            w.add_sliding_window_pattern([il % 3 < 2 for il in range(hp.n_layer)])
    if arch == "bitnet" and variant == "relu2":
        w.add_string(f"{arch}.hidden_activation", "relu2")
    _tokenizer(w, hp.n_vocab)

    rnd = _Weights(seed)
    out = _Writer(w, wtype, arch, hp.n_layer)
    ternary = wtype in WTYPES_TERNARY
    embd_qtype = GGMLQuantizationType.F32 if ternary else None
    tied = arch in ("gemma3", "bitnet") or variant == "tied"

    # A tied head reuses the embeddings: std 1/sqrt(n_embd) keeps logits O(1) (and Gemma's
    # sqrt(n_embd) input scaling brings its inputs back to O(1)).
    embd_std = 1.0 / np.sqrt(hp.n_embd) if tied else 1.0
    out.matmul("token_embd.weight", rnd.embedding("token_embd.weight", hp.n_vocab, hp.n_embd, embd_std), embd_qtype)
    out.f32("output_norm.weight", rnd.norm("output_norm.weight", hp.n_embd))
    if not tied:
        out.matmul("output.weight", rnd.linear("output.weight", hp.n_vocab, hp.n_embd))
    if variant == "rope_freqs":
        # Llama 3.1 divides the rotation frequency of the low-frequency pairs by up to 8.
        n_pairs = head_dim // 2
        out.f32("rope_freqs.weight", np.linspace(1.0, 8.0, n_pairs))

    for il in range(hp.n_layer):
        b = f"blk.{il}"
        out.f32(f"{b}.attn_norm.weight", rnd.norm(f"{b}.attn_norm.weight", hp.n_embd))
        out.f32(f"{b}.ffn_norm.weight", rnd.norm(f"{b}.ffn_norm.weight", hp.n_embd))
        proj = {  # name -> (n_out, n_in)
            "attn_q": (n_q, hp.n_embd), "attn_k": (n_kv, hp.n_embd), "attn_v": (n_kv, hp.n_embd),
            "attn_output": (hp.n_embd, n_q),
            "ffn_gate": (hp.n_ff, hp.n_embd), "ffn_up": (hp.n_ff, hp.n_embd), "ffn_down": (hp.n_embd, hp.n_ff),
        }
        for name, (n_out, n_in) in proj.items():
            tname = f"{b}.{name}.weight"
            if arch == "bitnet":
                t, scale = rnd.ternary(tname, n_out, n_in)
                if variant == "folded":
                    out.matmul(tname, t * np.float32(scale))
                else:
                    out.matmul(tname, t)
                    # llama.cpp multiplies the matmul result by this [1] tensor (build_lora_mm w_s).
                    out.f32(f"{b}.{name}.scale", np.array([scale], dtype=np.float32))
            else:
                out.matmul(tname, rnd.linear(tname, n_out, n_in))
        if arch == "qwen2":
            for name, n in (("attn_q", n_q), ("attn_k", n_kv), ("attn_v", n_kv)):
                out.f32(f"{b}.{name}.bias", rnd.bias(f"{b}.{name}.bias", n))
        if arch in ("qwen3", "gemma3"):
            out.f32(f"{b}.attn_q_norm.weight", rnd.norm(f"{b}.attn_q_norm.weight", head_dim))
            out.f32(f"{b}.attn_k_norm.weight", rnd.norm(f"{b}.attn_k_norm.weight", head_dim))
        if arch == "gemma3":
            # GGUF gemma norms already hold (1 + w) of the HF checkpoint; they are used as is.
            out.f32(f"{b}.post_attention_norm.weight", rnd.norm(f"{b}.post_attention_norm.weight", hp.n_embd))
            out.f32(f"{b}.post_ffw_norm.weight", rnd.norm(f"{b}.post_ffw_norm.weight", hp.n_embd))
        if arch == "bitnet":
            out.f32(f"{b}.attn_sub_norm.weight", rnd.norm(f"{b}.attn_sub_norm.weight", hp.n_embd))
            out.f32(f"{b}.ffn_sub_norm.weight", rnd.norm(f"{b}.ffn_sub_norm.weight", hp.n_ff))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def cache_dir() -> Path:
    """Where generated tiny models live outside the repository."""
    return Path(os.environ.get("KTD_CACHE", Path.home() / ".cache" / "ktd")) / "tiny"


def model_filename(arch: str, wtype: str = "F32", seed: int = 0, variant: str | None = None) -> str:
    return f"tiny-{arch}{'-' + variant if variant else ''}-{wtype}-s{seed}.gguf"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write tiny random GGUF models of the dense architectures.")
    ap.add_argument("--arch", choices=ARCHS, action="append", help="default: all")
    ap.add_argument("--wtype", action="append", help="default: F32 and Q8_0 (and TQ2_0 for bitnet)")
    ap.add_argument("--variants", action="store_true", help="also write every variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help=f"output directory (default {cache_dir()})")
    args = ap.parse_args(argv)
    out_dir = args.out or cache_dir()
    for arch in args.arch or ARCHS:
        wtypes = args.wtype or (["F32", "Q8_0"] + (["TQ2_0"] if arch == "bitnet" else []))
        for variant in VARIANTS[arch] if args.variants else [None]:
            for wtype in wtypes:
                p = make_model(arch, out_dir / model_filename(arch, wtype, args.seed, variant),
                               wtype=wtype, seed=args.seed, variant=variant)
                print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
