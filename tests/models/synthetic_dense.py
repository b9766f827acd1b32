"""A benchmark-sized dense GGUF for decode figures that come from DRAM on machines whose last-level
cache holds the small real models (a 480 MiB L3 holds most of a 1 GB file's per-token stream, and
every benchmark row is then flagged cache-assisted): Qwen2.5-7B's shapes (qwen2, 28 layers, n_embd
3584, n_ff 18944, 28 query / 4 KV heads of 128, vocab 152064), llama.cpp's Q4_K_M type mix, about
4.4 GB read per token.

The weights are random valid blocks written directly (a few seconds a GB, no F16 intermediate and
no quantizer): in Q4_K and Q6_K every bit pattern of the quants and of the 6-bit/8-bit sub-block
scales is a valid code, so those bytes are random and only the fp16 super-block scales are set,
from gguf-py's dequantization of the same blocks at scale 1, so that a row's values have about
standard deviation 1/sqrt(fan_in) (the model's activations stay O(1)). The text such a model writes
is noise; the block kernels' time does not depend on the values, so its decode speed is that of a
real 7B Q4_K_M. llama.cpp loads and runs it (check_llama_cpp), which is how the layout is known to
be right.

    python -m tests.models.synthetic_dense [--out PATH] [--check]

writes ${KTD_CACHE:-~/.cache/ktd}/synthetic/qwen2-7b-bench-q4_k_m-s0.gguf (`make synthetic-dense`).
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import synthetic_moe  # noqa: E402
else:
    from . import synthetic_moe

# The super-block scale fields of the K-quants this file uses: byte offsets of the fp16 d (and
# dmin), the block size.
_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


@dataclass(frozen=True)
class DenseShape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    n_ctx_train: int = 32768


# Qwen2.5-7B (config.json of the release): the same numbers as the GGUF conversions of it.
QWEN2_7B = DenseShape(n_layer=28, n_embd=3584, n_ff=18944, n_head=28, n_head_kv=4, n_vocab=152064)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v / ffn_down get Q6_K in
    Q4_K_M: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int) -> str:
    """The type llama.cpp's Q4_K_M gives a qwen2 matrix (1-D tensors stay F32): output Q6_K,
    attn_v and ffn_down Q6_K when use_more_bits holds for their count among the tensors of that
    name so far, every other matrix Q4_K. The quantizer counts in the order it meets the tensors,
    which in the conversions of the Qwen releases is the layers' names sorted as strings (blk.0,
    blk.1, blk.10, ..., blk.19, blk.2, ...): that order is used here, as the real files have it."""
    if name == "output.weight":
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        met = sorted(range(n_layer), key=str).index(int(parts[1]))
        if use_more_bits(met, n_layer):
            return "Q6_K"
    return "Q4_K"


def _set_scales(qt: str, blocks: np.ndarray, d: np.ndarray) -> None:
    """Write the fp16 super-block scale(s) d [nb] (d and dmin alike for Q4_K) into blocks [nb, size]."""
    _, offs = _K_BLOCKS[qt]
    bits = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for off in offs:
        blocks[:, off:off + 2] = bits


def random_k_blocks(qt: str, n_rows: int, k: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random valid `qt` (Q4_K, Q6_K) blocks for n_rows rows of k weights ([n_rows, row bytes]
    uint8) whose dequantized values have about standard deviation `std`
    (synthetic_moe.random_scaled_blocks)."""
    return synthetic_moe.random_scaled_blocks(qt, _K_BLOCKS[qt][0], lambda b, d: _set_scales(qt, b, d), n_rows, k,
                                              rng, std)


def tensor_table(s: DenseShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor in file order; matrices are [n_out, n_in]."""
    hd = s.n_embd // s.n_head
    n_q, n_kv = s.n_head * hd, s.n_head_kv * hd
    out = [("token_embd.weight", (s.n_vocab, s.n_embd)), ("output_norm.weight", (s.n_embd,)),
           ("output.weight", (s.n_vocab, s.n_embd))]
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [(f"{b}.attn_norm.weight", (s.n_embd,)), (f"{b}.ffn_norm.weight", (s.n_embd,)),
                (f"{b}.attn_q.weight", (n_q, s.n_embd)), (f"{b}.attn_k.weight", (n_kv, s.n_embd)),
                (f"{b}.attn_v.weight", (n_kv, s.n_embd)), (f"{b}.attn_output.weight", (s.n_embd, n_q)),
                (f"{b}.ffn_gate.weight", (s.n_ff, s.n_embd)), (f"{b}.ffn_up.weight", (s.n_ff, s.n_embd)),
                (f"{b}.ffn_down.weight", (s.n_embd, s.n_ff)),
                (f"{b}.attn_q.bias", (n_q,)), (f"{b}.attn_k.bias", (n_kv,)), (f"{b}.attn_v.bias", (n_kv,))]
    return out


def make_model(path: str | os.PathLike[str], *, shape: DenseShape = QWEN2_7B, seed: int = 0) -> Path:
    """Write the qwen2 file of `shape` to `path` (tensor by tensor, through a .part file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, "qwen2")
    w.add_name("synthetic-qwen2-7b-bench")
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_vocab_size(shape.n_vocab)
    synthetic_moe._add_tokenizer(w, shape.n_vocab)
    table = tensor_table(shape)
    for name, shp in table:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
            continue
        qt = q4_k_m_type(name, shape.n_layer)
        size, _ = _K_BLOCKS[qt]
        byte_shape = (shp[0], shp[1] // 256 * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=QT[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp in table:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if len(shp) == 1:
            v = np.ones(shp, np.float32) if name.endswith("norm.weight") else (0.02 * rng.standard_normal(shp))
            w.write_tensor_data(v.astype(np.float32))
            continue
        # the embeddings are looked up, not multiplied: rows of unit scale; matrices 1/sqrt(fan_in)
        std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shp[1])
        w.write_tensor_data(random_k_blocks(q4_k_m_type(name, shape.n_layer), shp[0], shp[1], rng, std))
    w.close()
    tmp.replace(path)
    return path


def default_path(seed: int = 0) -> Path:
    return synthetic_moe.cache_dir() / f"qwen2-7b-bench-q4_k_m-s{seed}.gguf"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.models.synthetic_dense", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output file (default: the cache's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="then load and run it in llama.cpp")
    args = p.parse_args(argv)
    out = args.out or default_path(args.seed)
    if out.exists():
        print(f"{out}: exists")
    else:
        make_model(out, seed=args.seed)
        print(f"{out}: {out.stat().st_size / 2**30:.2f} GiB")
    if args.check:
        synthetic_moe.check_llama_cpp(out, n_tokens=4)
        print(f"{out}: llama.cpp loads and runs it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
