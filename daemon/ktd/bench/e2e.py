"""End-to-end benchmark: ktd vs llama.cpp on the same GGUF file and thread count, in one run.

    python -m ktd.bench.e2e [--models NAME ...] [--threads 1 2] [--reps 5] [--quick]

For every model and thread count both engines are opened, then measured interleaved — each
repetition runs every test on both engines back to back, the engine that goes first alternating
between repetitions (A B, B A, ...) so that a load change on this shared machine hits both alike.
The quoted ratio ktd/llama.cpp is the median of the per-repetition ratios (docs/PERFORMANCE.md).
Before the first repetition every engine is warmed up untimed (a pp128 and 8 decode steps; ktd
also until its decode prefetch tuning is over: ktd.bench.finish_decode_prefetch_tuning).

Tests, as llama-bench measures them:
- ``pp128`` / ``pp512``: one forward of N prompt tokens as one batch on an empty KV cache (logits
  for the last row only); tokens/s = N / seconds.
- ``tg128``: after a short prompt (not timed), 128 single-token forwards, each fed the greedy
  (argmax) token of the previous one; tokens/s = 128 / seconds. The argmax is timed on both sides.

Decode is also reported as % of the DRAM ceiling: read bandwidth (measured in this run with the
same thread count, streaming a buffer far larger than the L3 cache) ÷ bytes read per token
(``ktd.model.inspect``), twice: against the peak (the best of ``--bw-reps`` passes before the run, or
of the passes during that model's decode where one of those was faster: the bandwidth may rise
while the run goes on) and against the bandwidth measured during decode (``BRACKET_PASSES`` passes
right before and as many right after every repetition's tg128 pair, median): on a virtual machine
whose memory bandwidth drifts with its neighbours' load the two differ, and the second is what the
decode loop could have had. One pass on each side (as before) gave 6 passes at ``--reps 3``, too
few on a Zen 3 whose passes vary by ~11%: one such run put a model's decode at 101-105% of their
median. A pass during decode is one pass of one loop, the read loop that was fastest before the run
(``read_bandwidth_loop``; ``ktd.bench.kernels.best_read_loop``), not the best of every loop: that
would be the best of four samples, on a Zen 3 0-5% above one loop's median, against a tg128
that is one. The per-token cost of the Python harness itself is measured and reported.
A model whose bytes per token are under 4x the last-level cache is flagged cache-assisted (``*``):
part of its weight stream comes from the cache, so its % of the ceiling is not comparable with
other machines. The report names the CPU, its caches and the kernels' ISA. Where ktd's default
kernels use AVX-512 (and KTD_ISA is not set), a third engine, ``ktd-avx2``, is measured by default
beside the other two: ktd with ``KTD_ISA=avx2`` in a process of its own (KtdChildRunner; the
kernels are chosen once per process), interleaved like them, with its ratio against llama.cpp
(``avx2/llama``), the default kernels' gain over it (``ktd/avx2``) and its % of the ceiling: the
AVX2 path an AVX2-only server (a Zen 3) would run, on this machine's memory.

A third engine, ``llama-bench``, is a peer's own ``llama-bench`` binary (llama.cpp's, or
ik_llama.cpp's with its kernels and options: ``--llama-bench PATH --llama-bench-args "-fmoe 1 -rtr 1"``),
run once per measurement (``-r 1 -o json``, its own timer; ``-p N -n 0`` for ppN, ``-p 0 -n 128`` for
tg128, which llama-bench runs on an empty context instead of after the 16-token prompt, and with
its own token ids, so no greedy comparison) interleaved with the other engines like them, and
reported with its own ktd/peer ratio.

Results go to ``bench/results/bench.json`` and a plot ``bench/results/bench.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ktd.bench import finish_tuning_greedy, write_results
from ktd.bench.e2e_suite import ENGINES, PP_TESTS, TESTS, TG_TEST, TG_TOKENS

SCHEMA = "ktd.bench.e2e/1"
DEFAULT_ENGINES = ("ktd", "llama.cpp")
# ktd with KTD_ISA=<isa>, in a process of its own (the kernels are chosen once per process).
ISA_ENGINES = {"ktd-avx2": "avx2"}
# Read-bandwidth passes right before and right after each tg128 pair (the %@tg columns).
BRACKET_PASSES = 4
TG_PROMPT_TOKENS = 16      # the short prompt before decode (not timed)
N_CTX = 1024               # >= 512 (pp512) and >= TG_PROMPT_TOKENS + TG_TOKENS
N_BATCH = 512              # llama.cpp n_batch = n_ubatch: pp512 is one physical batch
CACHE_ASSIST_FACTOR = 4     # bytes/token under 4x the last-level cache: the row is cache-assisted
MIN_BW_BYTES = 1 << 30     # read-bandwidth buffer: far larger than any L3 cache (32 MiB here)
DEFAULT_OUT = Path("bench/results/bench.json")
# Prompt text (code, as the models are coder models), repeated until long enough.
PROMPT_TEXT = (
    "def quicksort(items):\n"
    "    \"\"\"Sort a list with the quicksort algorithm and return a new list.\"\"\"\n"
    "    if len(items) <= 1:\n"
    "        return list(items)\n"
    "    pivot, rest = items[0], items[1:]\n"
    "    smaller = [x for x in rest if x < pivot]\n"
    "    larger = [x for x in rest if x >= pivot]\n"
    "    return quicksort(smaller) + [pivot] + quicksort(larger)\n\n"
)


# --- models (data: add MoE files and the daemon path here) ---------------------------------

@dataclasses.dataclass(frozen=True)
class BenchModel:
    name: str
    resolve: Callable[[], Path]   # path of the GGUF file; may fetch it; raises if unavailable


def _known_model(name: str) -> Callable[[], Path]:
    def resolve() -> Path:
        from ktd.ops import models
        return models.fetch(name)
    return resolve


def _synthetic(file: str, writer: str) -> Callable[[], Path]:
    """A synthetic benchmark file from ${KTD_CACHE:-~/.cache/ktd}/synthetic. Writing one takes
    minutes and several GB, so an absent file is reported unavailable with the command that writes
    it (`writer`), not generated here."""
    def resolve() -> Path:
        cache = Path(os.environ.get("KTD_CACHE") or Path.home() / ".cache" / "ktd")
        path = cache / "synthetic" / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is absent; write it with `{writer}` (minutes, several GB)")
        return path
    return resolve


def _synthetic_moe(arch: str, variant: str | None = None, preset: str = "bench") -> Callable[[], Path]:
    """A synthetic MoE benchmark file (tests/models/synthetic_moe.py, `preset`, Q4_K_M)."""
    v = f"-{variant}" if variant else ""
    return _synthetic(f"{arch}{v}-{preset}-q4_k_m-s0.gguf",
                      f"python -m tests.models.synthetic_moe --preset {preset} --arch {arch}")


MODELS: list[BenchModel] = [
    BenchModel("qwen2.5-coder-0.5b", _known_model("qwen2.5-coder-0.5b")),
    BenchModel("qwen2.5-coder-1.5b", _known_model("qwen2.5-coder-1.5b")),
    BenchModel("gemma-3-270m", _known_model("gemma-3-270m")),
    # Shaped like Qwen3-30B-A3B (12 of 48 layers) and DeepSeek-V2-Lite (10 of 27 layers).
    BenchModel("synthetic-qwen3moe-bench", _synthetic_moe("qwen3moe")),
    BenchModel("synthetic-deepseek2-v2-bench", _synthetic_moe("deepseek2", "v2")),
]
# Run only when named (--models): for decode figures that come from DRAM where the last-level
# cache holds most of the files above (every row above cache-assisted on a 300-480 MiB L3).
# A Qwen2.5-7B-shaped dense Q4_K_M of random valid blocks (tests/models/synthetic_dense.py, 4.4 GB
# read per token), and the two MoE bench files' shapes with all the real model's layers and a
# quarter of its experts (tests/models/synthetic_moe.py, preset dram): what Qwen3-30B-A3B and
# DeepSeek-V2-Lite read per token (1.9 and 1.6 GB), in files of 5.3 and 3.2 GB.
EXTRA_MODELS: list[BenchModel] = [
    BenchModel("synthetic-qwen2-7b-bench", _synthetic("qwen2-7b-bench-q4_k_m-s0.gguf",
                                                      "python -m tests.models.synthetic_dense")),
    BenchModel("synthetic-qwen3moe-dram", _synthetic_moe("qwen3moe", preset="dram")),
    BenchModel("synthetic-deepseek2-v2-lite-dram", _synthetic_moe("deepseek2", "v2-lite", preset="dram")),
]


# --- pure computation (unit-tested) --------------------------------------------------------

def ceiling_tokens_per_s(read_bandwidth: float, bytes_per_token: int) -> float:
    """Decode tokens/s if every weight byte read per token streamed at the read bandwidth (B/s)."""
    if read_bandwidth <= 0 or bytes_per_token <= 0:
        raise ValueError(f"ceiling needs positive bandwidth and bytes per token, "
                         f"got {read_bandwidth} B/s and {bytes_per_token} B")
    return read_bandwidth / bytes_per_token


def pct_of(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return 100.0 * value / reference


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def paired_ratios(samples: list[dict], model: str, threads: int, test: str,
                  num: str = "ktd", den: str = "llama.cpp") -> list[float]:
    """num/den tokens/s per repetition, for the repetitions where both engines were measured."""
    by_rep: dict[int, dict[str, float]] = {}
    for s in samples:
        if s["model"] == model and s["threads"] == threads and s["test"] == test:
            by_rep.setdefault(s["rep"], {})[s["engine"]] = s["tokens_per_s"]
    return [r[num] / r[den] for _, r in sorted(by_rep.items()) if num in r and den in r and r[den] > 0]


def overhead_share(overhead_s: Sequence[float], tokens_per_s: Sequence[float]) -> dict[str, float | None]:
    """Median harness seconds per decode step, and its % of the median step (1 / tokens/s)."""
    ov = median_or_none(overhead_s)
    step = median_or_none([1.0 / x for x in tokens_per_s])
    return {"seconds_per_token": ov, "pct_of_step": pct_of(ov, step)}


def leading_agreement(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    """How many leading tokens two greedy continuations share."""
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarise(*, model_names: Sequence[str], engines: Sequence[str], threads: Sequence[int],
              tests: Sequence[str], samples: list[dict], unavailable: dict[tuple[str, str], str],
              read_bandwidth: dict[int, float], bytes_per_token: dict[str, int | None],
              greedy: dict[tuple[str, str, int], list[int]] | None = None,
              overhead: list[dict] | None = None, config: dict | None = None,
              llc_bytes: int | None = None, bw_samples: list[dict] | None = None) -> dict[str, Any]:
    """The report written to bench.json, from the raw per-repetition samples.

    samples: {model, engine, threads, test, rep, tokens_per_s}; unavailable: (model, engine) ->
    reason (those rows get tokens_per_s None and the reason); read_bandwidth: threads -> B/s;
    greedy: (model, engine, threads) -> tg tokens of the first repetition; llc_bytes: the
    last-level cache a worker sees: a model reading fewer than CACHE_ASSIST_FACTOR times that per
    token is flagged ``cache_assisted`` (part of its stream comes from the cache, so its % of the
    DRAM ceiling is not comparable with other machines'); bw_samples: {model, threads, rep,
    bytes_per_s}, the read bandwidth measured around each repetition's tg128 pair (the ceiling's
    ``during_decode``: their median).
    """
    greedy = greedy or {}
    bw_samples = bw_samples or []
    rows, ratios, ceilings = [], [], []
    for model in model_names:
        for t in threads:
            for test in tests:
                for engine in engines:
                    vals = [s["tokens_per_s"] for s in samples if (s["model"], s["engine"], s["threads"],
                                                                   s["test"]) == (model, engine, t, test)]
                    row: dict[str, Any] = {"model": model, "engine": engine, "threads": t, "test": test,
                                           "tokens_per_s": median_or_none(vals), "samples": vals}
                    if not vals:
                        row["unavailable"] = unavailable.get((model, engine), "not measured")
                    rows.append(row)
                r = paired_ratios(samples, model, t, test)
                over = {peer: paired_ratios(samples, model, t, test, den=peer) for peer in engines if peer != "ktd"}
                entry: dict[str, Any] = {"model": model, "threads": t, "test": test,
                                         "ktd_over_llama_cpp": median_or_none(r), "per_rep": r,
                                         "ktd_over": {peer: median_or_none(v) for peer, v in over.items()},
                                         "per_rep_over": over}
                isa_over = {e: paired_ratios(samples, model, t, test, num=e) for e in engines if e in ISA_ENGINES}
                if isa_over:   # the other ISA's ktd against llama.cpp, the same way
                    entry["isa_engine_over_llama_cpp"] = {e: median_or_none(v) for e, v in isa_over.items()}
                if test == TG_TEST:
                    entry["greedy_tokens_agreeing"] = leading_agreement(
                        greedy.get((model, "ktd", t)), greedy.get((model, "llama.cpp", t)))
                ratios.append(entry)
            bpt, bw = bytes_per_token.get(model), read_bandwidth.get(t)
            tg = {r["engine"]: r["tokens_per_s"] for r in rows
                  if (r["model"], r["threads"], r["test"]) == (model, t, TG_TEST)}
            during = [b["bytes_per_s"] for b in bw_samples if (b["model"], b["threads"]) == (model, t)]
            # The peak: the best pass before the run, or one during this model's decode if that was
            # faster (the machine's bandwidth rose): a ceiling below a pass it saw would put decode
            # over 100%.
            peak_from = "before the run"
            if during and (bw is None or max(during) > bw):
                bw, peak_from = max(during), "during decode"
            ceiling = ceiling_tokens_per_s(bw, bpt) if bpt and bw else None
            entry = {"model": model, "threads": t, "ceiling_tokens_per_s": ceiling,
                     "peak_read_bandwidth_bytes_per_s": bw, "peak_from": peak_from,
                     "decode_pct_of_ceiling": {e: pct_of(tg.get(e), ceiling) for e in engines},
                     "during_decode": None}
            if during and bpt:
                bw_tg = statistics.median(during)
                c_tg = ceiling_tokens_per_s(bw_tg, bpt)
                entry["during_decode"] = {
                    "read_bandwidth_bytes_per_s": bw_tg, "samples": during, "ceiling_tokens_per_s": c_tg,
                    "decode_pct_of_ceiling": {e: pct_of(tg.get(e), c_tg) for e in engines}}
            ceilings.append(entry)
    return {
        "schema": SCHEMA,
        "config": config or {},
        "read_bandwidth": [{"threads": t, "bytes_per_s": read_bandwidth.get(t)} for t in threads],
        "models": [{"name": m, "bytes_per_token": bytes_per_token.get(m),
                    "cache_assisted": cache_assisted(bytes_per_token.get(m), llc_bytes)} for m in model_names],
        "rows": rows,
        "ratios": ratios,
        "ceiling": ceilings,
        "harness_overhead": overhead or [],
        "samples": samples,
    }


def cache_assisted(bytes_per_token: int | None, llc_bytes: int | None) -> bool | None:
    """True when a cache of llc_bytes can hold a noticeable share of one token's weight stream."""
    if not bytes_per_token or not llc_bytes:
        return None
    return bytes_per_token < CACHE_ASSIST_FACTOR * llc_bytes


ROW_KEYS = {"model": str, "engine": str, "threads": int, "test": str}


def validate_report(report: dict) -> None:
    """Raise ValueError unless the report has the bench.json schema (what readers rely on)."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"bench report: {what}")

    need(report.get("schema") == SCHEMA, f"schema must be {SCHEMA!r}")
    for key in ("rows", "read_bandwidth", "models", "ratios", "ceiling"):
        need(isinstance(report.get(key), list), f"'{key}' must be a list")
    for row in report["rows"]:
        for key, typ in ROW_KEYS.items():
            need(isinstance(row.get(key), typ), f"row {row}: '{key}' must be {typ.__name__}")
        need(row["engine"] in ENGINES, f"row {row}: engine must be one of {ENGINES}")
        need(row["test"] in TESTS, f"row {row}: test must be one of {TESTS}")
        tps = row.get("tokens_per_s", "absent")
        if tps is None:
            need(isinstance(row.get("unavailable"), str), f"row {row}: no tokens_per_s and no reason")
        else:
            need(isinstance(tps, float) and tps > 0, f"row {row}: tokens_per_s must be a positive number")
    for bw in report["read_bandwidth"]:
        need(isinstance(bw.get("threads"), int), f"read_bandwidth {bw}: 'threads' must be int")
        need(bw.get("bytes_per_s") is None or bw["bytes_per_s"] > 0, f"read_bandwidth {bw}: bad bytes_per_s")
    for m in report["models"]:
        need(isinstance(m.get("name"), str), f"models {m}: 'name' must be str")
        need(m.get("bytes_per_token") is None or (isinstance(m["bytes_per_token"], int)
                                                  and m["bytes_per_token"] > 0),
             f"models {m}: bytes_per_token must be a positive int or null")


def format_table(report: dict) -> str:
    """The human-readable summary: one line per (model, threads, test).

    One column group per peer engine of the run (llama.cpp when only ktd ran): engines not in the
    report (``--engines ktd``) print as "-", like an engine that failed.
    """
    peers = [e for e in report.get("config", {}).get("engines", DEFAULT_ENGINES) if e != "ktd"] or ["llama.cpp"]
    engines = ["ktd", *peers]
    short = {"llama.cpp": "llama", "llama-bench": "lbench", "ktd-avx2": "avx2"}
    rows = {(r["model"], r["threads"], r["test"], r["engine"]): r for r in report["rows"]}
    absent = {"tokens_per_s": None, "unavailable": "not run (--engines)"}
    ratios = {(r["model"], r["threads"], r["test"]): r for r in report["ratios"]}
    ceil = {(c["model"], c["threads"]): c for c in report["ceiling"]}
    # ceiling in tokens/s at the peak bandwidth; "@tg": against the bandwidth measured during decode
    head = f"{'model':22} {'thr':>3} {'test':6} {'ktd t/s':>9}"
    for p in peers:
        head += f" {short.get(p, p) + ' t/s':>10} {'ktd/' + short.get(p, p):>10}"
        if p in ISA_ENGINES:
            head += f" {short.get(p, p) + '/llama':>11}"
    head += f" {'ceiling':>8}" + "".join(f" {short.get(e, e) + ' %ceil':>12}" for e in engines)
    head += "".join(f" {short.get(e, e) + ' %@tg':>11}" for e in engines)
    lines = [head, "-" * len(head)]
    notes: dict[str, str] = {}
    assisted = {m["name"]: m.get("cache_assisted") for m in report["models"]}
    for (model, t, test), rat in ratios.items():
        tps = []
        for e in engines:
            r = rows.get((model, t, test, e), absent)
            tps.append(r["tokens_per_s"])
            if r["tokens_per_s"] is None:
                notes[f"{model} {e}"] = r["unavailable"]
        name = model[:21] + ("*" if assisted.get(model) else "")
        over = rat.get("ktd_over") or {"llama.cpp": rat["ktd_over_llama_cpp"]}
        line = f"{name:22} {t:3d} {test:6} {_num(tps[0], '9.2f')}"
        for p, tp in zip(peers, tps[1:]):
            line += f" {_num(tp, '10.2f')} {_num(over.get(p), '10.3f')}"
            if p in ISA_ENGINES:
                line += f" {_num((rat.get('isa_engine_over_llama_cpp') or {}).get(p), '11.3f')}"
        if test == TG_TEST:
            c = ceil[(model, t)]
            pct = c["decode_pct_of_ceiling"]
            during = (c.get("during_decode") or {}).get("decode_pct_of_ceiling", {})
            line += f" {_num(c['ceiling_tokens_per_s'], '8.1f')}"
            line += "".join(f" {_num(pct.get(e), '12.1f')}" for e in engines)
            line += "".join(f" {_num(during.get(e), '11.1f')}" for e in engines)
        lines.append(line)
    return "\n".join(lines + _footnotes(report, engines, short, notes))


def _num(x: float | None, fmt: str) -> str:
    """``x`` formatted, or "-" in the same width."""
    width = fmt.split(".")[0]
    return format("-", f">{width}") if x is None else format(x, fmt)


def _footnotes(report: dict, engines: list[str], short: dict[str, str], notes: dict[str, str]) -> list[str]:
    """The lines under format_table's table: read bandwidths, bytes per token, harness overhead,
    the ISA engines, what was not available (``notes``), the machine and its load."""
    lines = []
    for bw in report["read_bandwidth"]:
        gbps = bw["bytes_per_s"] / 1e9 if bw["bytes_per_s"] else None
        lines.append(f"read bandwidth, {bw['threads']} thread(s): {_num(gbps, '.2f')} GB/s (peak: best pass before "
                     f"the run; the ceiling and %ceil columns unless a pass during a model's decode beat it)")
    for c in report["ceiling"]:
        if c.get("peak_from") == "during decode":
            lines.append(f"peak for {c['model']} {c['threads']}t: {c['peak_read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
                         f"a pass during its decode (faster than the best before the run)")
    for c in report["ceiling"]:
        d = c.get("during_decode")
        if d:
            gb = [x / 1e9 for x in d["samples"]]
            lines.append(f"read bandwidth during {c['model']} {c['threads']}t decode: median "
                         f"{d['read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s of {len(gb)} passes "
                         f"({min(gb):.2f}-{max(gb):.2f}; the %@tg columns)")
    for m in report["models"]:
        mb = m["bytes_per_token"] / 1e6 if m["bytes_per_token"] else None
        lines.append(f"{m['name']}: {_num(mb, '.1f')} MB read per token"
                     + (" (* cache-assisted: under 4x the last-level cache; its % of the DRAM ceiling"
                        " is not comparable with other machines)" if m.get("cache_assisted") else ""))
    for ov in report.get("harness_overhead", []):
        where = f"{ov['model']} {ov['engine']}" + (f" {ov['threads']}t" if ov["threads"] else "")
        share = f" ({ov['pct_of_step']:.2f}% of a step)" if ov["pct_of_step"] is not None else ""
        lines.append(f"harness overhead, {where} {ov['test']}: {ov['seconds_per_token'] * 1e6:.0f} µs/token"
                     f"{share} — {ov['how']}")
    for e in engines:
        if e in ISA_ENGINES:
            lines.append(f"{short[e]}: ktd with KTD_ISA={ISA_ENGINES[e]} (a process of its own, same file and "
                         f"threads): ktd/{short[e]} is the default kernels' gain over that path")
    for what, reason in notes.items():
        lines.append(f"{what}: not available: {reason}")
    cfg = report.get("config", {})
    if cfg.get("cpu_model_name") is not None:
        from ktd.ops import machine
        llc = cfg.get("last_level_cache") or {}
        cpuid_l3 = cfg.get("cpuid_l3_bytes")
        lines.append(f"machine: {cfg['cpu_model_name']} (family {cfg.get('cpu_family')} model "
                     f"{cfg.get('cpu_model')}), kernels {machine.kernel_isa_words(cfg.get('isa'), cfg.get('isa_by_type'))}"
                     + (f" (decode prefetch {machine.prefetch_name(cfg['decode_prefetch'])})" if "decode_prefetch" in cfg else "")
                     + ", "
                     + (f"L{llc['level']} {llc['bytes'] >> 20} MiB per instance (sysfs)" if llc else "no cache in sysfs")
                     + (f", CPUID L3 {cpuid_l3 >> 20} MiB" if cpuid_l3 and cpuid_l3 != llc.get("bytes") else ""))
    load = cfg.get("loadavg_start", [0.0])[0]   # before the run: others' load, not ours
    if cfg.get("cpu_count") and load > 0.5 * cfg["cpu_count"]:
        lines.append(f"note: the machine was busy before the run (1-min load average {load:.1f} on "
                     f"{cfg['cpu_count']} CPUs): absolute tokens/s are low and noisy; read the ratios")
    return lines


# --- engines under test --------------------------------------------------------------------

class Runner(Protocol):
    n_vocab: int | None   # logits per row (known after the first decode)

    def prefill(self, tokens: np.ndarray) -> float:
        """Seconds for one forward of int32 tokens [n] on an empty KV cache."""
        ...

    def decode(self, prompt: np.ndarray, n: int) -> tuple[float, list[int]]:
        """Prefill `prompt` (untimed), then n timed greedy single-token steps: (seconds of the steps,
        the n + 1 greedy tokens: the prompt's next token, then one per step)."""
        ...

    def close(self) -> None: ...


class EngineUnavailable(Exception):
    """The engine cannot be measured on this model (the reason is reported in its rows)."""


class KtdRunner:
    """ktd through the daemon's Engine protocol (ktd.server.engine_api.Engine), sequence slot 0."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.n_vocab: int | None = None   # from the first logits seen
        self._one_tok = np.zeros(1, np.int32)
        self._one_pos = np.zeros(1, np.int32)
        self._one_seq = np.zeros(1, np.int32)
        self._one_want = np.ones(1, np.bool_)

    @classmethod
    def open(cls, path: Path, threads: int) -> KtdRunner:
        try:
            from ktd.server.engine import Engine
        except ImportError as e:
            if e.name == "ktd.server.engine":
                raise EngineUnavailable("ktd.server.engine missing") from e
            raise EngineUnavailable(f"ktd.server.engine import failed: {e}") from e
        try:
            return cls(Engine.open(str(path), n_ctx=N_CTX, n_seq_max=1, threads=threads))
        except Exception as e:  # unsupported architecture, bad file, ...: reported in its rows
            raise EngineUnavailable(f"ktd.server.engine cannot open {path.name}: {type(e).__name__}: {e}") from e

    def _forward_prompt(self, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        want = np.zeros(n, np.bool_)
        want[-1] = True
        return self.engine.forward(np.ascontiguousarray(tokens, np.int32), np.arange(n, dtype=np.int32),
                                   np.zeros(n, np.int32), want)

    def prefill(self, tokens: np.ndarray) -> float:
        self.engine.free_seq(0)
        t0 = time.perf_counter()
        self._forward_prompt(tokens)
        return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, n: int) -> tuple[float, list[int]]:
        self.engine.free_seq(0)
        logits = self._forward_prompt(prompt)
        self.n_vocab = logits.shape[-1]
        token = int(np.argmax(logits[-1]))
        out = [token]
        t0 = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + n):
            self._one_tok[0] = token
            self._one_pos[0] = pos
            token = int(np.argmax(self.engine.forward(self._one_tok, self._one_pos, self._one_seq,
                                                      self._one_want)[0]))
            out.append(token)
        return time.perf_counter() - t0, out

    def finish_tuning(self, prompt: np.ndarray) -> int:
        """Untimed one-row steps after ``prompt`` until the decode prefetch tuning is over
        (ktd.bench.finish_decode_prefetch_tuning): without them the first repetition's tg128 ran
        the rest of the tuning, ~4% slower here (a 7B-shaped decode, 7.00 against 7.41 tokens/s)."""
        self.engine.free_seq(0)
        token = int(np.argmax(self._forward_prompt(prompt)[-1]))
        return finish_tuning_greedy(self.engine, token, len(prompt))[0]

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine = None


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API (ctypes), as llama-bench drives it: one
    llama_decode per batch, n_threads = n_threads_batch, n_batch = n_ubatch = 512, CPU only,
    the library's defaults otherwise (F16 KV cache, flash attention 'auto')."""

    _log_callback = None   # kept alive: llama.cpp holds the pointer

    def __init__(self, path: Path, threads: int):
        try:
            import llama_cpp as L
        except ImportError as e:
            raise EngineUnavailable(f"llama-cpp-python not installed (make oracle): {e}") from e
        self.L = L
        if LlamaCppRunner._log_callback is None:
            LlamaCppRunner._log_callback = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(LlamaCppRunner._log_callback, ctypes.c_void_p())
            L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise EngineUnavailable(f"llama.cpp cannot load {path}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = N_CTX
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = False          # its own timers: the harness overhead is measured with them
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineUnavailable(f"llama.cpp cannot create a context for {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self._one = (L.llama_token * 1)()
        # Per decode call: llama.cpp's own decode seconds (perf timers), for the overhead figure.
        self.last_decode_internal_s: float | None = None

    def _eval(self, arr: ctypes.Array, n: int) -> None:
        rc = self.L.llama_decode(self.ctx, self.L.llama_batch_get_one(arr, n))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _argmax_last(self) -> int:
        logits = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prefill(self, tokens: np.ndarray) -> float:
        arr = (self.L.llama_token * len(tokens))(*tokens.tolist())
        self._clear()
        t0 = time.perf_counter()
        self._eval(arr, len(tokens))
        self.L.llama_synchronize(self.ctx)
        return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, n: int) -> tuple[float, list[int]]:
        arr = (self.L.llama_token * len(prompt))(*prompt.tolist())
        self._clear()
        self._eval(arr, len(prompt))
        token = self._argmax_last()
        self.L.llama_perf_context_reset(self.ctx)
        one, out = self._one, [token]
        t0 = time.perf_counter()
        for _ in range(n):
            one[0] = token
            self._eval(one, 1)
            token = self._argmax_last()
            out.append(token)
        dt = time.perf_counter() - t0
        perf = self.L.llama_perf_context(self.ctx)
        self.last_decode_internal_s = perf.t_eval_ms / 1e3 if perf.n_eval == n else None
        return dt, out

    def close(self) -> None:
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None


def argmax_overhead_s(n_vocab: int, reps: int = 200) -> float:
    """Seconds per decode step that both harness loops spend outside the engine besides the call
    itself: setting the one-token inputs and the argmax over n_vocab float32 logits."""
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    one = np.zeros(1, np.int32)
    t0 = time.perf_counter()
    for i in range(reps):
        one[0] = i
        int(np.argmax(logits))
    return (time.perf_counter() - t0) / reps


# --- the run -------------------------------------------------------------------------------

def prompt_tokens(path: Path, n: int) -> np.ndarray:
    """n token ids of PROMPT_TEXT (repeated) with the model's own tokenizer (ktd's, held equal
    to llama.cpp's by the tokenizer tests); no BOS/special tokens."""
    from ktd.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT_TEXT, add_special=False)
    return np.asarray(ids[:n], np.int32)


class LlamaBenchRunner:
    """A peer's ``llama-bench`` binary, one process per measurement (module docstring): its own
    timer (avg_ns of one repetition) is the figure; model loading is outside it."""

    def __init__(self, exe: str | None, path: Path, threads: int, extra_args: Sequence[str] = ()):
        found = shutil.which(exe) if exe else shutil.which("llama-bench")
        if not found:
            raise EngineUnavailable(f"llama-bench {'not executable: ' + exe if exe else 'not found on PATH'} "
                                    f"(--llama-bench PATH)")
        self.exe, self.path, self.threads, self.extra = found, path, threads, list(extra_args)
        self.n_vocab: int | None = None

    def command(self, n_prompt: int, n_gen: int) -> list[str]:
        return [self.exe, "-m", str(self.path), "-t", str(self.threads), "-p", str(n_prompt), "-n", str(n_gen),
                "-b", str(N_BATCH), "-ub", str(N_BATCH), "-ngl", "0", "-r", "1", "-o", "json", *self.extra]

    def _seconds(self, n_prompt: int, n_gen: int) -> float:
        cmd = self.command(n_prompt, n_gen)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{shlex.join(cmd)}: {e}") from e
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            results = json.loads(proc.stdout)
            (hit,) = [r for r in results if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen]
            seconds = float(hit["avg_ns"]) / 1e9
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"{shlex.join(cmd)}: no single pp{n_prompt}/tg{n_gen} result with avg_ns in "
                               f"its JSON output ({type(e).__name__}: {e})") from e
        if not seconds > 0:
            raise RuntimeError(f"{shlex.join(cmd)}: avg_ns {hit['avg_ns']} is not positive")
        return seconds

    def prefill(self, tokens: np.ndarray) -> float:
        return self._seconds(len(tokens), 0)

    def decode(self, prompt: np.ndarray, n: int) -> tuple[float, list[int] | None]:
        return self._seconds(0, n), None

    def close(self) -> None:
        pass


class KtdChildRunner:
    """ktd with ``KTD_ISA=isa`` in a child process (``python -m ktd.bench.e2e --serve-engine``): the
    AVX2 path of an AVX-512 CPU, measured in the same run as the default one. The child times its
    own forwards exactly as KtdRunner does (the pipe is outside the timed part) and answers one
    JSON line per request on its stdout (its other output goes to stderr)."""

    def __init__(self, path: Path, threads: int, isa: str):
        from ktd import _native

        if not (_native.kernels.isa_compiled(isa) and _native.kernels.isa_supported(isa)):
            raise EngineUnavailable(f"KTD_ISA={isa}: not compiled into this build or not run by this CPU")
        self.isa = isa
        self.n_vocab: int | None = None
        self.proc = subprocess.Popen([sys.executable, "-m", "ktd.bench.e2e", "--serve-engine", str(path),
                                      "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "KTD_ISA": isa})
        try:
            self.info = self._call(op="open")["info"]
        except EngineUnavailable:
            self.close()
            raise

    def _call(self, **request: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise EngineUnavailable(f"the KTD_ISA={self.isa} engine process exited ({self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise EngineUnavailable(answer["error"]) if request["op"] == "open" else RuntimeError(answer["error"])
        return answer

    def prefill(self, tokens: np.ndarray) -> float:
        return float(self._call(op="prefill", tokens=[int(t) for t in tokens])["seconds"])

    def decode(self, prompt: np.ndarray, n: int) -> tuple[float, list[int]]:
        a = self._call(op="decode", prompt=[int(t) for t in prompt], n=n)
        self.n_vocab = a["n_vocab"]
        return float(a["seconds"]), list(a["tokens"])

    def finish_tuning(self, prompt: np.ndarray) -> int:
        return int(self._call(op="finish_tuning", prompt=[int(t) for t in prompt])["steps"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()   # end of requests: the child closes its engine and exits
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def serve_engine(path: str, threads: int) -> int:
    """The child of KtdChildRunner: a KtdRunner on ``path`` serving JSON-line requests (open,
    prefill, decode, finish_tuning) from stdin until it closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # anything else printed goes to stderr, not into the answers

    def answer(**a: Any) -> None:
        proto.write(json.dumps(a) + "\n")

    runner: KtdRunner | None = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "open":
                runner = KtdRunner.open(Path(path), threads)
                answer(info=runner.engine.info())
                continue
            assert runner is not None, "open first"
            if op == "prefill":
                answer(seconds=runner.prefill(np.array(req["tokens"], np.int32)))
            elif op == "decode":
                sec, out = runner.decode(np.array(req["prompt"], np.int32), int(req["n"]))
                answer(seconds=sec, tokens=out, n_vocab=runner.n_vocab)
            elif op == "finish_tuning":
                answer(steps=runner.finish_tuning(np.array(req["prompt"], np.int32)))
            else:
                answer(error=f"unknown request {op!r}")
        except Exception as e:  # reported by the parent in this engine's rows
            answer(error=f"{type(e).__name__}: {e}")
    if runner is not None:
        runner.close()
    return 0


def default_engines() -> list[str]:
    """ktd and llama.cpp, and ktd-avx2 where ktd's default kernels use AVX-512 for some type and
    KTD_ISA does not fix the ISA: the AVX2 path is then measured beside them (ratios against
    llama.cpp and its own % of the ceiling)."""
    from ktd import _native
    from ktd.ops import machine
    engines = list(DEFAULT_ENGINES)
    if os.environ.get("KTD_ISA") or "avx2" not in machine.runnable_isas():
        return engines
    isas = {_native.kernels.active_isa(), *machine.kernel_isa_by_type().values()}
    if "avx512" in isas:
        engines.insert(1, "ktd-avx2")
    return engines


# --llama-bench PATH and --llama-bench-args (set by main; run() callers pass them in `peer`).
@dataclasses.dataclass
class PeerBench:
    exe: str | None = None
    args: tuple[str, ...] = ()


def open_runner(engine: str, path: Path, threads: int, peer: PeerBench | None = None) -> Runner:
    if engine == "ktd":
        return KtdRunner.open(path, threads)
    if engine in ISA_ENGINES:
        return KtdChildRunner(path, threads, ISA_ENGINES[engine])
    if engine == "llama-bench":
        peer = peer or PeerBench()
        return LlamaBenchRunner(peer.exe, path, threads, peer.args)
    return LlamaCppRunner(path, threads)


def measure(runner: Any, test: str, tokens: np.ndarray) -> tuple[float, list[int] | None]:
    """(tokens/s, greedy tokens for tg) of one repetition of one test."""
    if test == TG_TEST:
        sec, out = runner.decode(tokens[:TG_PROMPT_TOKENS], TG_TOKENS)
        return TG_TOKENS / sec, out
    n = PP_TESTS[test]
    return n / runner.prefill(tokens[:n]), None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Collected:
    """What a run gathers, filled in model by model (see ``summarise`` for the shapes)."""
    samples: list[dict] = dataclasses.field(default_factory=list)
    unavailable: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    greedy: dict[tuple[str, str, int], list[int]] = dataclasses.field(default_factory=dict)
    overhead: list[dict] = dataclasses.field(default_factory=list)
    engine_info: list[dict] = dataclasses.field(default_factory=list)
    bw_samples: list[dict] = dataclasses.field(default_factory=list)
    n_vocab: int | None = None

    def fail(self, model: str, engine: str, what: str, e: Exception) -> None:
        self.unavailable[(model, engine)] = f"failed: {type(e).__name__}: {e}"
        log(f"{model} {engine}: failed {what}: {type(e).__name__}: {e}")


def _bench_threads(c: _Collected, model: str, path: Path, tokens: np.ndarray, threads: int,
                   engines: Sequence[str], tests: Sequence[str], reps: int,
                   sample_bandwidth: Callable[[int], float] | None = None, peer: PeerBench | None = None) -> None:
    """Open every engine on `path` with `threads`, warm up, then `reps` interleaved repetitions;
    sample_bandwidth(threads) (B/s) is measured BRACKET_PASSES times right before and as many right
    after each tg128 pair."""
    runners: dict[str, Any] = {}
    for name in engines:
        try:
            runners[name] = open_runner(name, path, threads, peer)
        except EngineUnavailable as e:
            c.unavailable[(model, name)] = str(e)
            log(f"{model} {name}: not available: {e}")
    try:
        if "ktd" in runners:   # what the engine chose (ISA, threads, repacked bytes ...)
            c.engine_info.append({"model": model, "threads": threads, "info": runners["ktd"].engine.info()})
        for name in ISA_ENGINES:
            if name in runners:
                c.engine_info.append({"model": model, "threads": threads, "engine": name, "info": runners[name].info})
        for name, r in list(runners.items()):   # warm-up: page the weights in, build graphs
            try:
                r.prefill(tokens[:PP_TESTS["pp128"]])
                r.decode(tokens[:TG_PROMPT_TOKENS], 8)
                if isinstance(r, (KtdRunner, KtdChildRunner)):
                    r.finish_tuning(tokens[:TG_PROMPT_TOKENS])
            except Exception as e:  # reported in its rows; the other engine is still measured
                c.fail(model, name, "in warm-up", e)
                runners.pop(name).close()
        internal: dict[str, list[float]] = {}   # engine -> harness seconds per decode step

        def bracket_passes(rep: int) -> None:
            c.bw_samples.extend({"model": model, "threads": threads, "rep": rep,
                                 "bytes_per_s": sample_bandwidth(threads)} for _ in range(BRACKET_PASSES))

        for rep in range(reps):
            order = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for test in tests:
                bracket = test == TG_TEST and sample_bandwidth is not None and bool(runners)
                if bracket:
                    bracket_passes(rep)
                for name in order:
                    if name not in runners:
                        continue
                    r = runners[name]
                    try:
                        tps, out = measure(r, test, tokens)
                    except Exception as e:
                        c.fail(model, name, f"in {test}", e)
                        runners.pop(name).close()
                        continue
                    c.samples.append({"model": model, "engine": name, "threads": threads, "test": test,
                                      "rep": rep, "tokens_per_s": tps})
                    log(f"{model} {threads}t rep {rep} {test:6} {name:9} {tps:8.2f} tokens/s")
                    c.n_vocab = c.n_vocab or r.n_vocab
                    if out is not None:
                        c.greedy.setdefault((model, name, threads), out)
                        if isinstance(r, LlamaCppRunner) and r.last_decode_internal_s is not None:
                            internal.setdefault(name, []).append(
                                (TG_TOKENS / tps - r.last_decode_internal_s) / TG_TOKENS)
                if bracket:
                    bracket_passes(rep)
        for name, per_token in internal.items():
            tg = [s["tokens_per_s"] for s in c.samples
                  if (s["model"], s["engine"], s["threads"], s["test"]) == (model, name, threads, TG_TEST)]
            c.overhead.append({"model": model, "engine": name, "threads": threads, "test": TG_TEST,
                               "how": "wall time minus llama.cpp's eval timer (an upper bound: also counts "
                                      "llama_decode's work outside that timer)",
                               **overhead_share(per_token, tg)})
    finally:
        for r in runners.values():
            r.close()


def run(models: Sequence[BenchModel], engines: Sequence[str], threads: Sequence[int], tests: Sequence[str],
        reps: int, bw_bytes: int, bw_reps: int, peer: PeerBench | None = None) -> dict[str, Any]:
    from ktd import _native
    from ktd.ops import machine
    from ktd.model.inspect import inspect_model

    load_start = os.getloadavg()
    features = _native.cpu_features()
    llc = machine.last_level_cache()
    from ktd.bench.kernels import best_read_loop

    read_bandwidth: dict[int, float] = {}
    read_loop: dict[int, int] = {}   # the loop of the passes during decode, per thread count
    # The passes during decode read one buffer per thread count, kept for the whole run: fresh
    # buffers, allocated, faulted in and freed at every pass, slowed the decode steps after them
    # (ktd.bench.decode's doc).
    buffers: dict[int, Any] = {}

    def read_buffer(th: int) -> Any:
        if th not in buffers:
            buffers[th] = _native.kernels.ReadBuffer(bw_bytes, th)
        return buffers[th]

    for t in threads:
        read_bandwidth[t] = _native.kernels.bench_read_bandwidth(bw_bytes, t, bw_reps)
        read_loop[t] = int(best_read_loop(bw_bytes, t))
        log(f"read bandwidth, {t} thread(s): {read_bandwidth[t] / 1e9:.2f} GB/s "
            f"(best of {bw_reps} passes over {bw_bytes >> 20} MiB); passes during decode: the loop "
            f"prefetching {read_loop[t]} bytes ahead, the fastest now")

    c = _Collected()
    bytes_per_token: dict[str, int | None] = {}
    for m in models:
        try:
            path = m.resolve()
            bytes_per_token[m.name] = int(inspect_model(str(path))["bytes_per_token"]["total"])
            tokens = prompt_tokens(path, max(PP_TESTS.values()))
        except Exception as e:  # a missing/broken file: report it in the rows, measure the rest
            for name in engines:
                c.unavailable[(m.name, name)] = f"model not available: {e}"
            bytes_per_token[m.name] = None
            log(f"{m.name}: not available: {e}")
            continue
        c.n_vocab = None
        for t in threads:
            _bench_threads(c, m.name, path, tokens, t, engines, tests, reps,
                           lambda th: read_buffer(th).read(read_loop[th]), peer)
        if c.n_vocab:
            c.overhead.append({"model": m.name, "engine": "both", "threads": None, "test": TG_TEST,
                               "how": "input setting + argmax over n_vocab logits, timed alone",
                               "seconds_per_token": argmax_overhead_s(c.n_vocab), "pct_of_step": None})

    config = {
        "reps": reps, "tests": list(tests), "threads": list(threads), "engines": list(engines),
        "n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_BATCH, "tg_prompt_tokens": TG_PROMPT_TOKENS,
        "read_bandwidth_buffer_bytes": bw_bytes, "read_bandwidth_passes": bw_reps,
        "read_bandwidth_loop": {str(t): pf for t, pf in read_loop.items()},
        "llama_cpp_python": _version("llama_cpp_python"),
        "llama_bench": ({"exe": peer.exe, "args": list(peer.args)} if peer and "llama-bench" in engines else None),
        "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
        "cpu_count": os.cpu_count(), "isa": _native.kernels.active_isa(), "ktd_engine_info": c.engine_info,
        "isa_by_type": machine.kernel_isa_by_type(),
        "decode_prefetch": _native.kernels.decode_prefetch(),
        "cpu_model_name": features.model_name or features.vendor, "cpu_family": features.family,
        "cpu_model": features.model, "last_level_cache": llc, "cpuid_l3_bytes": machine.cpuid_l3_bytes(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return summarise(model_names=[m.name for m in models], engines=engines, threads=threads, tests=tests,
                     samples=c.samples, unavailable=c.unavailable, read_bandwidth=read_bandwidth,
                     bytes_per_token=bytes_per_token, greedy=c.greedy, overhead=c.overhead, config=config,
                     llc_bytes=llc["bytes"] if llc else None, bw_samples=c.bw_samples)


def _version(dist: str) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_json(report: dict, out: Path) -> None:
    validate_report(report)
    write_results(report, out)


def select_models(names: Iterable[str] | None, quick: bool) -> list[BenchModel]:
    known = {m.name: m for m in MODELS + EXTRA_MODELS}
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return [known[n] for n in names]
    return MODELS[:1] if quick else list(MODELS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", metavar="NAME",
                    help=f"models to run (default: all: {', '.join(m.name for m in MODELS)}; on request: "
                         f"{', '.join(m.name for m in EXTRA_MODELS)})")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, help="interleaved repetitions per test (default 5; 2 with --quick)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=None,
                    help="engines to measure (default: ktd llama.cpp, plus ktd-avx2 where ktd's kernels use AVX-512 "
                         "and KTD_ISA is not set, and llama-bench with --llama-bench)")
    ap.add_argument("--llama-bench", metavar="PATH",
                    help="a peer's llama-bench binary (llama.cpp's or ik_llama.cpp's), measured as engine llama-bench")
    ap.add_argument("--llama-bench-args", default="", metavar="ARGS",
                    help='extra llama-bench options, one shell-quoted string (ik_llama.cpp: "-fmoe 1 -rtr 1")')
    ap.add_argument("--quick", action="store_true",
                    help="first model only (unless --models), 2 repetitions (unless --reps)")
    ap.add_argument("--bw-bytes", type=int, default=MIN_BW_BYTES,
                    help=f"read-bandwidth buffer in bytes (default and minimum {MIN_BW_BYTES >> 20} MiB)")
    ap.add_argument("--bw-reps", type=int, default=5, help="read-bandwidth passes (best is kept)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results; the PNG is written beside it")
    ap.add_argument("--serve-engine", metavar="PATH", help=argparse.SUPPRESS)  # KtdChildRunner's child
    args = ap.parse_args(argv)
    if args.serve_engine:
        return serve_engine(args.serve_engine, args.threads[0])
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    if reps < 1 or args.bw_reps < 1 or any(t < 1 for t in args.threads):
        ap.error("--reps, --bw-reps and --threads must be >= 1")
    if args.bw_bytes < MIN_BW_BYTES:
        ap.error(f"--bw-bytes must be >= {MIN_BW_BYTES} (1 GiB): the buffer must be far larger than the "
                 f"last-level cache, or the ceiling is a cache bandwidth, not DRAM's")
    try:
        models = select_models(args.models, args.quick)
    except ValueError as e:
        ap.error(str(e))
    threads = list(dict.fromkeys(args.threads))
    engines = list(args.engines or default_engines())
    if args.llama_bench and "llama-bench" not in engines:
        engines.append("llama-bench")
    peer = PeerBench(args.llama_bench, tuple(shlex.split(args.llama_bench_args)))
    report = run(models, list(dict.fromkeys(engines)), threads, TESTS, reps, args.bw_bytes, args.bw_reps, peer)
    write_json(report, args.out)
    print(format_table(report))
    png = args.out.with_suffix(".png")
    try:
        from ktd.bench.e2e_plot import write_png
    except ImportError as e:
        if e.name != "matplotlib":
            raise
        print(f"wrote {args.out}; no plot: matplotlib is not installed (it comes with requirements-dev.txt)")
        return 0
    write_png(report, png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
