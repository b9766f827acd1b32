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


def test_summarize_with_read_loops_takes_the_loop_with_the_best_median():
    """Passes of several read loops: the ceiling is the highest of the loops' medians (not the
    median of all passes, nor a best-of), and the pairwise figure uses that loop's pairs only."""
    steps = [0.10, 0.08, 0.20, 0.09, 0.11, 0.12, 0.10, 0.07]
    bws = [12e9, 19e9, 13e9, 11e9, 14e9, 15e9, 10e9, 16e9]
    loops = [0, 4096, 0, 4096, 0, 4096, 0, 8192]
    bpt = 1_000_000_000
    r = B.summarize(steps, bws, bpt, loops)
    medians = {pf: float(np.median([b for b, lp in zip(bws, loops) if lp == pf])) for pf in (0, 4096, 8192)}
    assert medians == {0: 12.5e9, 4096: 15e9, 8192: 16e9}
    assert r["read_loop_prefetch"] == 8192 and r["read_loop_passes"] == 1
    assert r["read_loop_medians"] == {str(pf): m for pf, m in medians.items()}
    assert r["median_read_bandwidth_bytes_per_s"] == pytest.approx(16e9) != float(np.median(bws))
    assert r["median_step_s"] == pytest.approx(float(np.median(steps)))
    assert r["pct_of_ceiling"] == pytest.approx(100 * bpt / float(np.median(steps)) / 16e9)
    assert r["pct_of_ceiling_pairwise_median"] == pytest.approx(100 * bpt / 0.07 / 16e9)
    # Without loops: the median of every pass, as before.
    assert B.summarize(steps, bws, bpt)["median_read_bandwidth_bytes_per_s"] == pytest.approx(float(np.median(bws)))
    with pytest.raises(ValueError, match="read loop of every"):
        B.summarize(steps, bws, bpt, loops[:-1])


def test_every_read_loop_follows_every_step_in_rotating_order():
    """Each step is followed by one pass of every loop; the loop that runs first after a step
    changes from step to step and each loop is first equally often."""
    from ktd import _native

    loops = [int(pf) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH]
    after = [B.read_loops_after(i) for i in range(2 * len(loops))]
    assert all(sorted(a) == sorted(loops) for a in after)
    assert [a[0] for a in after] == loops * 2


def test_summarize_with_several_passes_per_step():
    """pass_steps maps each pass to the step it followed: the ceiling is the best loop's median
    over its passes, the pairwise figure pairs each of them with its own step, and the median step
    counts every step once."""
    steps = [0.10, 0.08, 0.20]
    bws = [10e9, 12e9, 11e9, 16e9, 9e9, 13e9]
    loops = [0, 4096, 4096, 0, 0, 4096]
    pass_steps = [0, 0, 1, 1, 2, 2]
    bpt = 1_000_000_000
    r = B.summarize(steps, bws, bpt, loops, pass_steps)
    assert r["tokens"] == 3 and r["median_step_s"] == pytest.approx(0.10)
    assert r["read_loop_medians"] == {"0": 10e9, "4096": 12e9}
    assert r["read_loop_prefetch"] == 4096 and r["read_loop_passes"] == 3
    assert r["pct_of_ceiling"] == pytest.approx(100 * bpt / 0.10 / 12e9)
    pairwise = np.median([100 * bpt / 0.10 / 12e9, 100 * bpt / 0.08 / 11e9, 100 * bpt / 0.20 / 13e9])
    assert r["pct_of_ceiling_pairwise_median"] == pytest.approx(pairwise)
    for bad in ([0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 3], [0, 0, 1, 1, 2, -1]):
        with pytest.raises(ValueError, match="step"):
            B.summarize(steps, bws, bpt, loops, bad)


def test_prefetch_ab_keeps_each_settings_passes_with_its_steps():
    steps = [0.10, 0.20, 0.30, 0.12, 0.22, 0.32]
    settings = [0, 1, 2, 0, 1, 2]
    bws = [10e9, 11e9, 20e9, 21e9, 30e9, 31e9, 12e9, 13e9, 22e9, 23e9, 32e9, 33e9]
    loops = [0, 4096] * 6
    pass_steps = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    ab = B.prefetch_ab(steps, bws, settings, 1_000_000_000, loops, pass_steps)
    assert ab["off"]["read_loop_medians"] == {"0": 11e9, "4096": 12e9}
    assert ab["l1"]["read_loop_medians"] == {"0": 21e9, "4096": 22e9}
    assert ab["l2"]["read_loop_medians"] == {"0": 31e9, "4096": 32e9}
    assert ab["off"]["median_step_s"] == pytest.approx(0.11) and ab["l1"]["median_step_s"] == pytest.approx(0.21)
    assert ab["off"]["read_loop_passes"] == 2 and ab["l1"]["read_loop_passes"] == 2
    assert ab["l1_over_off"] == pytest.approx(0.21 / 0.11) and ab["l2_over_off"] == pytest.approx(0.31 / 0.11)


@pytest.mark.parametrize("steps, bws, bpt", [([], [], 1), ([0.1], [], 1), ([0.1], [1e9], 0), ([0.0], [1e9], 1),
                                             ([0.1], [-1.0], 1)])
def test_summarize_rejects_bad_input(steps, bws, bpt):
    with pytest.raises(ValueError):
        B.summarize(steps, bws, bpt)


@pytest.mark.realmodel
def test_short_run_on_a_real_model(real_model, tmp_path):
    path = real_model("qwen2.5-coder-0.5b")
    out = tmp_path / "decode.json"
    assert B.main([str(path), "--threads", "1", "--tokens", "2", "--breakdown", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    from ktd.model.inspect import inspect_model

    assert row["threads"] == 1 and row["tokens"] == 2
    assert row["bytes_per_token"] == int(inspect_model(str(path))["bytes_per_token"]["total"])
    assert row["pct_of_ceiling"] == pytest.approx(
        100 * row["bytes_per_token"] / row["median_step_s"] / row["median_read_bandwidth_bytes_per_s"])
    # Two steps, each followed by a pass of every loop: each loop has two passes, and the ceiling
    # is the highest of their medians.
    from ktd import _native

    loops = {str(int(pf)) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH}
    assert set(row["read_loop_medians"]) == loops and row["read_loop_passes"] == 2
    assert row["median_read_bandwidth_bytes_per_s"] == max(row["read_loop_medians"].values())
    assert row["median_read_bandwidth_bytes_per_s"] == row["read_loop_medians"][str(row["read_loop_prefetch"])]
    assert row["ceiling_method"] == B.CEILING_METHOD
    blocks = {r["block"]: r for r in row["breakdown"]}
    assert blocks["step"]["bytes_per_token"] == row["bytes_per_token"]
    assert {"attention_in", "attention", "glu_ffn", "output_head"} <= set(blocks)
    assert sum(r["ms_per_step"] for b, r in blocks.items() if b != "step") == pytest.approx(
        blocks["step"]["ms_per_step"], rel=1e-6)
    # The pool's counters and the machine: one thread, so one busy entry and no start delays.
    pool = row["pool"]
    assert pool["regions_per_step"] > 0 and len(pool["worker_busy_pct_of_step"]) == 1
    assert pool["worker_start_us_mean"] == [] and pool["cpu_ms_per_step"] > 0
    assert row["isa"] == _native.kernels.active_isa() and len(row["loadavg_start"]) == 3


def test_main_rejects_bad_arguments(tmp_path):
    assert B.main(["no-such-model.gguf", "--threads", "1", "--out", str(tmp_path / "x.json")]) == 1
    assert B.main(["no-such-model.gguf", "--tokens", "0", "--out", str(tmp_path / "x.json")]) == 1


# --- the per-block breakdown (--breakdown) ------------------------------------------------------

from models import synthetic_moe, tiny_dense  # noqa: E402

TINY = [("dense", a) for a in tiny_dense.ARCHS] + [("moe", "qwen3moe"), ("moe", "deepseek2")]


def _tiny(kind: str, arch: str, tmp_path) -> str:
    path = tmp_path / f"{arch}.gguf"
    if kind == "dense":
        tiny_dense.make_model(arch, path)
    else:
        synthetic_moe.make_model(arch, path, variant="v2" if arch == "deepseek2" else None)
    return str(path)


@pytest.mark.parametrize("kind, arch", TINY)
def test_block_bytes_add_up_to_inspects_bytes_per_token(kind, arch, tmp_path):
    """Every tensor lands in one block, and the blocks' bytes add up to ktd inspect's figure."""
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import inspect_model

    path = _tiny(kind, arch, tmp_path)
    blocks = B.bytes_per_block(path)
    per_token = inspect_model(path)["bytes_per_token"]
    assert sum(blocks.values()) == per_token["total"]
    assert blocks["output_head"] >= per_token["output_head"]
    assert blocks["moe_ffn"] >= per_token["routed_experts"]
    assert (blocks["moe_ffn"] > 0) == (kind == "moe")
    assert (blocks["mla_attention"] > 0) == (arch == "deepseek2")
    # The MoE FFN's parts split its bytes: the router, gate and up, down (routed at k/n as above).
    all_parts = B.bytes_per_block(path, parts=True)
    assert set(all_parts) == {"moe_router", "moe_gate_up", "moe_down", "mla_project", "mla_absorb", "mla_cache",
                              "mla_decompress"}
    parts = {p: all_parts[p] for p in ("moe_router", "moe_gate_up", "moe_down")}
    assert sum(parts.values()) == blocks["moe_ffn"]
    assert all((v > 0) == (kind == "moe") for v in parts.values())
    if kind == "moe":
        # gate and up are each as large as down in these files (same type, transposed shapes)
        assert parts["moe_gate_up"] > parts["moe_down"] > parts["moe_router"]
    # The MLA attention's: the projections, wk_b, wv_b (the cache part reads no weights).
    mla = {p: all_parts[p] for p in ("mla_project", "mla_absorb", "mla_cache", "mla_decompress")}
    assert sum(mla.values()) == blocks["mla_attention"] and mla["mla_cache"] == 0
    f = GGUFFile(path)
    for part, suffix in (("mla_absorb", ".attn_k_b.weight"), ("mla_decompress", ".attn_v_b.weight")):
        assert mla[part] == sum(t.nbytes for n, t in f.tensors.items() if n.endswith(suffix))
    assert (mla["mla_project"] > mla["mla_absorb"] > 0) == (arch == "deepseek2")


def test_breakdown_arithmetic():
    # 4 steps of 10 ms; attention_in 8 ms of them in total over the 4 steps (2 ms/step) reading
    # 10 MB per token: 10e6 / 2e-3 = 5 GB/s = 50 % of 10 GB/s.
    profile = {"attention_in": (8_000_000, 96), "glu_ffn": (20_000_000, 96), "forward": (36_000_000, 4)}
    rows = {r["block"]: r for r in B.breakdown(profile, 4, 0.010, {"attention_in": 10_000_000, "glu_ffn": 30_000_000},
                                                10e9)}
    a = rows["attention_in"]
    assert a["ms_per_step"] == pytest.approx(2.0) and a["pct_of_step"] == pytest.approx(20.0)
    assert a["gb_per_s"] == pytest.approx(5.0) and a["pct_of_bandwidth"] == pytest.approx(50.0)
    assert rows["glu_ffn"]["pct_of_bandwidth"] == pytest.approx(100 * 30e6 / 5e-3 / 10e9)
    # forward 9 ms/step, of which 7 in the blocks; the step is 10 ms: 1 ms outside the forward
    assert rows["forward, outside the blocks"]["ms_per_step"] == pytest.approx(2.0)
    assert rows["step, outside the forward"]["ms_per_step"] == pytest.approx(1.0)
    assert rows["step"]["bytes_per_token"] == 40_000_000 and "moe_ffn" not in rows
    with pytest.raises(ValueError):
        B.breakdown(profile, 0, 0.01, {}, 1e9)


def test_median_profile_reads_per_step_medians_from_the_running_sums():
    # 3 steps: attention_in 2, 2 and 20 ms (a descheduled step), glu_ffn 5, 6, 7 ms; forward
    # 8, 9, 30 ms. Medians 2, 6 and 9 ms, as sums over the 3 steps: 6, 18, 27 ms.
    ms = 1_000_000
    snaps = [{},
             {"attention_in": (2 * ms, 4), "glu_ffn": (5 * ms, 4), "forward": (8 * ms, 1)},
             {"attention_in": (4 * ms, 8), "glu_ffn": (11 * ms, 8), "forward": (17 * ms, 2)},
             {"attention_in": (24 * ms, 12), "glu_ffn": (18 * ms, 12), "forward": (47 * ms, 3)}]
    p = B.median_profile(snaps)
    assert p == {"attention_in": (6 * ms, 12), "glu_ffn": (18 * ms, 12), "forward": (27 * ms, 3)}
    rows = {r["block"]: r for r in B.breakdown(p, 3, 0.010, {"attention_in": 10_000_000}, 10e9)}
    assert rows["attention_in"]["ms_per_step"] == pytest.approx(2.0)        # not the mean, 8
    assert rows["attention_in"]["pct_of_bandwidth"] == pytest.approx(50.0)  # 10 MB in 2 ms of 10 GB/s
    assert rows["forward, outside the blocks"]["ms_per_step"] == pytest.approx(1.0)  # 9 - 2 - 6
    # a name first seen after the first step counts from zero; one step is its own median
    assert B.median_profile([{"norm": (1, 1)}, {"norm": (5, 3), "embed": (7, 1)}]) == {"norm": (4, 2), "embed": (7, 1)}
    with pytest.raises(ValueError):
        B.median_profile([{}])


def test_breakdown_lists_the_moe_parts_under_their_block_and_leaves_them_out_of_the_sums():
    # 2 steps of 10 ms; moe_ffn 6 ms/step, of which router 1, gate/up 3, down 1.5 (0.5 outside them)
    profile = {"moe_ffn": (12_000_000, 2), "moe_router": (2_000_000, 2), "moe_gate_up": (6_000_000, 2),
               "moe_down": (3_000_000, 2), "forward": (16_000_000, 2)}
    rows = B.breakdown(profile, 2, 0.010, {"moe_ffn": 60_000_000}, 10e9,
                       {"moe_router": 1_000_000, "moe_gate_up": 36_000_000, "moe_down": 23_000_000})
    names = [r["block"] for r in rows]
    assert names[:4] == ["moe_ffn", "moe_ffn > router", "moe_ffn > gate_up", "moe_ffn > down"]
    by = {r["block"]: r for r in rows}
    assert by["moe_ffn > gate_up"]["ms_per_step"] == pytest.approx(3.0)
    assert by["moe_ffn > gate_up"]["gb_per_s"] == pytest.approx(12.0)  # 36 MB in 3 ms
    assert by["moe_ffn > down"]["pct_of_bandwidth"] == pytest.approx(100 * 23e6 / 1.5e-3 / 10e9)
    # the parts are not blocks: 8 ms/step forward less the 6 ms of moe_ffn, not less 11.5
    assert by["forward, outside the blocks"]["ms_per_step"] == pytest.approx(2.0)
    assert by["step"]["bytes_per_token"] == 60_000_000
    # no parts timed (prefill only, or a dense model): no part rows
    assert not any(" > " in r["block"] for r in B.breakdown({"moe_ffn": (1, 1), "forward": (2, 1)}, 1, 0.01,
                                                             {"moe_ffn": 1}, 1e9))


def test_pool_rows_arithmetic():
    # 4 steps of 10 ms, 2 threads: 400 regions (100 a step), 8 ms of join wait in all (2 ms/step).
    stats = {"runs": 400, "barriers": 40, "run_ns": 30_000_000, "join_wait_ns": 8_000_000, "join_sleeps": 4,
             "barrier_wait_ns": 1_000_000, "busy_ns": [36_000_000, 20_000_000], "start_ns": [0, 2_000_000]}
    p = B.pool_rows(stats, 4, 0.010, 2, cpu_seconds=0.06)
    assert p["regions_per_step"] == 100 and p["barriers_per_step"] == 10
    assert p["region_ms_per_step"] == pytest.approx(7.5) and p["join_wait_ms_per_step"] == pytest.approx(2.0)
    assert p["barrier_wait_ms_per_step"] == pytest.approx(0.25) and p["join_sleeps_per_step"] == 1
    assert p["worker_busy_pct_of_step"] == pytest.approx([90.0, 50.0])
    assert p["worker_start_us_mean"] == pytest.approx([5.0])  # 2 ms over 400 regions
    assert p["cpu_ms_per_step"] == pytest.approx(15.0) and p["cpu_pct_of_threads_x_wall"] == pytest.approx(75.0)
    assert "cpu_ms_per_step" not in B.pool_rows(stats, 4, 0.010, 2)
    with pytest.raises(ValueError):
        B.pool_rows(stats, 0, 0.010, 2)


@pytest.mark.parametrize("kind, arch", [("dense", "llama"), ("moe", "deepseek2")])
def test_pool_stats_of_a_forward_change_no_bit(kind, arch, tmp_path):
    """Pool timing on: every region of a forward is counted on the model's pool, each worker
    was busy inside them, and the logits are bit-identical to a forward without it."""
    from ktd.server.engine import Engine

    path = _tiny(kind, arch, tmp_path)
    logits = []
    for on in (False, True):
        eng = Engine.open(path, n_ctx=32, n_seq_max=1, threads=2)
        eng.context.set_pool_stats(on)
        out = [eng.forward(np.arange(5) + 40, np.arange(5), np.zeros(5), np.ones(5, bool))]
        out.append(eng.forward(np.array([50]), np.array([5]), np.zeros(1), np.ones(1, bool)))
        logits.append(np.concatenate([o.ravel() for o in out]))
        s = eng.context.pool_stats()
        if not on:
            assert s["runs"] == 0
            continue
        assert s["runs"] > 0 and len(s["busy_ns"]) == 2 and min(s["busy_ns"]) > 0
        assert s["join_wait_ns"] <= s["run_ns"]
        eng.context.set_pool_stats(False)
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.parametrize("kind, arch", [("dense", "llama"), ("dense", "gemma3"), ("moe", "deepseek2")])
def test_native_profile_counts_every_block_and_changes_no_bit(kind, arch, tmp_path):
    """Profiling on: each block is called once per layer per forward as the layer code says, the
    parts fit inside the whole, and the logits are bit-identical to a forward without it."""
    from ktd.server.engine import Engine
    from ktd.model.gguf import GGUFFile

    path = _tiny(kind, arch, tmp_path)
    logits = []
    for on in (False, True):
        eng = Engine.open(path, n_ctx=32, n_seq_max=1, threads=2)
        eng.context.set_profiling(on)
        out = [eng.forward(np.arange(5) + 40, np.arange(5), np.zeros(5), np.ones(5, bool))]
        for i in range(3):
            out.append(eng.forward(np.array([50 + i]), np.array([5 + i]), np.zeros(1), np.ones(1, bool)))
        logits.append(np.concatenate([o.ravel() for o in out]))
        prof = eng.context.profile()
        if not on:
            assert all(v == (0, 0) for v in prof.values())
            continue
        assert prof["forward"][1] == 4 and prof["embed"][1] == 4 and prof["output_head"][1] == 4
        attn = "mla_attention" if arch == "deepseek2" else "attention_in"
        n_layer = int(GGUFFile(path).metadata[f"{arch}.block_count"])
        assert prof[attn][1] == 4 * n_layer
        ffn_calls = prof["glu_ffn"][1] + prof["moe_ffn"][1]
        assert ffn_calls == 4 * n_layer
        assert (prof["moe_ffn"][1] > 0) == (kind == "moe")
        parts = ("moe_router", "moe_gate_up", "moe_down")
        mla_parts = ("mla_project", "mla_absorb", "mla_cache", "mla_decompress")
        assert (sum(ns for b, (ns, _) in prof.items() if b != "forward" and b not in parts + mla_parts)
                <= prof["forward"][0])
        # The MLA parts are timed in every forward (prompt and decodes), once per layer, inside
        # mla_attention's time.
        assert all(prof[p][1] == (4 * n_layer if arch == "deepseek2" else 0) for p in mla_parts)
        assert sum(prof[p][0] for p in mla_parts) <= prof["mla_attention"][0]
        # The MoE parts are timed on the one-token path: once per MoE layer of each of the 3 decodes
        # (the 5-token prompt takes the general path), inside moe_ffn's time.
        n_moe = sum(1 for n in GGUFFile(path).tensors if n.endswith(".ffn_gate_exps.weight"))
        assert all(prof[p][1] == 3 * n_moe for p in parts)
        assert sum(prof[p][0] for p in parts) <= prof["moe_ffn"][0]
        assert all((prof[p][0] > 0) == (kind == "moe") for p in parts)
        eng.context.reset_profile()
        assert all(v == (0, 0) for v in eng.context.profile().values())
    np.testing.assert_array_equal(logits[0], logits[1])


def test_compare_pairs_rows_by_model_and_threads(tmp_path):
    def res(model, threads, pct, tps, ms):
        return {"model": model, "threads": threads, "pct_of_ceiling": pct, "tokens_per_s": tps,
                "loadavg_start": [1.0, 1.0, 1.0],
                "breakdown": [{"block": "glu_ffn", "ms_per_step": ms}, {"block": "step", "ms_per_step": 2 * ms}]}

    before = [res("a.gguf", 2, 50.0, 20.0, 30.0), res("b.gguf", 2, 60.0, 10.0, 5.0)]
    after = [res("a.gguf", 2, 60.0, 24.0, 25.0), res("a.gguf", 1, 70.0, 12.0, 40.0)]
    (row,) = B.compare(before, after)
    assert row["model"] == "a.gguf" and row["pct_of_ceiling"] == (50.0, 60.0) and row["tokens_per_s"] == (20.0, 24.0)
    glu = {x["block"]: x for x in row["blocks"]}["glu_ffn"]
    assert glu["ms_before"] == 30.0 and glu["ms_after"] == 25.0 and glu["ms_change"] == pytest.approx(-5.0)
    text = B.format_compare([row])
    assert "20.00 -> 24.00 tok/s" in text and "(-5.000)" in text
    assert B.compare(before, [res("c.gguf", 2, 1.0, 1.0, 1.0)]) == []
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert B.main(["no-such-model.gguf", "--compare", str(bad), "--out", str(tmp_path / "x.json")]) == 1


@pytest.mark.parametrize("weights_map", ["arena", "gguf"])
def test_weights_map_option_reaches_the_engine(weights_map, tmp_path, capsys):
    """--weights-map: the load the decode runs on uses that map (the engine's own memory report)."""
    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    out = tmp_path / "decode.json"
    assert B.main([str(path), "--threads", "1", "--tokens", "2", "--weights-map", weights_map,
                   "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["weights_map"] == weights_map and row["tokens"] == 2
    printed = capsys.readouterr().out
    assert f"weights_map {weights_map}, context 16: decode" in printed
    # The arenas' share on huge pages (smaps), none without arenas.
    if weights_map == "gguf":
        assert row["arena_huge_share"] is None and "weights not in arenas" in printed
    else:
        assert 0.0 <= row["arena_huge_share"] <= 1.0 and "% on huge pages" in printed


def test_huge_words():
    assert B.huge_words(None) == "weights not in arenas"
    assert B.huge_words(1.0) == "weights arenas 100% on huge pages"
    assert B.huge_words(0.25) == "weights arenas 25% on huge pages (the rest on 4 KiB pages: slower)"


def test_context_option_sets_the_prompt_length(tmp_path, capsys):
    """--context N: the timed steps run after an N-token prompt (the row records it, and the engine
    was opened with room for it: N + tokens + 1 positions, more than the default run's)."""
    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    out = tmp_path / "decode.json"
    assert B.main([str(path), "--threads", "1", "--tokens", "2", "--context", "70", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["context"] == 70 and row["tokens"] == 2
    assert "context 70: decode" in capsys.readouterr().out
    assert B.main([str(path), "--context", "0", "--out", str(out)]) == 1


def test_compare_pairs_rows_of_the_same_context():
    def res(context, pct):
        r = {"model": "a.gguf", "threads": 2, "pct_of_ceiling": pct, "tokens_per_s": 1.0, "loadavg_start": None,
             "breakdown": []}
        if context is not None:
            r["context"] = context
        return r

    # A file from before --context has no context: it was measured after the 16-token prompt.
    (row,) = B.compare([res(None, 50.0), res(2048, 40.0)], [res(16, 55.0)])
    assert row["context"] == 16 and row["pct_of_ceiling"] == (50.0, 55.0)
    (row,) = B.compare([res(None, 50.0), res(2048, 40.0)], [res(2048, 45.0)])
    assert row["pct_of_ceiling"] == (40.0, 45.0)
    assert B.compare([res(16, 50.0)], [res(512, 45.0)]) == []
    assert "context 2048" in B.format_compare([row])


def test_weights_map_pair_bench_on_a_tiny_model(tmp_path, capsys):
    """python -m ktd.bench.weights_map: both maps really loaded (each model's own memory report),
    every step timed, the ratio the two medians'."""
    from ktd.bench import weights_map as W
    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    out = tmp_path / "wm.json"
    assert W.main([str(path), "--steps", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["weights_map"] == {"arena": "arena", "gguf": "gguf"} and row["steps"] == 3
    c = row["cpu_ms_per_step"]
    assert c["arena"] > 0 and c["gguf"] > 0
    assert row["gguf_over_arena"] == pytest.approx(c["gguf"] / c["arena"], rel=1e-2)
    assert "gguf/arena" in capsys.readouterr().out
    assert W.main(["no-such-model.gguf", "--out", str(out)]) == 1


# --- --ab-prefetch: the decode prefetch modes, step by step -------------------------------------

def test_prefetch_ab_summarizes_each_mode_apart():
    steps = [0.10, 0.12, 0.08, 0.11, 0.15, 0.07, 0.09, 0.13, 0.06]
    bws = [10e9, 11e9, 12e9, 13e9, 14e9, 15e9, 16e9, 17e9, 18e9]
    settings = [0, 1, 2] * 3
    bpt = 1_000_000_000
    ab = B.prefetch_ab(steps, bws, settings, bpt)
    off = B.summarize([0.10, 0.11, 0.09], [10e9, 13e9, 16e9], bpt)
    l1 = B.summarize([0.12, 0.15, 0.13], [11e9, 14e9, 17e9], bpt)
    l2 = B.summarize([0.08, 0.07, 0.06], [12e9, 15e9, 18e9], bpt)
    assert ab["off"] == off and ab["l1"] == l1 and ab["l2"] == l2
    assert ab["l1_over_off"] == pytest.approx(0.13 / 0.10)
    assert ab["l2_over_off"] == pytest.approx(0.07 / 0.10)
    with pytest.raises(ValueError):  # a mode without steps
        B.prefetch_ab([0.1, 0.2], [1e9, 1e9], [0, 1], bpt)


def test_ab_prefetch_alternates_the_setting_and_restores_the_default(tmp_path, capsys, monkeypatch):
    """Every step runs under the mode it is filed under (the native switch is called before
    each: off, l1, l2 in turn), the CPU's default is back afterwards, and the row's own figures
    are the default mode's steps."""
    from ktd import _native

    real = _native.kernels.set_decode_prefetch
    calls = []

    def record(on):
        calls.append(on)
        real(on)

    monkeypatch.setattr(_native.kernels, "set_decode_prefetch", record)
    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    out = tmp_path / "decode.json"
    assert B.main([str(path), "--threads", "1", "--tokens", "7", "--ab-prefetch", "--out", str(out)]) == 0
    assert calls == [0, 1, 2, 0, 1, 2, 0, -1]
    assert _native.kernels.decode_prefetch() == _native.kernels.decode_prefetch_default()
    (row,) = json.loads(out.read_text())
    ab = row["decode_prefetch_ab"]
    assert ab["off"]["tokens"] == 3 and ab["l1"]["tokens"] == 2 and ab["l2"]["tokens"] == 2
    # Every step is followed by a pass of every read loop, so every mode sees all of them, once
    # per step.
    loops = {str(int(pf)) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH}
    assert set(ab["off"]["read_loop_medians"]) == set(ab["l1"]["read_loop_medians"]) == \
        set(ab["l2"]["read_loop_medians"]) == loops
    assert ab["off"]["read_loop_passes"] == 3 and ab["l1"]["read_loop_passes"] == 2
    default = B.PREFETCH_MODES[_native.kernels.decode_prefetch_default()]
    assert row["tokens"] == ab[default]["tokens"] and row["median_step_s"] == ab[default]["median_step_s"]
    assert ab["l1_over_off"] == pytest.approx(ab["l1"]["median_step_s"] / ab["off"]["median_step_s"])
    assert "decode prefetch, the modes in turn step by step: off" in capsys.readouterr().out


def test_ab_prefetch_restores_the_default_when_a_step_fails(tmp_path, monkeypatch):
    from ktd import _native
    from ktd.server.engine import Engine

    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    real_forward = Engine.forward
    n = {"calls": 0}
    # The first step forced to a mode that is not the default: step 0 is off, step 1 l1.
    fail_at = 2 + (0 if _native.kernels.decode_prefetch_default() else 1)  # the prompt is call 1

    def failing(self, *a, **kw):
        n["calls"] += 1
        if n["calls"] == fail_at:
            assert _native.kernels.decode_prefetch() != _native.kernels.decode_prefetch_default()
            raise RuntimeError("boom")
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(Engine, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        B.measure(str(path), 1, 4, ab_prefetch=True)
    assert _native.kernels.decode_prefetch() == _native.kernels.decode_prefetch_default()


def test_ab_prefetch_rejects_a_breakdown_and_a_single_token(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert B.main(["no-such-model.gguf", "--ab-prefetch", "--breakdown", "--out", out]) == 1
    assert B.main(["no-such-model.gguf", "--ab-prefetch", "--tokens", "2", "--out", out]) == 1
    assert "--ab-prefetch needs" in capsys.readouterr().err
    with pytest.raises(ValueError):
        B.measure("unused.gguf", 1, 2, ab_prefetch=True)


def test_compare_says_when_the_ceilings_were_taken_differently():
    """Files of the three kinds (each pass the best of every loop; the loops taking turns; every
    loop after every step) are told apart, and a before/after of two kinds says so."""
    def res(**extra):
        return {"model": "a.gguf", "threads": 2, "pct_of_ceiling": 80.0, "tokens_per_s": 1.0,
                "loadavg_start": None, "breakdown": [], **extra}

    best_of, rotating, every = res(), res(read_loop_prefetch=4096), res(read_loop_prefetch=0,
                                                                       ceiling_method=B.CEILING_METHOD)
    assert [B.ceiling_method(r) for r in (best_of, rotating, every)] == ["best-of-loops", "rotating-loops",
                                                                          B.CEILING_METHOD]
    (row,) = B.compare([rotating], [every])
    assert row["ceiling_method"] == ("rotating-loops", B.CEILING_METHOD)
    assert "ceilings were taken differently: rotating-loops before" in B.format_compare([row])
    (row,) = B.compare([every], [every])
    assert "differently" not in B.format_compare([row])
