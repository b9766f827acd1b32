"""Kernel benchmark: decode GEMV as a fraction of the measured DRAM read bandwidth, and prefill
GEMM throughput, for every type the active ISA has kernels for.

    python -m ktd.bench.kernels [--threads 1 2] [--out bench/results/kernels.json]

The read bandwidth is measured in the same run with the same thread count (a streaming sum over a
buffer much larger than the L3 cache, timed in C++; for each GEMV case it is measured again,
interleaved with that case's timing, and the case's percentage uses that figure), and every matmul is timed in C++ as well
(``ktd._native.kernels.bench_matmul``: best of ``reps`` calls, scratch and pool reused). GEMV shapes
are real-model shapes stacked until the weights are far larger than the L3 cache, so the weights
stream from DRAM as in decode. Weights come from gguf-py's quantizer where it has one for the
type (tiled from a 256-row base), otherwise random bytes (timing does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from ktd import _native

K = _native.kernels

# (label, rows, k): Qwen2.5-0.5B output head; its ffn_down stacked 48 times (two models' layers);
# Qwen2.5-1.5B ffn_up stacked over 12 layers. All ≥ 2.3x the L3 cache (32 MiB here) even at
# 4.5 bits per weight, so the weights stream from DRAM.
GEMV_SHAPES = [
    ("0.5B output 151936x896", 151936, 896),
    ("0.5B ffn_down x48", 896 * 48, 4864),
    ("1.5B ffn_up x12", 8960 * 12, 1536),
]
# Prefill GEMM: Qwen2.5-1.5B ffn_up (8960 x 1536), n tokens.
GEMM_SHAPE = ("1.5B ffn_up", 8960, 1536)
GEMM_N = [32, 128, 512]
BASE_ROWS = 256


def row_bytes(type_name: str, k: int) -> int | None:
    blck, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return None if k % blck else k // blck * size


def make_weights(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    rb = row_bytes(type_name, k)
    assert rb is not None
    qt = GGMLQuantizationType[type_name]
    try:
        base = quantize(rng.standard_normal((BASE_ROWS, k)).astype(np.float32), qt)
        base = np.ascontiguousarray(base).view(np.uint8).reshape(BASE_ROWS, rb)
    except NotImplementedError:
        base = rng.integers(0, 256, (BASE_ROWS, rb), dtype=np.uint8)
    reps = -(-rows // BASE_ROWS)
    return np.ascontiguousarray(np.tile(base, (reps, 1))[:rows])


def layouts(type_name: str) -> list[str]:
    return ["plain", "repacked"] if K.repack_rows(type_name) > 0 else ["plain"]


def prepared(type_name: str, layout: str, w: np.ndarray, rows: int, k: int, threads: int) -> np.ndarray:
    return K.repack(type_name, w, rows, k, threads=threads) if layout == "repacked" else w


def run(threads_list: list[int], bw_bytes: int, reps: int, types: list[str] | None, rounds: int = 3) -> list[dict]:
    isa = K.active_isa()
    types = types or K.supported_types(isa)
    rng = np.random.default_rng(0)
    rows_out: list[dict] = []
    # Per-case bandwidth: still 8x the L3 cache, cheaper to repeat than the headline buffer.
    case_bw_bytes = min(bw_bytes, 256 << 20)
    print(f"ISA {isa}; types {', '.join(types)}; threads {threads_list}", flush=True)
    for threads in threads_list:
        bw = K.bench_read_bandwidth(bw_bytes, threads, 5)
        print(f"\nread bandwidth, {threads} thread(s): {bw / 1e9:.2f} GB/s "
              f"(best of 5 passes over {bw_bytes >> 20} MiB)", flush=True)
        print(f"{'type':7} {'layout':8} {'shape':26} {'n':>4} {'ms':>9} {'GB/s':>7} {'% bw':>6} {'GFLOP/s':>8}"
              "   (GEMV % bw: against the bandwidth measured alongside that case)")
        for t in types:
            for label, rows, k in GEMV_SHAPES:
                if row_bytes(t, k) is None:
                    continue
                w = make_weights(t, rows, k, rng)
                for layout in layouts(t):
                    wl = prepared(t, layout, w, rows, k, threads)
                    # Interleaved with the bandwidth loop (A B A B ...) so both see the same load
                    # on a shared machine; the best of each is compared.
                    sec, case_bw = float("inf"), 0.0
                    for _ in range(rounds):
                        case_bw = max(case_bw, K.bench_read_bandwidth(case_bw_bytes, threads, 2))
                        sec = min(sec, K.bench_matmul(t, wl, rows, k, 1, threads, reps,
                                                      repacked=layout == "repacked"))
                    gbps = w.nbytes / sec / 1e9
                    row = dict(type=t, layout=layout, isa=isa, shape=label, rows=rows, k=k, n=1, threads=threads,
                               seconds=sec, gbps=gbps, read_bandwidth_gbps=case_bw / 1e9,
                               pct_of_bandwidth=100.0 * gbps * 1e9 / case_bw)
                    rows_out.append(row)
                    print(f"{t:7} {layout:8} {label:26} {1:4} {sec * 1e3:9.3f} {gbps:7.2f} "
                          f"{row['pct_of_bandwidth']:6.1f} {'':>8}", flush=True)
                del w
            label, rows, k = GEMM_SHAPE
            if row_bytes(t, k) is None:
                continue
            w = make_weights(t, rows, k, rng)
            for layout in layouts(t):
                wl = prepared(t, layout, w, rows, k, threads)
                for n in GEMM_N:
                    sec = K.bench_matmul(t, wl, rows, k, n, threads, max(2, reps // 4),
                                         repacked=layout == "repacked")
                    gflops = 2.0 * rows * k * n / sec / 1e9
                    gbps = w.nbytes / sec / 1e9
                    row = dict(type=t, layout=layout, isa=isa, shape=label, rows=rows, k=k, n=n, threads=threads,
                               seconds=sec, gbps=gbps, read_bandwidth_gbps=bw / 1e9,
                               pct_of_bandwidth=100.0 * gbps * 1e9 / bw, gflops=gflops)
                    rows_out.append(row)
                    print(f"{t:7} {layout:8} {label:26} {n:4} {sec * 1e3:9.3f} {gbps:7.2f} "
                          f"{row['pct_of_bandwidth']:6.1f} {gflops:8.1f}", flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bw-bytes", type=int, default=1 << 30, help="bandwidth buffer size (default 1 GiB)")
    ap.add_argument("--reps", type=int, default=8, help="timed GEMV calls per case (best is kept)")
    ap.add_argument("--types", nargs="+", help="types to run (default: all the active ISA supports)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.threads) or args.reps < 1:
        print("--threads and --reps must be >= 1", file=sys.stderr)
        return 1
    unknown = sorted(set(args.types or []) - set(K.supported_types(K.active_isa())))
    if unknown:
        print(f"no {K.active_isa()} kernels for: {', '.join(unknown)}", file=sys.stderr)
        return 1
    results = run(args.threads, args.bw_bytes, args.reps, args.types)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"\nwrote {args.out} ({len(results)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
