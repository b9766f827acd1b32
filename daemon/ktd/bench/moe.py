"""MoE decode benchmark: the routed-expert FFN of one token (n = 1) per layer, as a fraction of the
measured DRAM read bandwidth over the bytes it must stream; with --predict, how well layer L's
residual predicts layer L+1's experts.

    python -m ktd.bench.moe FILE.gguf [--threads 1 2] [--rounds 5] [--out moe.json]
    python -m ktd.bench.moe FILE.gguf --predict [--tokens 64]

For each round, every MoE layer runs ``Context._moe_ffn`` once on a fresh random normed row (so the
router picks a different set of experts each time, and with all layers in turn the experts touched
are far larger than the L3 cache: they stream from DRAM as in decode). The bytes a call must read
are the router matrix, the selected experts' gate/up/down matrices (read from the context's expert
counts) and the shared expert. The read bandwidth is measured in the same run, with the same thread
count, interleaved with the rounds; the percentage of a round uses that round's figure. Medians over
rounds are reported (the machine may be shared).

--predict decodes random tokens one by one (teacher-forced), records each MoE layer's residual
before and after its FFN (Context._record_states) and the experts every layer really chose (the
expert counts, reset each step), and applies layer L+1's router (ffn_norm, ffn_gate_inp, gating,
exp_probs_b) to layer L's residual: recall = |predicted top-k ∩ true top-k| / k, averaged over
tokens and layer pairs (check: layer L's router on L's own residual gives back L's choice). Baselines: the previous token's experts of layer L+1, and k experts drawn
at random (k / n_expert). Group-limited routing (expert_group_count > 1) is not applied to the
prediction. On synthetic files the weights are random, so the recall says nothing about a
trained model's.
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
from ktd.server.engine import Engine

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
    # One read buffer for every round (fresh buffers, allocated, faulted in and freed at every
    # pass, slowed what ran after them: ktd.bench.decode's doc); each round's bandwidth is the
    # best of one pass of every loop.
    buf = _native.kernels.ReadBuffer(BW_BYTES, threads)
    out = []
    for _ in range(rounds):
        bw = max(buf.read(pf) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH)
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


def _router_tensors(path: str) -> tuple[dict[int, dict[str, np.ndarray]], float, str]:
    """Per MoE layer: ffn_norm [n_embd], ffn_gate_inp [n_expert, n_embd] and exp_probs_b (or None),
    as float32; the RMSNorm epsilon; the gating ('softmax' or 'sigmoid')."""
    from gguf.quants import dequantize

    r = GGUFReader(path)
    arch = str(r.fields["general.architecture"].contents())
    eps = float(r.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())
    gating_field = r.fields.get(f"{arch}.expert_gating_func")
    gating = "sigmoid" if gating_field is not None and int(gating_field.contents()) == 2 else "softmax"
    layers: dict[int, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in ("ffn_norm", "ffn_gate_inp", "exp_probs_b"):
            continue
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        layers.setdefault(int(parts[1]), {})[parts[2]] = a
    return {il: d for il, d in layers.items() if "ffn_gate_inp" in d}, eps, gating


def _predict_topk(d: dict[str, np.ndarray], x: np.ndarray, k: int, eps: float, gating: str) -> np.ndarray:
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * d["ffn_norm"]
    logits = d["ffn_gate_inp"].reshape(-1, x.shape[0]) @ xn
    if gating == "softmax":
        p = np.exp(logits - logits.max())
        p /= p.sum()
    else:
        p = 1.0 / (1.0 + np.exp(-logits))
    if "exp_probs_b" in d:
        p = p + d["exp_probs_b"]
    return np.argsort(-p, kind="stable")[:k]


def predict(path: str, threads: int, n_tokens: int, seed: int = 0) -> dict:
    routers, eps, gating = _router_tensors(path)
    e = Engine.open(path, threads=threads, n_ctx=n_tokens + 1, pin=False)
    ctx = e.context
    k, n_expert = int(e.model.n_expert_used), int(e.model.n_expert)
    pairs = [il for il in sorted(routers) if il + 1 in routers]
    ctx._record_states(True)
    toks = np.random.default_rng(seed).integers(3, int(e.model.n_vocab), size=n_tokens)
    # same_layer: layer L's own router on its own input, which must give back L's choice (1.0 but
    # for near-ties under the kernels' activation rounding): checks the prediction pipeline.
    hits = {"before_ffn": [], "after_ffn": [], "previous_token": [], "same_layer": []}
    prev = None
    for i, t in enumerate(toks):
        ctx.reset_expert_counts()
        e.forward(np.array([t]), np.array([i]), np.array([0]), np.array([True]))
        states, counts = ctx._states(), ctx.expert_counts()
        true = {il: set(np.flatnonzero(counts[il]).tolist()) for il in routers}
        for il in routers:
            own = _predict_topk(routers[il], states[il, 0], k, eps, gating)
            hits["same_layer"].append(len(true[il] & set(own.tolist())) / k)
        for il in pairs:
            nxt = true[il + 1]
            for which, key in ((0, "before_ffn"), (1, "after_ffn")):
                pred = _predict_topk(routers[il + 1], states[il, which], k, eps, gating)
                hits[key].append(len(nxt & set(pred.tolist())) / k)
            if prev is not None:
                hits["previous_token"].append(len(nxt & prev[il + 1]) / k)
        prev = true
    return {"path": path, "n_tokens": n_tokens, "layer_pairs": len(pairs), "n_expert": n_expert,
            "n_expert_used": k, "random": k / n_expert,
            **{key: float(np.mean(v)) for key, v in hits.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file with routed experts")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--predict", action="store_true", help="next-layer expert prediction recall")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded for --predict")
    args = ap.parse_args(argv)
    if args.predict:
        r = predict(args.model, args.threads[0], args.tokens)
        print(f"{Path(r['path']).name}: recall of layer L+1's top-{r['n_expert_used']} of {r['n_expert']} "
              f"over {r['n_tokens']} tokens x {r['layer_pairs']} layer pairs: L's residual before its FFN "
              f"{r['before_ffn']:.3f}, after {r['after_ffn']:.3f}; previous token {r['previous_token']:.3f}; "
              f"random {r['random']:.3f}; check, layer L's router on its own input {r['same_layer']:.3f}")
        if args.out:
            args.out.write_text(json.dumps(r, indent=1))
        return 0
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
