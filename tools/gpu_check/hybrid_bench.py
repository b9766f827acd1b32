"""make gpu-check's end-to-end part: the CUDA device backend (model/cuda_device.h) over
libktd_cuda.so against the CPU forward, into one JSON (merged into gpu-check.json by report.py).

- greedy: Qwen2.5-Coder-0.5B (or --model) decoded greedily for --tokens tokens on the CPU and on
  the device (HybridBackend over CudaDevice); identical or the first step where they part.
- moe: per bench file (the synthetic qwen3moe/deepseek2 files of `make synthetic-moe`, or
  --moe paths): prefill and decode tok/s CPU-only vs hybrid on the same machine, and HybridStats
  per decoded token (XN copies, routed experts on the CPU pool, the wait for the device's shared
  expert, the pool's workers asleep per MoE call at --spin-us), and once more with --hot experts of each MoE layer held by the device, the most used
  in the CPU run's routing (the gpu.experts: hot workflow), with their hit rate. An architecture or
  type the device backend refuses is recorded with the reason.

Without a usable CUDA device (or library) this writes the reason into the JSON and exits 2: the
figures are then unmeasured, never silently skipped. --backend cuda-emulated runs the same steps
over the ABI's host emulation (slow; how the script itself is tested without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon"))
sys.path.insert(0, str(ROOT / "tests"))

from ktd import _native  # noqa: E402
from ktd.server.engine import Engine  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/ktd/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _open(path: str, backend: str, args, experts: dict[int, list[int]] | None = None) -> Engine:
    eng = Engine.open(path, n_ctx=args.n_ctx, n_seq_max=1, threads=args.threads)
    if backend != "cpu":
        eng.context.set_backend(backend, device=args.device, experts=experts or {})
    return eng


def hybrid_run(path: str, args, experts: dict[int, list[int]] | None = None) -> dict:
    """speed() on the device backend, with HybridStats per MoE call and the hot experts' hit rate."""
    eng = _open(path, args.backend, args, experts)
    eng.context.pool_spin_us = args.spin_us  # as the daemon does (gpu.pool_spin_us)
    eng.context.set_pool_stats(True)
    before = eng.context.hybrid_stats()
    r = speed(eng, args.prompt, args.decode)
    after = eng.context.hybrid_stats()
    calls = max(1, after["moe_calls"] - before["moe_calls"])
    r["per_moe_call_us"] = {k[:-3]: (after[k] - before[k]) / calls / 1e3 for k in after if k.endswith("_ns")}
    r["stats"] = after
    # whether the pool's workers fell asleep between MoE layers (the spin too short for the device's part)
    r["pool_spin_us"] = eng.context.pool_spin_us
    r["worker_sleeps_per_moe_call"] = eng.context.pool_stats()["worker_sleeps"] / calls
    if experts:
        r["held_per_layer"] = len(next(iter(experts.values())))
        r["hit_rate"] = after["device_pairs"] / max(1, after["routed_pairs"])
    return r


def greedy(eng: Engine, prompt: list[int], n: int) -> list[int]:
    logits = eng.forward(np.array(prompt), np.arange(len(prompt)), np.zeros(len(prompt)), np.ones(len(prompt), bool))
    out = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        logits = eng.forward(np.array([out[-1]]), np.array([len(prompt) + i]), np.zeros(1), np.ones(1, bool))
        out.append(int(np.argmax(logits[0])))
    return out


def speed(eng: Engine, n_prompt: int, n_decode: int) -> dict:
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 300, n_prompt)
    t0, c0 = time.perf_counter(), _cpu_s()
    logits = eng.forward(toks, np.arange(n_prompt), np.zeros(n_prompt), np.eye(1, n_prompt, n_prompt - 1, dtype=bool)[0])
    t1 = time.perf_counter()
    tok = int(np.argmax(logits[-1]))
    for i in range(n_decode):
        logits = eng.forward(np.array([tok]), np.array([n_prompt + i]), np.zeros(1), np.ones(1, bool))
        tok = int(np.argmax(logits[0]))
    t2, c2 = time.perf_counter(), _cpu_s()
    return {"prefill_tok_s": n_prompt / (t1 - t0), "decode_tok_s": n_decode / (t2 - t1),
            "process_cpu_s": c2 - c0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cuda-emulated"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--model", default=os.environ.get("GPU_CHECK_MODEL", str(DEFAULT_MODEL)))
    ap.add_argument("--moe", nargs="*", default=None, help="bench files (default: make synthetic-moe's)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--spin-us", type=int, default=2000, help="the CPU pool's spin in the hybrid runs "
                                                               "(gpu.pool_spin_us)")
    ap.add_argument("--hot", type=int, default=2, help="experts per MoE layer held by the device in a third run "
                                                      "(the most used in the CPU run; 0: no such run)")
    args = ap.parse_args()
    st = dict(_native.cuda_status())
    out: dict = {"backend": args.backend, "status": st, "measured": False}

    def write() -> None:
        Path(args.out).write_text(json.dumps(out, indent=2))

    if args.backend == "cuda" and not st["available"]:
        out["error"] = f"the CUDA device backend cannot run here: {st['reason']}"
        write()
        print(f"hybrid_bench: NOT MEASURED: {out['error']}", file=sys.stderr)
        return 2
    failed = False
    # --- greedy on the real model ---
    if Path(args.model).is_file():
        prompt = list(range(100, 116))
        try:
            cpu = greedy(_open(args.model, "cpu", args), prompt, args.tokens)
            dev = greedy(_open(args.model, args.backend, args), prompt, args.tokens)
            same = cpu == dev
            out["greedy"] = {"model": args.model, "tokens": args.tokens, "identical": same, "cpu": cpu, "device": dev,
                             "first_difference": None if same else next(i for i, (a, b) in enumerate(zip(cpu, dev))
                                                                        if a != b)}
            failed |= not same
        except _native.DeviceError as e:
            out["greedy"] = {"model": args.model, "error": str(e)}
            failed = True
    else:
        out["greedy"] = {"model": args.model, "error": "model file not found (set GPU_CHECK_MODEL or carry it)"}
        failed = True
    # --- MoE bench files: hybrid vs CPU-only ---
    if args.moe is None:
        from models import synthetic_moe
        args.moe = [str(synthetic_moe.default_path("qwen3moe", "bench", "Q4_K_M")),
                    str(synthetic_moe.default_path("deepseek2", "bench", "Q4_K_M", "v2"))]
    out["moe"] = []
    for path in args.moe:
        row: dict = {"file": path}
        out["moe"].append(row)
        if not Path(path).is_file():
            row["error"] = "bench file not found (make synthetic-moe, or pass --moe)"
            failed = True
            continue
        try:
            cpu = _open(path, "cpu", args)
            row["cpu"] = speed(cpu, args.prompt, args.decode)
            row["hybrid"] = hybrid_run(path, args)
            row["decode_speedup"] = row["hybrid"]["decode_tok_s"] / row["cpu"]["decode_tok_s"]
            row["prefill_speedup"] = row["hybrid"]["prefill_tok_s"] / row["cpu"]["prefill_tok_s"]
            counts = np.asarray(cpu.context.expert_counts(), np.int64)  # [n_layer][n_expert]
            if args.hot > 0 and counts.size:
                hot = {il: sorted(int(e) for e in np.argsort(-c, kind="stable")[:args.hot])
                       for il, c in enumerate(counts) if c.any()}
                row["hybrid_hot"] = hybrid_run(path, args, hot)
                row["hot_decode_speedup"] = row["hybrid_hot"]["decode_tok_s"] / row["cpu"]["decode_tok_s"]
        except _native.DeviceError as e:
            row["refused"] = str(e)  # an architecture or type the device backend has no path for
    out["measured"] = True
    write()
    print(json.dumps({k: out[k] for k in ("greedy",) if k in out}, indent=1)[:2000])
    for row in out["moe"]:
        print(row["file"], {k: row.get(k) for k in ("decode_speedup", "prefill_speedup", "hot_decode_speedup",
                                                    "refused", "error")})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
