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
            assert f"{r['hot_gbps']:8.2f} {r['hot_over_bandwidth']:6.2f}" in printed
        else:
            assert "hot_gbps" not in r


def test_hot_rows_hold_about_256_kib_per_thread_in_whole_row_groups():
    # Q4_K, k = 1536: 864 B per row; 2 threads: 524288 // 864 = 606 -> 592 (37 groups of 16)
    assert bk.hot_rows("Q4_K", 8960, 1536, 2) == 592
    assert bk.hot_rows("Q4_K", 8960, 1536, 1) == 288        # 303 -> 288
    assert bk.hot_rows("Q4_K", 100, 1536, 2) == 100         # never more than the matrix
    assert bk.hot_rows("Q8_0", 1000, 1 << 20, 1) == 16      # rows wider than the budget: one group
