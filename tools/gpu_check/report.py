"""gpu-check's one JSON: the machine, the build, cuda_status(), every test's outcome, and the
benchmark's figures or why there are none (tools/gpu_check/run.sh)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET


def sh(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def tests(junit: str) -> dict:
    out: dict = {"cases": [], "passed": 0, "failed": 0, "skipped": 0}
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no junit report: {e}"}
    for case in root.iter("testcase"):
        outcome, text = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (el.get("message") or "") + ("\n" + el.text[-2000:] if el.text and tag != "skipped" else "")
        out[outcome] += 1
        out["cases"].append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                             "seconds": float(case.get("time") or 0), **({"detail": text} if text else {})})
    return out


def _bench(path: str | None) -> dict:
    """hybrid_bench.py's JSON, or why there is none (never an empty success)."""
    if not path:
        return {"measured": False, "reason": "hybrid_bench.py was not run"}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"measured": False, "reason": f"hybrid_bench.py wrote no readable JSON ({e}): see log_tail"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--junit", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--build-seconds", type=float, required=True)
    ap.add_argument("--pytest-rc", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bench", default=None, help="hybrid_bench.py's JSON")
    a = ap.parse_args()
    try:
        from ktd import _native
        status = dict(_native.cuda_status())
    except Exception as e:  # the build failed: say so in the JSON
        status = {"error": f"{type(e).__name__}: {e}"}
    report = {
        "machine": {"gpu": sh(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                                "--format=csv,noheader"]),
                    "python": sys.version.split()[0], "platform": platform.platform(),
                    "nvcc": sh([shutil.which("nvcc") or "nvcc", "--version"])},
        "build": {"how": a.build, "seconds": a.build_seconds},
        "status": status,
        "tests": {"pytest_rc": a.pytest_rc, **tests(a.junit)},
        "bench": _bench(a.bench),
    }
    with open(a.log, encoding="utf-8", errors="replace") as f:
        report["log_tail"] = f.read()[-4000:]
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    t = report["tests"]
    print(f"gpu-check: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('skipped', 0)} skipped; "
          f"cuda: {status.get('reason') or status.get('error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
