"""``ktd perplexity`` against llama.cpp (llama-cpp-python) on the same file, text, tokens and chunks,
at the same thread count: the PPL of each and the evaluation speed.

    python -m ktd.bench.perplexity [--models qwen2.5-coder-0.5b,...] [--text FILE ...] [--ctx 512]
                                   [--threads 2] [--chunks N]

llama.cpp runs the way llama-perplexity drives it: one llama_decode per chunk (n_batch = n_ctx)
from a cleared KV cache, logits requested for the second half of the chunk only; the log-softmax
of its logits is done in numpy afterwards and not timed (which favours llama.cpp; ktd's time
includes its native log-softmax). The chunks alternate ktd first / llama.cpp first, and both wall
and process CPU time (getrusage: all threads) are reported, because the machine may be shared.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import sys
import time

import numpy as np

from ktd.ops import models as ktd_models
from ktd.model import perplexity as P
def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class LlamaPerplexity:
    def __init__(self, path: str, n_ctx: int, threads: int):
        import llama_cpp as L

        self.L = L
        self.llm = L.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512),
                           n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
        self.ctx = self.llm._ctx.ctx
        self.n_ctx = n_ctx
        self.n_vocab = self.llm.n_vocab()
        self.batch = L.llama_batch_init(n_ctx, 0, 1)

    def nll(self, chunk: np.ndarray, original: np.ndarray) -> tuple[np.ndarray, float]:
        L, b, n = self.L, self.batch, self.n_ctx
        first = n // 2
        for k in range(n):
            b.token[k] = int(chunk[k])
            b.pos[k] = k
            b.n_seq_id[k] = 1
            b.seq_id[k][0] = 0
            b.logits[k] = 1 if k >= first else 0
        b.n_tokens = n
        t0 = time.perf_counter()
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        ptr = L.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(n - first, self.n_vocab)).copy()
        dt = time.perf_counter() - t0
        x = logits[:-1].astype(np.float64)
        m = x.max(-1, keepdims=True)
        lp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
        return -lp[np.arange(n - 1 - first), original[first + 1:]], dt


def compare(name: str, path: str, text_path: str, n_ctx: int, threads: int, n_chunks: int | None) -> dict:
    from ktd.server.engine import Engine

    text = open(text_path, encoding="utf-8").read()
    eng = Engine.open(path, n_ctx=n_ctx, n_seq_max=1, threads=threads, n_batch=n_ctx)
    tok = eng.tokenizer
    tokens = tok.encode(text, add_special=True)
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    windows = P.chunks(tokens, n_ctx, bos, n_chunks)
    lm = LlamaPerplexity(path, n_ctx, threads)
    t_all = np.asarray(tokens, dtype=np.int32)
    pos, seq = np.arange(n_ctx, dtype=np.int32), np.zeros(n_ctx, dtype=np.int32)
    k_nll, l_nll = [], []
    wall = {"ktd": 0.0, "llama.cpp": 0.0}
    cpu = {"ktd": 0.0, "llama.cpp": 0.0}
    for i, w in enumerate(windows):
        orig = t_all[i * n_ctx:(i + 1) * n_ctx]
        for side in (("ktd", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "ktd")):
            c0 = _cpu()
            if side == "ktd":
                t0 = time.perf_counter()
                k_nll.append(eng.score(w, pos, seq, P.targets(w, orig)))
                wall[side] += time.perf_counter() - t0
            else:
                nll, dt = lm.nll(w, orig)
                l_nll.append(nll)
                wall[side] += dt
            cpu[side] += _cpu() - c0
        print(f"\r{name}: chunk {i + 1}/{len(windows)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    kp, ke = P.summarize(np.concatenate(k_nll))
    lp, le = P.summarize(np.concatenate(l_nll))
    n_eval = len(windows) * n_ctx
    return {"model": name, "text": text_path, "n_ctx": n_ctx, "threads": threads, "n_tokens": len(tokens),
            "n_chunks": len(windows), "n_scored": int(sum(len(x) for x in k_nll)),
            "ppl": {"ktd": kp, "llama.cpp": lp}, "ppl_err": {"ktd": ke, "llama.cpp": le},
            "rel_diff": kp / lp - 1,
            "tokens_per_s_wall": {k: n_eval / v for k, v in wall.items()},
            "cpu_s": cpu, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.perplexity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,gemma-3-270m")
    ap.add_argument("--text", nargs="+", default=["README.md"], help="UTF-8 text file(s), one run each")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        path = str(ktd_models.fetch(name)) if name in ktd_models.MODELS else name
        for text in args.text:
            r = compare(os.path.basename(name), path, text, args.ctx, args.threads, args.chunks)
            rows.append(r)
            print(f"{r['model']:22s} {os.path.basename(text):16s} {r['n_chunks']:3d}x{r['n_ctx']} "
                  f"PPL ktd {r['ppl']['ktd']:.4f} llama.cpp {r['ppl']['llama.cpp']:.4f} "
                  f"({r['rel_diff'] * 100:+.2f}%)  tok/s ktd {r['tokens_per_s_wall']['ktd']:.1f} "
                  f"llama.cpp {r['tokens_per_s_wall']['llama.cpp']:.1f}  CPU s ktd {r['cpu_s']['ktd']:.1f} "
                  f"llama.cpp {r['cpu_s']['llama.cpp']:.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
