"""Kernel benchmark: decode GEMV as a fraction of the measured DRAM read bandwidth, and prefill
GEMM throughput, for every type the active ISA has kernels for.

    python -m ktd.bench.kernels [--threads 1 2] [--out bench/results/kernels.json]

The read bandwidth is measured in the same run with the same thread count (a streaming sum over a
buffer much larger than the L3 cache, timed in C++; for each GEMV case it is measured again over
a smaller buffer kept for the thread count, ``ReadBuffer``, interleaved with that case's timing,
and the case's percentage uses that figure), and every matmul is timed in C++ as well
(``ktd._native.kernels.bench_matmul``: best of ``reps`` calls, scratch and pool reused). GEMV shapes
are real-model shapes stacked until the weights are far larger than the L3 cache, so the weights
stream from DRAM as in decode. Weights come from gguf-py's quantizer where it has one for the
type (tiled from a 256-row base), otherwise random bytes (timing does not depend on the values).

Best against best flatters the kernel on a machine whose bandwidth moves from pass to pass: the
fastest of a few GEMV calls meets the fastest of a few read passes, and either may be a lucky one.
So each GEMV case also gets a per-pass figure (``pct_of_bandwidth_per_pass``): PASS_PAIRS single
GEMV calls, each followed by one pass of the read loop that was fastest on this machine
(``read_loop_prefetch``, chosen once per thread count from ``READ_BANDWIDTH_PREFETCH``), and the
median of the pairs' ratios. That is the statistic a decode step sees (``ktd.bench.decode`` compares
medians of single steps and passes), and the one that tells how far the kernel's weight stream is
from the read loop's.

Each GEMV case also gets a cache-resident figure (``hot_gbps``): the same kernel on the first rows
of the matrix, HOT_BYTES_PER_THREAD per worker (fits in any x86/ARM L2), called repeatedly: what
the kernel can consume when memory is not the limit. A kernel whose hot figure is not well above
the read bandwidth (``hot_over_bandwidth`` near 1 or below) is compute-bound at that thread count
and cannot reach the DRAM ceiling whatever the memory system does; the decode breakdown's gap to
the ceiling then lies in the kernel's instructions, not in the weight stream.

Where llama-cpp-python is installed, each case is also timed with llama.cpp's own ggml_mul_mat on
the same bytes, shape and thread count (ktd/bench/ggml_matmul.py; GEMV rounds interleaved with
ktd's), printed as a "llama.cpp" row under the case; --no-llama-cpp leaves it out.

The JSON (--out) has one object per printed row, in the table's units: ``ms`` one matmul call in
milliseconds (the best of the timed calls), ``gbps`` the weight bytes read per second in GB/s
(10^9 B/s), ``read_bandwidth_gbps`` the bandwidth it is compared with, ``pct_of_bandwidth``,
``gflops`` (prefill GEMM only) 2·rows·k·n / time in GFLOP/s; ``rows``, ``k``, ``n`` the shape.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from ktd import _native
from ktd.bench import write_results

K = _native.kernels

# (label, rows, k): Qwen2.5-0.5B output head, its ffn_down, Qwen2.5-1.5B ffn_up; each stacked
# (see stacked_rows) until the weights are several times this machine's L3 cache, so they stream
# from DRAM whatever the cache size (32 MiB on one machine here, 300 MiB on another).
GEMV_SHAPES = [
    ("0.5B output 151936x896", 151936, 896),
    ("0.5B ffn_down", 896, 4864),
    ("1.5B ffn_up", 8960, 1536),
]


def l3_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache of CPU 0 (sysfs ``size``, e.g. ``300M``/``32768K``); 32 MiB if unknown."""
    best = 0
    for index in glob.glob(os.path.join(sysfs, "index*")):
        try:
            text = open(os.path.join(index, "size")).read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or 32 << 20


# Weights and bandwidth buffers are at least this many times the L3 cache.
CACHE_FACTOR = 4
# GEMV / read-pass pairs per case for the per-pass figure (its median).
PASS_PAIRS = 5


def stacked_rows(type_name: str, rows: int, k: int, min_bytes: int) -> int:
    """rows, repeated in whole copies of the matrix until it holds at least min_bytes."""
    per_copy = rows * row_bytes(type_name, k)
    return rows * max(1, -(-min_bytes // per_copy))


# Cache-resident GEMV: weight bytes per worker (well inside a 512 KiB-2 MiB L2).
HOT_BYTES_PER_THREAD = 256 << 10


def hot_rows(type_name: str, rows: int, k: int, threads: int) -> int:
    """Leading rows of a [rows, k] matrix holding about HOT_BYTES_PER_THREAD per worker, a
    multiple of 16 (every repacked layout's row group), at least 16 and at most rows."""
    want = HOT_BYTES_PER_THREAD * threads // row_bytes(type_name, k)
    return min(rows, max(16, want // 16 * 16))


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


def _ggml_row(base: dict, sec: float, bw: float) -> dict:
    """llama.cpp's figures for the case of ``base`` (ktd's row): the same bytes in ``sec`` seconds."""
    scale = base["ms"] / (sec * 1e3)
    gbps = base["gbps"] * scale
    row = dict(base, layout="llama.cpp", isa="ggml", ms=sec * 1e3, gbps=gbps, pct_of_bandwidth=100.0 * gbps * 1e9 / bw)
    for key in ("hot_rows", "hot_gbps", "hot_over_bandwidth", "pct_of_bandwidth_per_pass",
                "read_loop_prefetch"):   # ktd's kernel only
        row.pop(key, None)
    if "gflops" in base:
        row["gflops"] = base["gflops"] * scale
    return row


TABLE_HEADER = (f"{'type':7} {'layout':9} {'shape':26} {'n':>4} {'ms':>9} {'GB/s':>7} {'% bw':>6} {'GFLOP/s':>8}"
                f" {'hot GB/s':>8} {'hot/bw':>6} {'pass %':>6}"
                "   (GEMV % bw: best call against the best bandwidth pass measured alongside that case; "
                "hot: the kernel on cache-resident rows; pass %: median of single calls against single "
                "passes)")


def _print_row(row: dict) -> None:
    """One table row; the columns are the JSON fields ms, gbps, pct_of_bandwidth, gflops, hot_gbps,
    hot_over_bandwidth, pct_of_bandwidth_per_pass."""
    gf = f"{row['gflops']:8.1f}" if "gflops" in row else f"{'':>8}"
    hot = f" {row['hot_gbps']:8.2f} {row['hot_over_bandwidth']:6.2f}" if "hot_gbps" in row else ""
    if "pct_of_bandwidth_per_pass" in row:
        hot += f" {row['pct_of_bandwidth_per_pass']:6.1f}"
    print(f"{row['type']:7} {row['layout']:9} {row['shape']:26} {row['n']:4} {row['ms']:9.3f} "
          f"{row['gbps']:7.2f} {row['pct_of_bandwidth']:6.1f} {gf}{hot}", flush=True)


def best_read_loop(nbytes: int, threads: int) -> int:
    """The prefetch distance (of K.READ_BANDWIDTH_PREFETCH) whose read loop streams ``nbytes``
    fastest here at ``threads`` threads, best of two passes each."""
    return max(K.READ_BANDWIDTH_PREFETCH, key=lambda pf: K.bench_read_bandwidth(nbytes, threads, 2, pf))


def per_pass_pct(weight_bytes: int, pairs: list[tuple[float, float]]) -> float:
    """Median over (GEMV seconds, read bytes/s) pairs of the GEMV's bytes/s as % of its pair's."""
    if not pairs:
        raise ValueError("per_pass_pct needs at least one (seconds, bandwidth) pair")
    return statistics.median(100.0 * weight_bytes / sec / bw for sec, bw in pairs)


def run(threads_list: list[int], bw_bytes: int, reps: int, types: list[str] | None, rounds: int = 3,
        ggml=None) -> list[dict]:
    isa = K.active_isa()
    types = types or K.supported_types(isa)
    rng = np.random.default_rng(0)
    rows_out: list[dict] = []
    # Per-case bandwidth: still CACHE_FACTOR x the L3 cache, cheaper to repeat than the headline buffer.
    min_bytes = CACHE_FACTOR * l3_bytes()
    case_bw_bytes = min(bw_bytes, max(256 << 20, min_bytes))
    bw_bytes = max(bw_bytes, min_bytes)
    print(f"ISA {isa}; types {', '.join(types)}; threads {threads_list}", flush=True)
    for threads in threads_list:
        bw = K.bench_read_bandwidth(bw_bytes, threads, 5)
        loop = best_read_loop(case_bw_bytes, threads)
        print(f"\nread bandwidth, {threads} thread(s): {bw / 1e9:.2f} GB/s "
              f"(best of 5 passes over {bw_bytes >> 20} MiB); per-pass figures against the read loop "
              f"prefetching {loop} bytes ahead, the fastest here", flush=True)
        print(TABLE_HEADER)
        # The per-case passes read one buffer, kept for the thread count: fresh buffers, allocated,
        # faulted in and freed at every pass, slowed what ran after them (ktd.bench.decode's doc).
        case_buf = K.ReadBuffer(case_bw_bytes, threads)
        for t in types:
            for label, base_rows, k in GEMV_SHAPES:
                if row_bytes(t, k) is None:
                    continue
                rows = stacked_rows(t, base_rows, k, min_bytes)
                if rows != base_rows:
                    label = f"{label} x{rows // base_rows}"
                w = make_weights(t, rows, k, rng)
                for layout in layouts(t):
                    wl = prepared(t, layout, w, rows, k, threads)
                    # Interleaved with the bandwidth loop (A B A B ...) so both see the same load
                    # on a shared machine; the best of each is compared.
                    sec, case_bw, ggml_sec = float("inf"), 0.0, float("inf")
                    for _ in range(rounds):
                        case_bw = max([case_bw] + [case_buf.read(pf) for _ in range(2)
                                                   for pf in K.READ_BANDWIDTH_PREFETCH])
                        sec = min(sec, K.bench_matmul(t, wl, rows, k, 1, threads, reps,
                                                      repacked=layout == "repacked"))
                        if ggml is not None and layout == "plain":
                            ggml_sec = min(ggml_sec, ggml.time_matmul(int(GGMLQuantizationType[t]), w, rows, k, 1,
                                                                      threads, reps))
                    # Single calls against single passes of one loop (the module's doc).
                    pairs = [(K.bench_matmul(t, wl, rows, k, 1, threads, 1, repacked=layout == "repacked"),
                              case_buf.read(loop)) for _ in range(PASS_PAIRS)]
                    gbps = w.nbytes / sec / 1e9
                    hr = hot_rows(t, rows, k, threads)
                    w_hot = np.ascontiguousarray(w[:hr])
                    hot_sec = K.bench_matmul(t, prepared(t, layout, w_hot, hr, k, threads), hr, k, 1, threads,
                                             reps * 8, repacked=layout == "repacked")
                    hot_gbps = w_hot.nbytes / hot_sec / 1e9
                    row = dict(type=t, layout=layout, isa=isa, shape=label, rows=rows, k=k, n=1, threads=threads,
                               ms=sec * 1e3, gbps=gbps, read_bandwidth_gbps=case_bw / 1e9,
                               pct_of_bandwidth=100.0 * gbps * 1e9 / case_bw,
                               pct_of_bandwidth_per_pass=per_pass_pct(w.nbytes, pairs), read_loop_prefetch=loop,
                               hot_rows=hr, hot_gbps=hot_gbps,
                               hot_over_bandwidth=hot_gbps * 1e9 / case_bw)
                    rows_out.append(row)
                    _print_row(row)
                    if ggml_sec < float("inf"):
                        rows_out.append(_ggml_row(row, ggml_sec, case_bw))
                        _print_row(rows_out[-1])
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
                               ms=sec * 1e3, gbps=gbps, read_bandwidth_gbps=bw / 1e9,
                               pct_of_bandwidth=100.0 * gbps * 1e9 / bw, gflops=gflops)
                    rows_out.append(row)
                    _print_row(row)
                    if ggml is not None and layout == "plain":
                        gsec = ggml.time_matmul(int(GGMLQuantizationType[t]), w, rows, k, n, threads, max(2, reps // 4))
                        rows_out.append(_ggml_row(row, gsec, bw))
                        _print_row(rows_out[-1])
        del case_buf  # before the next thread count's
    return rows_out


def resolve_types(names: list[str], isa: str) -> list[str]:
    """The GGML type names as the kernels spell them (Q4_K), from names in any case (q4_k, Q4_k),
    in the order given, each once; ValueError naming what is not a GGML type and what has no
    kernels on ``isa``."""
    supported = K.supported_types(isa)
    known = {t.upper(): t for t in [*(t.name for t in GGMLQuantizationType), *supported]}
    out, not_types, no_kernels = [], [], []
    for name in names:
        canonical = known.get(name.upper())
        if canonical is None:
            not_types.append(name)
        elif canonical not in supported:
            no_kernels.append(canonical)
        elif canonical not in out:
            out.append(canonical)
    problems = []
    if not_types:
        problems.append(f"not a GGML type: {', '.join(not_types)}")
    if no_kernels:
        problems.append(f"no {isa} kernels for: {', '.join(no_kernels)}")
    if problems:
        raise ValueError(f"{'; '.join(problems)} (types with {isa} kernels: {', '.join(supported)})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bw-bytes", type=int, default=1 << 30, help="bandwidth buffer size (default 1 GiB)")
    ap.add_argument("--reps", type=int, default=8, help="timed GEMV calls per case (best is kept)")
    ap.add_argument("--types", nargs="+",
                    help="types to run, in any case: Q4_K or q4_k (default: all the active ISA supports)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's figures (ggml_mul_mat)")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.threads) or args.reps < 1:
        print("--threads and --reps must be >= 1", file=sys.stderr)
        return 1
    if args.types:
        try:
            args.types = resolve_types(args.types, K.active_isa())
        except ValueError as e:
            print(f"python -m ktd.bench.kernels: error: {e}", file=sys.stderr)
            return 1
    ggml = None
    if not args.no_llama_cpp:
        from ktd.bench.ggml_matmul import load

        ggml, why = load()
        print(f"llama.cpp figures: {'ggml_mul_mat from llama-cpp-python' if ggml else 'none: ' + why}", flush=True)
    results = run(args.threads, args.bw_bytes, args.reps, args.types, ggml=ggml)
    write_results(results, args.out)
    print(f"\nwrote {args.out} ({len(results)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
