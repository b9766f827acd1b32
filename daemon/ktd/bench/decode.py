"""Decode as % of the DRAM read ceiling, measured fairly on a shared, noisy machine.

    python -m ktd.bench.decode MODEL [--threads 1 2] [--tokens 32] [--context 16]
                               [--weights-map arena|gguf] [--breakdown | --ab-prefetch]
                               [--out bench/results/decode.json]

Each decode step (one single-token forward + the greedy argmax, as ``ktd.bench.e2e``'s tg) is
followed by one read-bandwidth pass over a buffer of the model's bytes per token (``ktd
inspect``) with the same thread count (``ReadBuffer``, a summing loop on 2 MiB pages where THP
allows; one buffer for the whole measurement, allocated and written before the first step: fresh
buffers, allocated, faulted in and freed four times a step, had made the steps after them 1.5x as
slow on a KVM guest, so the decode was measured against the benchmark's own memory churn). Step
and bandwidth therefore see the same load at the same moment, and the figure reported is the
median step against the median pass: the same statistic on both sides. Comparing a median
decode rate with a best-of bandwidth taken at another moment (or a figure from another run)
understates or overstates the percentage by as much as the machine's noise, 10-20% here.

A pass is one pass of one loop. Every step is followed by one pass of each loop
(``READ_BANDWIDTH_PREFETCH``: plain, and prefetching 2-8 KiB ahead, as the kernels prefetch; the
order rotates from step to step), and the ceiling is the loop whose passes have the highest median
(``read_loop_prefetch``; every loop's median is in ``read_loop_medians``), so each loop's median
is taken over as many passes as there are steps. The highest of several medians is itself biased
upwards (each is a noisy estimate, and the maximum picks the luckiest), the less so the more
passes each has. On a Zen 3 whose passes vary by ~11% (standard deviation) from one to the next,
with the loops' medians within 4-7% of each other (every loop after each of 48 steps of
Qwen2.5-Coder-1.5B and 64 of the 0.5B), bootstrap resampling put the highest median at 1.1-2.7%
above the highest median of all the passes with 12 passes per loop (the loops taking turns, as
this tool did before), and 0.2-0.9% with all 48-64. A pass that kept the best of all the loops
(as it did before that) is the best of four samples against one decode step: 3.0% above the best
loop's median (12 rounds of the two, interleaved, 0.98 GB).

``--breakdown`` also times every block of the forward natively while it decodes
(``Context.set_profiling``: embedding, norms, residual adds, q/k/v projections, attention over
the KV cache, output projection, dense FFN, MoE FFN, output head) and prints where a step's time
goes: per block its milliseconds per step, the weight bytes it streams per token (the GGUF's
tensors mapped to the block that reads them) and that stream as % of the bandwidth measured in
the same run; what the forward does outside the blocks and the step's time outside the forward
(Python, pybind11, argmax) are rows of their own. Block times are medians over the steps, as the
headline's step (the native sums are read after every step: a step descheduled by the host no
longer inflates every block, as the means did, 161 ms against a 140 ms median step in one such
run) and include each block's hand-over to the thread pool and
its wait for the slowest worker; the pool's own counters (``Context.set_pool_stats``) then say how
much of it that is: pool regions and barriers per step, the calling thread's wait for the slowest
worker at the end of each region and inside barriers, the delay from a region's release to its
start on each worker, and each worker's busy share of the step. Process CPU seconds per step
(``time.process_time``) against threads x wall time tell how much of the step the threads ran at
all: on a shared machine a worker the OS descheduled shows up as join wait with low CPU use.

``--context N`` decodes after a prompt of N tokens instead of 16 (the prompt is not timed): the
attention over the KV cache grows with the context (it reads N + 1 cached rows per layer and
token), while the % of the ceiling counts the weight bytes only, so at a long context the
``attention`` / ``mla_attention`` rows show what the cache costs. ``--compare`` pairs rows of the
same model, thread count and context.

``--ab-prefetch`` checks the decode GEMV's software prefetch modes (``_native.kernels``:
off, l1 = prefetcht0 a few KiB ahead, l2 = prefetcht1 9 KiB ahead, paced; the CPU's default,
``decode_prefetch_default``, is off on AMD Zen 4 and later, l2 on Intel and l1 elsewhere, and
the first one-row steps of a process tune it) on the machine at hand: the steps take the modes in turn,
one step each, so every mode sees the same machine at the same moments, and the row gets each
mode's median step and % of the ceiling and the ratio of its median to off's
(``decode_prefetch_ab``). On a shared host whose bandwidth drifts by 10-20% between runs,
alternating step by step within one process resolves differences of about 1% that separate runs
cannot. The row's own figures are the default mode's steps. Only the x86 kernels read the mode.

The result records the load average before and after, the CPU model, the kernels' ISA (set
``KTD_ISA=avx2`` to run the AVX2 path on an AVX-512 CPU) and the last-level cache, and flags
a model whose bytes per token are under ~4x the L3 as cache-assisted, as ``ktd.bench.e2e`` does,
and the weights arenas' share on huge pages at the end (``arena_huge_share``, read from smaps:
transparent huge pages are a request a fragmented machine refuses, and 4 KiB pages stream slower).
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

from ktd.bench import finish_tuning_greedy, write_results

PROMPT_TOKENS = 16
# How the ceiling was taken (``ceiling_method`` in the results; ``--compare`` says when two files
# differ). Files without it: "rotating-loops" when they have read_loop_prefetch (one loop's pass
# after each step, the loops taking turns), else "best-of-loops" (each pass the best of all loops).
CEILING_METHOD = "every-loop-each-step"

# Blocks of a forward (native/src/model/profile.h), in the order a layer runs them.
BLOCKS = ("embed", "norm", "residual_add", "attention_in", "attention", "attention_out", "mla_attention",
          "glu_ffn", "moe_ffn", "output_head")
# Parts of a block, timed inside it (profile.h): the one-token MoE FFN's three phases, each from the
# calling thread's side (router: its rows, the barrier, the routing; gate_up: the gate/up items and
# the barrier after them; down: the down items and the row sums); the MLA attention's four (project:
# the query's and the latent's projections; absorb: the per-head wk_b into the latent space;
# cache: the attention over the latent KV cache, which reads no weights; decompress: the per-head
# wv_b). Printed under their block; the block's time less theirs is its pool region's set-up,
# hand-over and join (MoE), or the copies between the parts (MLA).
SUB_BLOCKS = {"moe_ffn": ("moe_router", "moe_gate_up", "moe_down"),
              "mla_attention": ("mla_project", "mla_absorb", "mla_cache", "mla_decompress")}


def bytes_per_block(path: str, parts: bool = False) -> dict[str, int]:
    """Weight bytes each forward block streams per decoded token; they sum to ``ktd inspect``'s
    bytes per token (routed experts at n_expert_used/n_expert of their size, lookup tables none
    unless tied to the output head). parts: the bytes of the SUB_BLOCKS instead, which sum to
    their block's."""
    blocks, sub = block_and_part_bytes(path)
    return sub if parts else blocks


def block_and_part_bytes(path: str) -> tuple[dict[str, int], dict[str, int]]:
    """bytes_per_block's two answers, (blocks, parts), from one reading of the file."""
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import LOOKUP_TABLES, OUTPUT_HEAD, TIED_HEAD, bytes_per_token, placement_classes

    f = GGUFFile(path)
    arch = f.metadata.get("general.architecture")
    arch = arch.decode() if isinstance(arch, bytes) else arch
    classes = placement_classes(f)
    per_token = bytes_per_token(f, arch, classes)
    head = per_token["output_head_tensor"]
    mla = any(".attn_kv_a_mqa." in name for name in f.tensors)
    out = dict.fromkeys(BLOCKS, 0)
    sub = {p: 0 for ps in SUB_BLOCKS.values() for p in ps}

    def moe(name: str, nbytes: int) -> None:
        out["moe_ffn"] += nbytes
        # The router's rows, the bias of its choice and the shared expert's gate vector are read
        # while routing; each expert's down matrix in the down phase, gate and up before it.
        if ".ffn_gate_inp" in name or ".exp_probs_b" in name:
            sub["moe_router"] += nbytes
        elif ".ffn_down" in name:
            sub["moe_down"] += nbytes
        else:
            sub["moe_gate_up"] += nbytes

    for t in f.tensors.values():
        name, cls = t.name, classes[t.name]
        if name == head:
            out["output_head"] += t.nbytes
        elif name in LOOKUP_TABLES or name in (OUTPUT_HEAD, TIED_HEAD):
            continue                      # one row per token, not counted (as ktd inspect)
        elif cls == "routed_expert":
            moe(name, t.nbytes // per_token["n_expert"] * per_token["n_expert_used"])
        elif cls in ("shared_expert", "router"):
            moe(name, t.nbytes)
        elif len(t.shape) < 2 or name.startswith("output"):
            out["output_head" if name.startswith("output") else "norm"] += t.nbytes  # norms, biases: vectors
        elif ".attn_output." in name:
            out["attention_out"] += t.nbytes
        elif ".attn_" in name and mla:
            out["mla_attention"] += t.nbytes
            # wk_b takes the query into the latent space, wv_b the output back out; the rest
            # (q or q_a and q_b, kv_a_mqa) are the projections.
            part = "absorb" if ".attn_k_b." in name else "decompress" if ".attn_v_b." in name else "project"
            sub["mla_" + part] += t.nbytes
        elif ".attn_" in name:
            out["attention_in"] += t.nbytes
        elif ".ffn_" in name:
            out["glu_ffn"] += t.nbytes
        else:
            raise ValueError(f"{path}: tensor '{name}' belongs to no forward block this breakdown knows")
    return out, sub


def median_profile(snapshots: Sequence[dict[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    """The native profile's sums (name -> (ns, calls)) read before the first step and after each
    of the steps, as the sums ``breakdown`` takes, but per-step medians: each name's ns is the
    median of its per-step differences times the step count (calls stay the true total)."""
    if len(snapshots) < 2:
        raise ValueError("need the profile before the first step and after at least one")
    steps = len(snapshots) - 1
    out = {}
    for name in set().union(*snapshots):
        ns = [snapshots[i + 1].get(name, (0, 0))[0] - snapshots[i].get(name, (0, 0))[0] for i in range(steps)]
        calls = snapshots[-1].get(name, (0, 0))[1] - snapshots[0].get(name, (0, 0))[1]
        out[name] = (round(statistics.median(ns) * steps), calls)
    return out


def breakdown(profile: dict[str, tuple[int, int]], steps: int, step_seconds: float,
              block_bytes: dict[str, int], bandwidth: float,
              part_bytes: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Rows {block, ms_per_step, pct_of_step, bytes_per_token, gb_per_s, pct_of_bandwidth} from
    the native per-block sums over ``steps`` forwards, the step (s) and the bandwidth (B/s): the
    mean step with the sums as read, the median step with median_profile's.
    A block's timed parts (SUB_BLOCKS, bytes from part_bytes) follow it as rows "block > part",
    which the sums leave out."""
    if steps < 1 or step_seconds <= 0 or bandwidth <= 0:
        raise ValueError("steps, step time and bandwidth must be positive")
    rows = []

    def row(name: str, seconds: float, nbytes: int) -> None:
        rows.append({"block": name, "ms_per_step": seconds * 1e3, "pct_of_step": 100.0 * seconds / step_seconds,
                     "bytes_per_token": nbytes,
                     "gb_per_s": nbytes / seconds / 1e9 if nbytes and seconds > 0 else None,
                     "pct_of_bandwidth": 100.0 * nbytes / seconds / bandwidth if nbytes and seconds > 0 else None})

    parts = 0.0
    for b in BLOCKS:
        ns, calls = profile.get(b, (0, 0))
        if calls == 0 and not block_bytes.get(b):
            continue
        parts += ns / steps / 1e9
        row(b, ns / steps / 1e9, block_bytes.get(b, 0))
        for p in SUB_BLOCKS.get(b, ()):
            pns, pcalls = profile.get(p, (0, 0))
            if pcalls:
                row(f"{b} > {p.split('_', 1)[1]}", pns / steps / 1e9, (part_bytes or {}).get(p, 0))
    forward = profile["forward"][0] / steps / 1e9
    row("forward, outside the blocks", max(forward - parts, 0.0), 0)
    row("step, outside the forward", max(step_seconds - forward, 0.0), 0)
    row("step", step_seconds, sum(block_bytes.values()))
    return rows


def pool_rows(stats: dict[str, Any], steps: int, step_seconds: float, threads: int,
              cpu_seconds: float | None = None) -> dict[str, Any]:
    """Per-step figures from a pool's summed counters (``Context.pool_stats()``) over ``steps``
    steps of mean ``step_seconds``; cpu_seconds: the process's CPU time over those steps."""
    if steps < 1 or step_seconds <= 0 or threads < 1:
        raise ValueError("steps, step time and threads must be positive")
    runs = stats["runs"]
    per_step = {
        "regions_per_step": runs / steps,
        "barriers_per_step": stats["barriers"] / steps,
        "region_ms_per_step": stats["run_ns"] / steps / 1e6,
        "join_wait_ms_per_step": stats["join_wait_ns"] / steps / 1e6,
        "join_sleeps_per_step": stats["join_sleeps"] / steps,
        "barrier_wait_ms_per_step": stats["barrier_wait_ns"] / steps / 1e6,
        "worker_busy_pct_of_step": [100.0 * ns / steps / 1e9 / step_seconds for ns in stats["busy_ns"]],
        # Mean delay from a region's release to its start on workers 1.. (tid 0 starts at once).
        "worker_start_us_mean": [ns / runs / 1e3 if runs else None for ns in stats["start_ns"][1:]],
    }
    if cpu_seconds is not None:
        per_step["cpu_ms_per_step"] = cpu_seconds / steps * 1e3
        per_step["cpu_pct_of_threads_x_wall"] = 100.0 * cpu_seconds / steps / (threads * step_seconds)
    return per_step


def format_pool(p: dict[str, Any]) -> str:
    busy = ", ".join(f"{b:.0f}%" for b in p["worker_busy_pct_of_step"])
    start = ", ".join(f"{s:.1f}" if s is not None else "-" for s in p["worker_start_us_mean"]) or "-"
    lines = [f"  pool (means over the steps): {p['regions_per_step']:.0f} regions and {p['barriers_per_step']:.0f} "
             "barriers per step, "
             f"{p['region_ms_per_step']:.3f} ms/step inside regions, of which the caller waited "
             f"{p['join_wait_ms_per_step']:.3f} ms for the slowest worker at the ends "
             f"({p['join_sleeps_per_step']:.1f} of them asleep) and {p['barrier_wait_ms_per_step']:.3f} ms in barriers",
             f"  pool: workers busy (inside regions) {busy} of the step; start after release {start} us per region"]
    if "cpu_ms_per_step" in p:
        lines.append(f"  process CPU {p['cpu_ms_per_step']:.3f} ms/step = {p['cpu_pct_of_threads_x_wall']:.0f}% of "
                     "threads x wall (below ~100%: threads waited or were descheduled)")
    return "\n".join(lines)


def machine_info(bytes_per_token: int) -> dict[str, Any]:
    """CPU model, kernels' ISA, last-level cache and the cache-assisted flag of ktd.bench.e2e."""
    from ktd import _native
    from ktd.ops import machine
    from ktd.bench.e2e import cache_assisted

    features = _native.cpu_features()
    llc = machine.last_level_cache()
    return {"cpu_model_name": features.model_name or features.vendor, "isa": _native.kernels.active_isa(),
            "isa_by_type": machine.kernel_isa_by_type(),
            "decode_prefetch": _native.kernels.decode_prefetch(),
            "decode_prefetch_state": dict(_native.kernels.decode_prefetch_state()),
            "last_level_cache": llc, "cpu_count": os.cpu_count(),
            "cache_assisted": cache_assisted(bytes_per_token, llc["bytes"] if llc else None)}


def prefetch_words(r: dict[str, Any]) -> str:
    """'decode prefetch off|l1|l2' and where the mode came from (the tuning's medians when tuned)."""
    from ktd.ops.machine import prefetch_name

    st = r.get("decode_prefetch_state") or {}
    words = f"decode prefetch {prefetch_name(r['decode_prefetch'])}"
    if st.get("source") == "tuned":
        return words + ", tuned: step " + ", ".join(f"{name} {ms:.2f} ms"
                                                    for name, ms in zip(PREFETCH_MODES, st["median_ms"]))
    return words + (f", {st['source']}" if st.get("source") else "")


def huge_words(share: float | None) -> str:
    """The weights arenas' share on huge pages at the end of the measurement, as printed."""
    if share is None:
        return "weights not in arenas"
    slower = " (the rest on 4 KiB pages: slower)" if share < 0.9 else ""
    return f"weights arenas {100 * share:.0f}% on huge pages{slower}"


def read_loops_after(step: int) -> list[int]:
    """The read loops (prefetch distances, every one of READ_BANDWIDTH_PREFETCH) of the passes
    after decode step ``step``, in turn, the first one rotating from step to step so that no loop
    always runs first after a step."""
    from ktd import _native

    loops = [int(pf) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH]
    k = step % len(loops)
    return loops[k:] + loops[:k]


def summarize(step_seconds: Sequence[float], bandwidths: Sequence[float], bytes_per_token: int,
              loops: Sequence[int] | None = None, pass_steps: Sequence[int] | None = None) -> dict[str, Any]:
    """Medians of interleaved decode steps (s) and bandwidth passes (B/s), and decode as % of it.
    ``loops``: the read loop of each pass; the ceiling is then the median of the passes of the
    loop whose median is highest, and the pairwise figure takes only the steps followed by one of
    those passes. None: one loop (or passes that are already the best of several).
    ``pass_steps``: the step each pass followed (several passes may follow one step); None: pass
    i followed step i."""
    if not step_seconds or not bandwidths:
        raise ValueError("need at least one decode step and one bandwidth pass")
    if pass_steps is None:
        if len(step_seconds) != len(bandwidths):
            raise ValueError("need as many bandwidth passes as decode steps, at least one")
        pass_steps = range(len(bandwidths))
    elif len(pass_steps) != len(bandwidths) or not all(0 <= i < len(step_seconds) for i in pass_steps):
        raise ValueError("need the step (an index into the steps) of every bandwidth pass")
    if bytes_per_token <= 0 or min(step_seconds) <= 0 or min(bandwidths) <= 0:
        raise ValueError("bytes per token, step times and bandwidths must be positive")
    if loops is not None and len(loops) != len(bandwidths):
        raise ValueError("need the read loop of every bandwidth pass")
    step = statistics.median(step_seconds)
    pairs = [(step_seconds[i], b) for i, b in zip(pass_steps, bandwidths)]
    out: dict[str, Any] = {}
    if loops is None:
        bw = statistics.median(bandwidths)
    else:
        medians = {pf: statistics.median(b for b, lp in zip(bandwidths, loops) if lp == pf)
                   for pf in sorted(set(loops))}
        best = max(medians, key=lambda pf: medians[pf])
        bw = medians[best]
        pairs = [(step_seconds[i], b) for i, b, lp in zip(pass_steps, bandwidths, loops) if lp == best]
        out = {"read_loop_prefetch": best, "read_loop_medians": {str(pf): m for pf, m in medians.items()},
               "read_loop_passes": len(pairs)}
    decode_bps = bytes_per_token / step
    return {
        "tokens": len(step_seconds),
        "median_step_s": step,
        "tokens_per_s": 1.0 / step,
        "decode_bytes_per_s": decode_bps,
        "median_read_bandwidth_bytes_per_s": bw,
        "pct_of_ceiling": 100.0 * decode_bps / bw,
        # The same, pair by pair (each step against the pass right after it).
        "pct_of_ceiling_pairwise_median": statistics.median(100.0 * bytes_per_token / s / b for s, b in pairs),
        **out,
    }


PREFETCH_MODES = ("off", "l1", "l2")  # _native.kernels.decode_prefetch_modes()


def prefetch_ab(steps: Sequence[float], bandwidths: Sequence[float], settings: Sequence[int],
                bytes_per_token: int, loops: Sequence[int] | None = None,
                pass_steps: Sequence[int] | None = None) -> dict[str, Any]:
    """--ab-prefetch: each mode's steps (settings[i] is step i's mode, PREFETCH_MODES) with the
    bandwidth passes that followed them (and their read loops; ``pass_steps`` as summarize's),
    summarized apart, and ``<mode>_over_off`` the ratio of its median step to off's (above 1: the
    prefetch is slower)."""
    followed = list(range(len(bandwidths))) if pass_steps is None else list(pass_steps)

    def setting(val: int) -> dict[str, Any]:
        mine = [i for i, v in enumerate(settings) if v == val]
        index = {i: k for k, i in enumerate(mine)}  # a step's index among this setting's steps
        passes = [j for j, i in enumerate(followed) if i in index]
        return summarize([steps[i] for i in mine], [bandwidths[j] for j in passes], bytes_per_token,
                         None if loops is None else [loops[j] for j in passes],
                         [index[followed[j]] for j in passes])

    out: dict[str, Any] = {name: setting(val) for val, name in enumerate(PREFETCH_MODES)}
    for name in PREFETCH_MODES[1:]:
        out[f"{name}_over_off"] = out[name]["median_step_s"] / out["off"]["median_step_s"]
    return out


def measure(path: str, threads: int, tokens: int, with_breakdown: bool = False,
            weights_map: str = "arena", context: int = PROMPT_TOKENS, ab_prefetch: bool = False) -> dict[str, Any]:
    """Interleaved decode steps and bandwidth passes on one model and thread count, after an
    untimed prompt of ``context`` tokens (``weights_map``: model.weights_map, arena = the repacked
    layout, gguf = the file's plain rows; ``ab_prefetch``: the steps alternate the decode prefetch
    off and on, see the module's doc)."""
    from ktd import _native
    from ktd.server.engine import Engine, arena_huge_pages
    from ktd.model.inspect import inspect_model

    if tokens < 1 or threads < 1 or context < 1:
        raise ValueError("tokens, threads and context must be >= 1")
    if ab_prefetch and (tokens < len(PREFETCH_MODES) or with_breakdown):
        raise ValueError(f"the prefetch A/B needs at least {len(PREFETCH_MODES)} tokens and no breakdown (it would "
                         "mix the modes)")
    bpt = int(inspect_model(path)["bytes_per_token"]["total"])
    eng = Engine.open(path, n_ctx=context + tokens + 1 + _native.kernels.DECODE_PREFETCH_TUNE_STEPS, n_seq_max=1,
                      threads=threads, weights_map=weights_map)
    # A fixed prompt of ordinary token ids; what is generated does not change the bytes read.
    prompt = 100 + np.arange(context) % max(1, eng.n_vocab - 100)
    n = len(prompt)
    logits = eng.forward(prompt, np.arange(n), np.zeros(n), np.arange(n) == n - 1)
    token = int(np.argmax(logits[0]))
    if not ab_prefetch:
        # The process's first one-row steps tune the decode prefetch (kernels.h): untimed here, so
        # the timed steps run the setting it keeps (the A/B fixes each step's setting itself).
        _, token, n = finish_tuning_greedy(eng, token, n)
    steps, bws, loops, pass_steps = [], [], [], []
    # One buffer for every pass, allocated and written before the first step (see the module's doc).
    read_buffer = _native.kernels.ReadBuffer(bpt, threads)
    load_start = os.getloadavg()
    if with_breakdown:
        eng.context.set_profiling(True)
        eng.context.set_pool_stats(True)
    cpu = 0.0
    snapshots = [eng.context.profile()] if with_breakdown else []  # the sums before, then after each step
    settings = [i % len(PREFETCH_MODES) for i in range(tokens)] if ab_prefetch else []
    try:
        for i in range(tokens):
            if ab_prefetch:
                _native.kernels.set_decode_prefetch(settings[i])
            c0 = time.process_time()
            t0 = time.perf_counter()
            logits = eng.forward(np.array([token]), np.array([n + i]), np.zeros(1), np.ones(1, bool))
            token = int(np.argmax(logits[0]))
            steps.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            if with_breakdown:
                snapshots.append(eng.context.profile())
            for pf in read_loops_after(i):
                loops.append(pf)
                pass_steps.append(i)
                bws.append(read_buffer.read(pf))
    finally:
        if ab_prefetch:
            _native.kernels.set_decode_prefetch(-1)  # the CPU's default again
    ab = prefetch_ab(steps, bws, settings, bpt, loops, pass_steps) if ab_prefetch else None
    # With the A/B, the row's own figures are those of the CPU's default setting's steps.
    summary = (ab[PREFETCH_MODES[_native.kernels.decode_prefetch_default()]] if ab is not None
               else summarize(steps, bws, bpt, loops, pass_steps))
    result = {"model": os.path.basename(path), "threads": threads, "context": context, "bytes_per_token": bpt,
              "weights_map": eng.model.memory["weights_map"],
              **summary, "ceiling_method": CEILING_METHOD, **machine_info(bpt),
              "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
              "arena_huge_share": arena_huge_pages(eng.model)["huge_share"]}
    if ab is not None:
        result["decode_prefetch_ab"] = ab
    if with_breakdown:
        blocks, parts = block_and_part_bytes(path)
        result["breakdown"] = breakdown(median_profile(snapshots), tokens, statistics.median(steps), blocks,
                                        summary["median_read_bandwidth_bytes_per_s"], parts)
        result["pool"] = pool_rows(eng.context.pool_stats(), tokens, statistics.fmean(steps), threads, cpu)
        eng.context.set_pool_stats(False)
    del eng, read_buffer  # the weights arena goes before the next thread count maps its own
    return result


def format_prefetch_ab(ab: dict[str, Any], default: int) -> str:
    parts = []
    for name in PREFETCH_MODES:
        if name not in ab:
            continue
        m = ab[name]
        ratio = f", {ab[name + '_over_off']:.3f}x off" if name + "_over_off" in ab else ""
        parts.append(f"{name} {m['median_step_s'] * 1e3:.3f} ms/step ({m['pct_of_ceiling']:.1f}% of the ceiling, "
                     f"{m['tokens']} steps{ratio})")
    return (f"  decode prefetch, the modes in turn step by step: {'; '.join(parts)}; this CPU's default: "
            f"{PREFETCH_MODES[int(default)]}")


def format_breakdown(rows: list[dict[str, Any]]) -> str:
    head = f"  {'block':28} {'ms/step':>8} {'% step':>7} {'MB/token':>9} {'GB/s':>7} {'% of bw':>8}"
    lines = [head]
    for r in rows:
        mb = f"{r['bytes_per_token'] / 1e6:9.1f}" if r["bytes_per_token"] else f"{'-':>9}"
        gbs = f"{r['gb_per_s']:7.2f}" if r["gb_per_s"] is not None else f"{'-':>7}"
        pct = f"{r['pct_of_bandwidth']:8.1f}" if r["pct_of_bandwidth"] is not None else f"{'-':>8}"
        lines.append(f"  {r['block']:28} {r['ms_per_step']:8.3f} {r['pct_of_step']:7.1f} {mb} {gbs} {pct}")
    return "\n".join(lines)


CEILING_NOTES = {
    "best-of-loops": "each pass the best of every read loop, a ceiling 0-5% high as measured on a Zen 3",
    "rotating-loops": "the loops taking turns, the highest of medians of a quarter of the passes, ~1-3% high",
    CEILING_METHOD: "every loop after every step, the highest of medians of all the passes, ~0-1% high",
}


def ceiling_method(row: dict[str, Any]) -> str:
    """How a results row's ceiling was taken (CEILING_METHOD and the older kinds before it)."""
    return row.get("ceiling_method") or ("rotating-loops" if "read_loop_prefetch" in row else "best-of-loops")


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before/after rows per (model, threads, context) present in both results files: decode % of
    the ceiling on each side, and per breakdown block ms/step on each side and the change (a row
    without a context, from before --context, was measured after the 16-token prompt)."""
    def key(r: dict[str, Any]) -> tuple[str, int, int]:
        return r["model"], r["threads"], r.get("context", PROMPT_TOKENS)

    old = {key(r): r for r in before}
    out = []
    for r in after:
        b = old.get(key(r))
        if b is None:
            continue
        row = {"model": r["model"], "threads": r["threads"], "context": key(r)[2],
               "pct_of_ceiling": (b["pct_of_ceiling"], r["pct_of_ceiling"]),
               "tokens_per_s": (b["tokens_per_s"], r["tokens_per_s"]),
               "loadavg_start": (b.get("loadavg_start"), r.get("loadavg_start")),
               "ceiling_method": (ceiling_method(b), ceiling_method(r)),
               "blocks": []}
        ob = {x["block"]: x for x in b.get("breakdown", [])}
        for x in r.get("breakdown", []):
            y = ob.get(x["block"])
            if y is not None:
                row["blocks"].append({"block": x["block"], "ms_before": y["ms_per_step"], "ms_after": x["ms_per_step"],
                                      "ms_change": x["ms_per_step"] - y["ms_per_step"]})
        out.append(row)
    return out


def format_compare(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        (pb, pa), (tb, ta) = r["pct_of_ceiling"], r["tokens_per_s"]
        lb, la = r["loadavg_start"]
        load = f" (load average {lb[0]:.1f} / {la[0]:.1f})" if lb and la else ""
        lines.append(f"{r['model']} {r['threads']} thread(s), context {r['context']}: {tb:.2f} -> {ta:.2f} tok/s, "
                     f"{pb:.1f}% -> {pa:.1f}% of the ceiling{load}")
        mb, ma = r["ceiling_method"]
        if mb != ma:
            lines.append(f"  (the ceilings were taken differently: {mb} before, {ma} after; {CEILING_NOTES[mb]}; "
                         f"{CEILING_NOTES[ma]})")
        for x in r["blocks"]:
            lines.append(f"  {x['block']:28} {x['ms_before']:8.3f} -> {x['ms_after']:8.3f} ms/step ({x['ms_change']:+.3f})")
    return "\n".join(lines) if lines else "no (model, threads, context) in both results files"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.decode", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file or known model name")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=32,
                    help="decode steps (each followed by one bandwidth pass of every read loop)")
    ap.add_argument("--context", type=int, default=PROMPT_TOKENS,
                    help="prompt tokens before the timed decode (the KV cache the attention reads)")
    ap.add_argument("--breakdown", action="store_true",
                    help="time every block of the forward and print where a step's time goes")
    ap.add_argument("--weights-map", choices=("arena", "gguf"), default="arena",
                    help="model.weights_map: arena (repacked, the default) or gguf (the file's plain rows)")
    ap.add_argument("--ab-prefetch", action="store_true",
                    help="alternate the decode GEMV's software prefetch off and on step by step and report both "
                         "(checks this CPU's default)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    ap.add_argument("--compare", type=Path, metavar="BEFORE.json",
                    help="also print this run against an earlier results file (before/after, per block)")
    args = ap.parse_args(argv)
    before = None
    if args.compare is not None:
        import json

        try:
            before = json.loads(args.compare.read_text())
        except (OSError, ValueError) as e:
            print(f"--compare {args.compare}: {e}", file=sys.stderr)
            return 1
    if args.tokens < 1 or args.context < 1 or any(t < 1 for t in args.threads):
        print("--tokens, --context and --threads must be >= 1", file=sys.stderr)
        return 1
    if args.ab_prefetch and (args.tokens < len(PREFETCH_MODES) or args.breakdown):
        print(f"--ab-prefetch needs --tokens >= {len(PREFETCH_MODES)} (a step of each mode) and no --breakdown (the "
              "breakdown would mix the modes)",
              file=sys.stderr)
        return 1
    from ktd.ops import machine
    from ktd.ops import models

    try:
        path = models.resolve(args.model)
    except models.FetchError as e:
        print(e, file=sys.stderr)
        return 1
    rows = []
    for t in args.threads:
        r = measure(path, t, args.tokens, args.breakdown, args.weights_map, args.context, args.ab_prefetch)
        rows.append(r)
        print(f"{r['model']} {t} thread(s), weights_map {r['weights_map']}, context {args.context}: decode {r['tokens_per_s']:.2f} tok/s = "
              f"{r['decode_bytes_per_s'] / 1e9:.2f} GB/s, read bandwidth {r['median_read_bandwidth_bytes_per_s'] / 1e9:.2f}"
              f" GB/s (median step of {r['tokens']}, median pass of the fastest read loop, prefetch "
              f"{r['read_loop_prefetch']}, {r['read_loop_passes']} passes): {r['pct_of_ceiling']:.1f}% of the ceiling",
              flush=True)
        print("  read loops (prefetch bytes: median GB/s): "
              + ", ".join(f"{pf}: {m / 1e9:.2f}" for pf, m in r["read_loop_medians"].items()), flush=True)
        llc = r["last_level_cache"]
        print(f"  {r['cpu_model_name']}, kernels {machine.kernel_isa_words(r['isa'], r.get('isa_by_type'))} "
              f"({prefetch_words(r)}), "
              "last-level cache "
              f"{llc['bytes'] >> 20 if llc else '?'} MiB{' (cache-assisted: bytes/token < 4x the cache, its % of the DRAM ceiling is not comparable)' if r['cache_assisted'] else ''}; "
              f"load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}; "
              f"{huge_words(r.get('arena_huge_share'))}", flush=True)
        if args.ab_prefetch:
            from ktd import _native
            print(format_prefetch_ab(r["decode_prefetch_ab"], _native.kernels.decode_prefetch_default()), flush=True)
        if args.breakdown:
            print(format_breakdown(r["breakdown"]), flush=True)
            print(format_pool(r["pool"]), flush=True)
    write_results(rows, args.out)
    print(f"wrote {args.out}")
    if before is not None:
        print(format_compare(compare(before, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
