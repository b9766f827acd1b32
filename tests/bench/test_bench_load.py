"""``python -m ktd.bench.load`` (make bench-load) on a tiny model: every row (cat, import, cold,
first, warm, gguf and, with --baseline, before) is timed the given number of rounds and reported; the
first-load rows' directory (emptied before each) is not left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from models.tiny_dense import make_model
from paths import ROOT

ROOT = str(ROOT)


def test_bench_load_times_every_row_and_compares_with_a_baseline(tmp_path):
    model = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    cache = tmp_path / "cache"
    out = tmp_path / "load.json"
    # the baseline here is this checkout itself: only that the pair is run and reported is checked
    r = subprocess.run([sys.executable, "-m", "ktd.bench.load", str(model), "--reps", "2", "--threads", "1",
                        "--cache-dir", str(cache), "--baseline", ROOT, "--out", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "daemon")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "first (cache on, no entry)" in r.stdout and "gguf (weights_map: gguf)" in r.stdout and f"measured alongside: {ROOT}" in r.stdout
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    for k in ("cat", "import", "cold", "first", "warm", "gguf", "before"):
        assert len(row["runs"][k]) == 2 and row[k]["wall_s"] > 0 and row[k]["cpu_s"] >= 0, k
    assert row["before_s"] == row["before"]["wall_s"]
    # the warm rows' entry stays; the first-load directory is gone
    assert [p.suffix for p in cache.iterdir()] == [".ktdw"]
