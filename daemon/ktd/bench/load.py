"""Time to READY against the time it takes to read the file.

    python -m ktd.bench.load [MODEL ...] [--reps 3] [--threads 2] [--cache-dir DIR]
                             [--baseline DIR] [--out bench/results/load.json]

Per model file (default: the 1.5B Qwen model, the deepseek2 and qwen3moe bench files, those that
exist), each measured as a fresh process, page cache warm (one untimed ``cat`` first):

- ``cat``    ``cat FILE > /dev/null``
- ``import`` ``python -c "import ktd.server.engine, ktd._native"``: the fixed start-up of the Python
             process, independent of the model
- ``cold``   ``ktd run FILE --prompt Hi --max-tokens 1`` with the prepared-weights cache off
             (``KTD_MODEL__WEIGHTS_CACHE=off``) and ``model.weights_map: arena`` (as cold, first
             and warm): the first load of a model
- ``first``  the same with the cache on and no entry yet (a fresh directory before each run): the
             first start of a model as installed, which prepares the weights straight into the new
             entry and serves from it
- ``warm``   the same with the cache in ``--cache-dir`` (a directory of its own, filled by one
             untimed run first): every later start
- ``gguf``   the same with ``model.weights_map: gguf`` (``KTD_MODEL__WEIGHTS_MAP=gguf``): the
             matrices served from the file's own mapping, nothing prepared (no cache either)
- ``before`` (``--baseline DIR``: an older checkout of ktd, built in place) its
             ``ktd run`` with ``PYTHONPATH=DIR/daemon``, the cold command's pair

The commands run alternately, ``--reps`` rounds, so that a change of the machine's load hits
all of them alike; each row reports the best round's wall time and the user+system CPU time of
that run (``wait4``'s rusage: on a shared machine CPU time is the steadier figure), and the load
average is printed before and after. The targets: warm ≤ 1.5 × cat + import (``warm_target``);
cold, first (and gguf) ≥ 2× faster than the code before the prepared-weights cache (measured
alongside with ``--baseline``, or given with ``--before FILE=SECONDS``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ktd.bench import write_results

DEFAULT_MODELS = [
    "~/.cache/ktd/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "~/.cache/ktd/synthetic/deepseek2-v2-bench-q4_k_m-s0.gguf",
    "~/.cache/ktd/synthetic/qwen3moe-bench-q4_k_m-s0.gguf",
]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def timed(cmd: Sequence[str], env: dict[str, str] | None = None, stdout: Any = subprocess.DEVNULL) -> tuple[float, float]:
    """(wall seconds, user+system CPU seconds) of one run of cmd; raises on a failure."""
    t0 = time.perf_counter()
    p = subprocess.Popen(list(cmd), env=env, stdout=stdout, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    if p.stderr:
        p.stderr.close()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {err.strip()[-2000:]}")
    return wall, ru.ru_utime + ru.ru_stime


class FreshCacheDir:
    """A cache directory emptied before each use: every run is a first load."""

    def __init__(self, path: str):
        self.path = path

    def empty(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)


def run_cmd(model: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "ktd", "run", model, "--prompt", "Hi", "--max-tokens", "1", "--threads", str(threads)]


def measure(model: str, reps: int, threads: int, cache_dir: str, first: FreshCacheDir,
            baseline: str | None = None) -> dict[str, Any]:
    # cold, first and warm measure the arena map (not the default auto, which serves a miss from
    # the file: the gguf row); the baseline predates model.weights_map.
    base = {**os.environ, "KTD_MODEL__WEIGHTS_CACHE": "off"}
    env_cold = {**base, "KTD_MODEL__WEIGHTS_MAP": "arena"}
    env_warm = {**env_cold, "KTD_MODEL__WEIGHTS_CACHE": cache_dir}
    env_first = {**env_cold, "KTD_MODEL__WEIGHTS_CACHE": first.path}
    cmds: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "cat": (["cat", model], None),
        "import": ([sys.executable, "-c", "import ktd.server.engine, ktd._native"], None),
        "cold": (run_cmd(model, threads), env_cold),
        "first": (run_cmd(model, threads), env_first),
        "warm": (run_cmd(model, threads), env_warm),
        "gguf": (run_cmd(model, threads), {**env_cold, "KTD_MODEL__WEIGHTS_MAP": "gguf"}),
    }
    if baseline:
        cmds["before"] = (run_cmd(model, threads), {**base, "PYTHONPATH": os.path.join(baseline, "daemon")})
    timed(["cat", model])  # the page cache warm for every row
    timed(*cmds["warm"])  # the cache entry written
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    load = [loadavg()]
    for _ in range(reps):
        for name, (cmd, env) in cmds.items():
            if name == "first":
                first.empty()
            runs[name].append(timed(cmd, env))
    load.append(loadavg())
    best = {k: min(v) for k, v in runs.items()}
    row: dict[str, Any] = {"model": model, "bytes": os.path.getsize(model), "loadavg": load,
                           "runs": {k: [list(x) for x in v] for k, v in runs.items()}}
    for k, (wall, cpu) in best.items():
        row[k] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    row["warm_target_s"] = round(1.5 * best["cat"][0] + best["import"][0], 3)
    row["warm_over_cat"] = round(best["warm"][0] / best["cat"][0], 2)
    row["warm_minus_import_over_cat"] = round((best["warm"][0] - best["import"][0]) / best["cat"][0], 2)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="GGUF files (default: the 1.5B model and the two MoE bench files)")
    ap.add_argument("--reps", type=int, default=3, help="alternating rounds (best of)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", help="the warm rows' cache directory (default: a temporary one, removed)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="an older checkout of ktd, built in place (e.g. ../ktd-baseline): its ktd run "
                         "with the cache off is timed alongside, the 'before' of the 2x target")
    ap.add_argument("--before", action="append", default=[], metavar="FILE=SECONDS",
                    help="a cold-load figure from before, per file name, for the 2x target")
    ap.add_argument("--out", type=Path, default=Path("bench/results/load.json"))
    args = ap.parse_args(argv)
    models = [os.path.expanduser(m) for m in (args.models or DEFAULT_MODELS)]
    missing = [m for m in models if not os.path.exists(m)]
    if args.models and missing:
        print(f"not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    models = [m for m in models if m not in missing]
    for m in missing:
        print(f"skipped (not found): {m}", file=sys.stderr)
    # The issue's "before" (ktd run, load + 1 token, before the prepared-weights cache).
    before = {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": 2.44, "deepseek2-v2-bench-q4_k_m-s0.gguf": 3.62,
              "qwen3moe-bench-q4_k_m-s0.gguf": 4.95}
    for b in args.before:
        name, _, sec = b.partition("=")
        before[os.path.basename(name)] = float(sec)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; --threads {args.threads}; best of {args.reps} alternating "
          f"rounds; load average {loadavg()}")
    tmp = None
    cache_dir = args.cache_dir
    if not cache_dir:
        tmp = tempfile.TemporaryDirectory(prefix="ktd-bench-load-")
        cache_dir = tmp.name
    # The first-load entries are as large as the warm ones: next to them (same file system).
    first = FreshCacheDir(os.path.join(cache_dir, "first-load"))
    rows = []
    try:
        for m in models:
            rows.append(measure(m, args.reps, args.threads, cache_dir, first, args.baseline))
            r = rows[-1]
            r["before_s"] = r["before"]["wall_s"] if "before" in r else before.get(os.path.basename(m))
    finally:
        shutil.rmtree(first.path, ignore_errors=True)
        if tmp:
            tmp.cleanup()
    print()
    src = f"measured alongside: {args.baseline}" if args.baseline else "the issue's figures"
    print(f"| file | cat | import | cold (cache off) | first (cache on, no entry) | warm (cache) | "
          f"gguf (weights_map: gguf) | warm target 1.5×cat+import | before ({src}) | cold vs before | "
          f"first vs before | gguf vs before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def cell(k: str) -> str:
            return f"{r[k]['wall_s']:.2f} s ({r[k]['cpu_s']:.2f} CPU)"

        def vs(k: str) -> str:
            return f"{r['before_s'] / r[k]['wall_s']:.2f}×" if r.get("before_s") else "-"
        bef = cell("before") if "before" in r else (f"{r['before_s']:.2f} s" if r.get("before_s") else "-")
        print(f"| {os.path.basename(r['model'])} ({r['bytes'] / 1e9:.1f} GB) | {cell('cat')} | {cell('import')} | "
              f"{cell('cold')} | {cell('first')} | {cell('warm')} | {cell('gguf')} | {r['warm_target_s']:.2f} s "
              f"({'met' if r['warm']['wall_s'] <= r['warm_target_s'] else 'not met'}) | {bef} | {vs('cold')} | "
              f"{vs('first')} | {vs('gguf')} |")
    print(f"\nload average before/after each file: {'; '.join('/'.join(r['loadavg']) for r in rows)}")
    write_results({"cpu": cpu_model(), "threads": args.threads, "reps": args.reps, "baseline": args.baseline,
                   "rows": rows}, args.out)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
