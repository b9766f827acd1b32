"""The decode cost of model.weights_map: gguf against arena, measured so that a shared machine's
load hits both alike: one process holds the model twice (arena: repacked; gguf: the file's plain
rows), and the decode steps alternate between them (ABBA order), each step's CPU time taken from
the calling thread (``time.thread_time``; with ``--threads 1`` the forward runs on it alone, so
being descheduled does not count, only the compute and its memory stalls do). Reported: the
median CPU milliseconds per step of each and their ratio.

    python -m ktd.bench.weights_map MODEL [--steps 32] [--threads 1] [--out bench/results/weights_map.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ktd.bench import write_results

PROMPT = 16


def measure(path: str, steps: int, threads: int = 1) -> dict[str, Any]:
    from ktd import _native

    maps = ("arena", "gguf")
    models = {w: _native.Model(path, n_threads=threads, pin=False, weights_map=w) for w in maps}
    ctx = {w: _native.Context(m, PROMPT + steps + 1, 1, PROMPT) for w, m in models.items()}
    prompt = np.arange(100, 100 + PROMPT) % models["arena"].n_vocab
    token = {}
    for w, c in ctx.items():
        logits = c.forward(prompt, np.arange(PROMPT), np.zeros(PROMPT), np.arange(PROMPT) == PROMPT - 1)
        token[w] = int(np.argmax(logits[0]))
    cpu: dict[str, list[float]] = {w: [] for w in maps}
    load_start = os.getloadavg()
    for i in range(steps):
        for w in (maps if i % 2 == 0 else maps[::-1]):
            c0 = time.thread_time()
            logits = ctx[w].forward(np.array([token[w]]), np.array([PROMPT + i]), np.zeros(1), np.ones(1, bool))
            cpu[w].append(time.thread_time() - c0)
            token[w] = int(np.argmax(logits[0]))
    med = {w: statistics.median(v) for w, v in cpu.items()}
    return {"model": os.path.basename(path), "threads": threads, "steps": steps,
            "weights_map": {w: models[w].memory["weights_map"] for w in maps},
            "cpu_ms_per_step": {w: round(1000 * med[w], 6) for w in maps},
            "gguf_over_arena": round(med["gguf"] / med["arena"], 4),
            "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.weights_map", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file or known model name")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per map (alternating)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/weights_map.json"))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        print("--steps and --threads must be >= 1", file=sys.stderr)
        return 1
    from ktd.ops import models

    try:
        path = models.resolve(args.model)
    except models.FetchError as e:
        print(e, file=sys.stderr)
        return 1
    r = measure(path, args.steps, args.threads)
    c = r["cpu_ms_per_step"]
    print(f"{r['model']} {r['threads']} thread(s): arena {c['arena']:.1f} ms, gguf {c['gguf']:.1f} ms CPU per decode "
          f"step (medians of {r['steps']} alternating steps): gguf/arena {r['gguf_over_arena']:.3f}; load average "
          f"{r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}")
    write_results([r], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
