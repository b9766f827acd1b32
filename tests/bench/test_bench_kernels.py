"""``python -m ktd.bench.kernels``: the type names it accepts (any case, as llama.cpp's tools and
gguf-py spell them), its errors, and its JSON rows in the printed table's units — on tiny shapes
(the real ones stream GiBs), checked against the shape's byte count from gguf-py's block sizes."""

from __future__ import annotations

import json

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ktd import _native
from ktd.bench import kernels as bk

K = _native.kernels
ISA = K.active_isa()


def test_type_names_in_any_case():
    assert "Q4_K" in K.supported_types(ISA)
    assert bk.resolve_types(["q4_k"], ISA) == ["Q4_K"]
    assert bk.resolve_types(["Q4_K", "q6_K", "q4_k", "q8_0"], ISA) == ["Q4_K", "Q6_K", "Q8_0"]


def test_unknown_and_unsupported_types_are_named():
    with pytest.raises(ValueError, match=r"not a GGML type: q9_x") as e:
        bk.resolve_types(["q4_k", "q9_x"], ISA)
    assert "Q4_K" in str(e.value)  # lists what is supported
    missing = [t.name for t in GGMLQuantizationType if t.name not in K.supported_types(ISA)]
    assert missing  # e.g. Q8_K (an activation format) has no matmul kernels
    with pytest.raises(ValueError, match=f"no {ISA} kernels for: {missing[0]}"):
        bk.resolve_types([missing[0].lower()], ISA)


def test_main_rejects_a_bad_type_before_timing(capsys, tmp_path):
    assert bk.main(["--types", "nope", "--out", str(tmp_path / "k.json")]) == 1
    assert "not a GGML type: nope" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()


def test_json_rows_in_table_units(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bk, "l3_bytes", lambda: 1 << 16)
    monkeypatch.setattr(bk, "GEMV_SHAPES", [("tiny", 64, 512)])
    monkeypatch.setattr(bk, "GEMM_SHAPE", ("tiny gemm", 32, 512))
    monkeypatch.setattr(bk, "GEMM_N", [4])
    monkeypatch.setattr(bk, "BASE_ROWS", 16)
    out = tmp_path / "k.json"
    rc = bk.main(["--types", "q4_k", "--threads", "1", "--bw-bytes", str(1 << 20), "--reps", "2",
                  "--no-llama-cpp", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {r["type"] for r in rows} == {"Q4_K"} and {r["n"] for r in rows} == {1, 4}
    blck, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    for r in rows:
        assert "seconds" not in r and r["ms"] > 0
        nbytes = r["rows"] * r["k"] // blck * size
        assert r["gbps"] == pytest.approx(nbytes / (r["ms"] / 1e3) / 1e9, rel=1e-9)
        assert r["pct_of_bandwidth"] == pytest.approx(100 * r["gbps"] / r["read_bandwidth_gbps"], rel=1e-9)
        if r["n"] > 1:
            assert r["gflops"] == pytest.approx(2 * r["rows"] * r["k"] * r["n"] / (r["ms"] / 1e3) / 1e9, rel=1e-9)
        # The printed row shows the same figure in the same unit.
        assert f"{r['ms']:9.3f} {r['gbps']:7.2f}" in printed
        if r["n"] == 1:   # the cache-resident figure: 256 KiB // 288 B per row = 910 -> 896 leading rows
            assert r["rows"] == 960 and r["hot_rows"] == 896 and r["hot_gbps"] > 0
            assert r["hot_over_bandwidth"] == pytest.approx(r["hot_gbps"] / r["read_bandwidth_gbps"], rel=1e-9)
            assert f"{r['hot_gbps']:8.2f} {r['hot_over_bandwidth']:6.2f} {r['pct_of_bandwidth_per_pass']:6.1f}" in printed
            assert r["pct_of_bandwidth_per_pass"] > 0 and r["read_loop_prefetch"] in K.READ_BANDWIDTH_PREFETCH
        else:
            assert "hot_gbps" not in r and "pct_of_bandwidth_per_pass" not in r


def test_per_pass_figure_is_the_median_of_the_pairs():
    # 100 B in 1 s against 100 B/s: 100%; against 200 B/s: 50%; in 2 s against 100 B/s: 50%.
    assert bk.per_pass_pct(100, [(1.0, 100.0), (1.0, 200.0), (2.0, 100.0)]) == pytest.approx(50.0)
    # The pairs are kept together: best against best would say 100%, and the mean 66.7%.
    assert bk.per_pass_pct(100, [(1.0, 200.0), (2.0, 100.0), (1.0, 100.0), (4.0, 100.0)]) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="at least one"):
        bk.per_pass_pct(100, [])


def test_the_per_pass_loop_is_the_fastest_read_loop(monkeypatch):
    seen = []

    class FakeKernels:
        READ_BANDWIDTH_PREFETCH = (0, 2048, 4096, 8192)

        @staticmethod
        def bench_read_bandwidth(nbytes, threads, reps, prefetch):
            seen.append((nbytes, threads, reps, prefetch))
            return {0: 10.0, 2048: 12.0, 4096: 13.0, 8192: 11.0}[prefetch]

    monkeypatch.setattr(bk, "K", FakeKernels)
    assert bk.best_read_loop(1 << 28, 2) == 4096
    assert seen == [(1 << 28, 2, 2, pf) for pf in (0, 2048, 4096, 8192)]


def test_hot_rows_hold_about_256_kib_per_thread_in_whole_row_groups():
    # Q4_K, k = 1536: 864 B per row; 2 threads: 524288 // 864 = 606 -> 592 (37 groups of 16)
    assert bk.hot_rows("Q4_K", 8960, 1536, 2) == 592
    assert bk.hot_rows("Q4_K", 8960, 1536, 1) == 288        # 303 -> 288
    assert bk.hot_rows("Q4_K", 100, 1536, 2) == 100         # never more than the matrix
    assert bk.hot_rows("Q8_0", 1000, 1 << 20, 1) == 16      # rows wider than the budget: one group


def test_run_times_each_case_against_one_kept_buffer_per_thread_count(monkeypatch, read_buffer_spy):
    """The whole GEMV/GEMM loop at toy sizes (no timing asserted): every case gets its rows, and the
    per-case read passes go to one ReadBuffer per thread count (fresh buffers at every pass slowed
    what ran after them), of the case buffer's size, over every loop and the chosen one."""
    from ktd import _native

    monkeypatch.setattr(bk, "l3_bytes", lambda: 1 << 20)
    monkeypatch.setattr(bk, "GEMV_SHAPES", [("toy", 64, 256)])
    monkeypatch.setattr(bk, "GEMM_SHAPE", ("toy", 64, 256))
    monkeypatch.setattr(bk, "GEMM_N", [2])
    made, reads = read_buffer_spy
    rows = bk.run([1, 2], 8 << 20, 1, ["Q8_0"], rounds=1)
    case_bytes = max(256 << 20, bk.CACHE_FACTOR << 20)  # min(bw_bytes, ...) with bw_bytes < that
    assert made == [(min(8 << 20, case_bytes), 1), (min(8 << 20, case_bytes), 2)]
    gemv = [r for r in rows if r["n"] == 1]
    assert {(r["threads"], r["layout"]) for r in gemv} == {(t, lay) for t in (1, 2) for lay in bk.layouts("Q8_0")}
    assert all(r["read_bandwidth_gbps"] > 0 and r["pct_of_bandwidth_per_pass"] > 0 for r in gemv)
    loops = {t: {r["read_loop_prefetch"] for r in gemv if r["threads"] == t} for t in (1, 2)}
    per_case = 2 * len(_native.kernels.READ_BANDWIDTH_PREFETCH) + bk.PASS_PAIRS
    for t in (1, 2):
        assert len(loops[t]) == 1
        mine = [pf for th, pf in reads if th == t]
        assert len(mine) == per_case * len(bk.layouts("Q8_0"))
        assert mine.count(next(iter(loops[t]))) >= bk.PASS_PAIRS
    assert any(r["n"] == 2 and r["gflops"] > 0 for r in rows)
