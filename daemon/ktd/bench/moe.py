"""MoE decode benchmark: the routed-expert FFN of one token (n = 1) per layer, as a fraction of the
measured DRAM read bandwidth over the bytes it must stream.

    python -m ktd.bench.moe FILE.gguf [--threads 1 2] [--rounds 5] [--out moe.json]

For each round, every MoE layer runs ``Context._moe_ffn`` once on a fresh random normed row (so the
router picks a different set of experts each time, and with all layers in turn the experts touched
are far larger than the L3 cache: they stream from DRAM as in decode). The bytes a call must read
are the router matrix, the selected experts' gate/up/down matrices (read from the context's expert
counts) and the shared expert. The read bandwidth is measured in the same run, with the same thread
count, interleaved with the rounds; the percentage of a round uses that round's figure. Medians over
rounds are reported (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from ktd import _native
from ktd.engine import Engine

BW_BYTES = 1 << 30  # read-bandwidth buffer: far larger than any L3 cache


def expert_bytes(path: str) -> dict[int, dict[str, int]]:
    """Per MoE layer: bytes of one routed expert (gate + up + down), of the router and of the
    shared expert (0 when absent), from the file's tensor sizes."""
    r = GGUFReader(path)
    layers: dict[int, dict[str, int]] = {}
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk":
            continue
        il, name = int(parts[1]), parts[2]
        d = layers.setdefault(il, {"expert": 0, "router": 0, "shared": 0, "n_expert": 0})
        if name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            n_expert = int(t.shape[-1])
            d["expert"] += int(t.n_bytes) // n_expert
            d["n_expert"] = n_expert
        elif name == "ffn_gate_inp":
            d["router"] = int(t.n_bytes)
        elif name in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
            d["shared"] += int(t.n_bytes)
    return {il: d for il, d in layers.items() if d["n_expert"]}


def run(path: str, threads: int, rounds: int, seed: int = 0) -> dict:
    sizes = expert_bytes(path)
    e = Engine.open(path, threads=threads, n_ctx=64, pin=False)
    ctx = e.context
    n_embd = int(e.model.n_embd)
    rng = np.random.default_rng(seed)
    layers = sorted(sizes)

    def one_round() -> tuple[float, int, list[float]]:
        total_s, total_bytes, per_layer = 0.0, 0, []
        for il in layers:
            x = rng.standard_normal((1, n_embd)).astype(np.float32)
            before = ctx.expert_counts()[il].copy()
            t0 = time.perf_counter()
            ctx._moe_ffn(il, x)
            dt = time.perf_counter() - t0
            used = int(np.count_nonzero(ctx.expert_counts()[il] - before))
            d = sizes[il]
            total_bytes += d["router"] + d["shared"] + used * d["expert"]
            total_s += dt
            per_layer.append(dt)
        return total_s, total_bytes, per_layer

    one_round()  # warm: scratch grown, pool started
    out = []
    for _ in range(rounds):
        bw = _native.kernels.bench_read_bandwidth(BW_BYTES, threads, 1)
        s, nbytes, per_layer = one_round()
        out.append({"seconds": s, "bytes": nbytes, "read_bw": bw, "us_per_layer": 1e6 * s / len(layers),
                    "pct_of_bw": 100.0 * nbytes / s / bw})
    return {
        "path": path, "threads": threads, "n_moe_layers": len(layers),
        "us_per_layer": statistics.median(r["us_per_layer"] for r in out),
        "bytes_per_layer": statistics.median(r["bytes"] for r in out) / len(layers),
        "read_bw_gbs": statistics.median(r["read_bw"] for r in out) / 1e9,
        "pct_of_bw": statistics.median(r["pct_of_bw"] for r in out),
        "rounds": out,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file with routed experts")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = []
    for t in args.threads:
        r = run(args.model, t, args.rounds)
        results.append(r)
        print(f"{Path(r['path']).name} threads={t}: {r['us_per_layer']:.0f} us/layer, "
              f"{r['bytes_per_layer'] / 1e6:.1f} MB/layer, read bw {r['read_bw_gbs']:.1f} GB/s, "
              f"{r['pct_of_bw']:.0f}% of bw", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
