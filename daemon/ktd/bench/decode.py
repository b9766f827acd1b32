"""Decode as % of the DRAM read ceiling, measured fairly on a shared, noisy machine.

    python -m ktd.bench.decode MODEL [--threads 1 2] [--tokens 32] [--out bench/results/decode.json]

Each decode step (one single-token forward + the greedy argmax, as ``ktd.bench.e2e``'s tg) is
followed by one read-bandwidth measurement over a buffer of the model's bytes per token
(``ktd inspect``) with the same thread count (``bench_read_bandwidth``: the best of a plain and
a prefetching summing loop, on 2 MiB pages where THP allows). Step and bandwidth therefore see
the same load at the same moment, and the figure reported is the median step against the median
bandwidth: the same statistic on both sides. Comparing a median decode rate with a best-of
bandwidth taken at another moment (or a figure from another run) understates or overstates the
percentage by as much as the machine's noise, 10-20% here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ktd.bench import write_results

PROMPT_TOKENS = 16


def summarize(step_seconds: Sequence[float], bandwidths: Sequence[float], bytes_per_token: int) -> dict[str, Any]:
    """Medians of interleaved decode steps (s) and bandwidth passes (B/s), and decode as % of it."""
    if not step_seconds or len(step_seconds) != len(bandwidths):
        raise ValueError("need as many bandwidth passes as decode steps, at least one")
    if bytes_per_token <= 0 or min(step_seconds) <= 0 or min(bandwidths) <= 0:
        raise ValueError("bytes per token, step times and bandwidths must be positive")
    step = statistics.median(step_seconds)
    bw = statistics.median(bandwidths)
    decode_bps = bytes_per_token / step
    return {
        "tokens": len(step_seconds),
        "median_step_s": step,
        "tokens_per_s": 1.0 / step,
        "decode_bytes_per_s": decode_bps,
        "median_read_bandwidth_bytes_per_s": bw,
        "pct_of_ceiling": 100.0 * decode_bps / bw,
        # The same, pair by pair (each step against the pass right after it).
        "pct_of_ceiling_pairwise_median": statistics.median(
            100.0 * bytes_per_token / s / b for s, b in zip(step_seconds, bandwidths)),
    }


def measure(path: str, threads: int, tokens: int) -> dict[str, Any]:
    """Interleaved decode steps and bandwidth passes on one model and thread count."""
    from ktd import _native
    from ktd.engine import Engine
    from ktd.inspect import inspect_model

    if tokens < 1 or threads < 1:
        raise ValueError("tokens and threads must be >= 1")
    bpt = int(inspect_model(path)["bytes_per_token"]["total"])
    eng = Engine.open(path, n_ctx=PROMPT_TOKENS + tokens + 1, n_seq_max=1, threads=threads)
    # A fixed prompt of ordinary token ids; what is generated does not change the bytes read.
    prompt = np.arange(100, 100 + PROMPT_TOKENS)
    n = len(prompt)
    logits = eng.forward(prompt, np.arange(n), np.zeros(n), np.arange(n) == n - 1)
    token = int(np.argmax(logits[0]))
    steps, bws = [], []
    for i in range(tokens):
        t0 = time.perf_counter()
        logits = eng.forward(np.array([token]), np.array([n + i]), np.zeros(1), np.ones(1, bool))
        token = int(np.argmax(logits[0]))
        steps.append(time.perf_counter() - t0)
        bws.append(_native.kernels.bench_read_bandwidth(bpt, threads, 1))
    del eng  # the weights arena goes before the next thread count maps its own
    return {"model": os.path.basename(path), "threads": threads, "bytes_per_token": bpt,
            **summarize(steps, bws, bpt)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.decode", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file or known model name")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps (each followed by a bandwidth pass)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    args = ap.parse_args(argv)
    if args.tokens < 1 or any(t < 1 for t in args.threads):
        print("--tokens and --threads must be >= 1", file=sys.stderr)
        return 1
    from ktd.commands.run import _resolve
    from ktd.cli import UserError

    try:
        path = _resolve(args.model)
    except UserError as e:
        print(e, file=sys.stderr)
        return 1
    rows = []
    for t in args.threads:
        r = measure(path, t, args.tokens)
        rows.append(r)
        print(f"{r['model']} {t} thread(s): decode {r['tokens_per_s']:.2f} tok/s = "
              f"{r['decode_bytes_per_s'] / 1e9:.2f} GB/s, read bandwidth {r['median_read_bandwidth_bytes_per_s'] / 1e9:.2f}"
              f" GB/s (medians of {r['tokens']} interleaved pairs): {r['pct_of_ceiling']:.1f}% of the ceiling",
              flush=True)
    write_results(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
