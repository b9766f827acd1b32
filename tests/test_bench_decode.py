"""ktd.bench.decode: decode steps and bandwidth passes interleaved, medians on both sides (no
timing asserted: the arithmetic against numpy, and one short run on a real model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ktd.bench import decode as B


def test_summarize_uses_medians_of_both_sides():
    steps = [0.10, 0.08, 0.20, 0.09]
    bws = [12e9, 14e9, 13e9, 11e9]
    bpt = 1_000_000_000
    r = B.summarize(steps, bws, bpt)
    step, bw = float(np.median(steps)), float(np.median(bws))
    assert r["tokens"] == 4
    assert r["median_step_s"] == pytest.approx(step)
    assert r["tokens_per_s"] == pytest.approx(1 / step)
    assert r["median_read_bandwidth_bytes_per_s"] == pytest.approx(bw)
    assert r["pct_of_ceiling"] == pytest.approx(100 * bpt / step / bw)
    pairwise = np.median([100 * bpt / s / b for s, b in zip(steps, bws)])
    assert r["pct_of_ceiling_pairwise_median"] == pytest.approx(pairwise)


@pytest.mark.parametrize("steps, bws, bpt", [([], [], 1), ([0.1], [], 1), ([0.1], [1e9], 0), ([0.0], [1e9], 1),
                                             ([0.1], [-1.0], 1)])
def test_summarize_rejects_bad_input(steps, bws, bpt):
    with pytest.raises(ValueError):
        B.summarize(steps, bws, bpt)


@pytest.mark.realmodel
def test_short_run_on_a_real_model(real_model, tmp_path):
    path = real_model("qwen2.5-coder-0.5b")
    out = tmp_path / "decode.json"
    assert B.main([str(path), "--threads", "1", "--tokens", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    from ktd.inspect import inspect_model

    assert row["threads"] == 1 and row["tokens"] == 2
    assert row["bytes_per_token"] == int(inspect_model(str(path))["bytes_per_token"]["total"])
    assert row["pct_of_ceiling"] == pytest.approx(
        100 * row["bytes_per_token"] / row["median_step_s"] / row["median_read_bandwidth_bytes_per_s"])


def test_main_rejects_bad_arguments(tmp_path):
    assert B.main(["no-such-model.gguf", "--threads", "1", "--out", str(tmp_path / "x.json")]) == 1
    assert B.main(["no-such-model.gguf", "--tokens", "0", "--out", str(tmp_path / "x.json")]) == 1
