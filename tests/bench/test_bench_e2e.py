"""The end-to-end benchmark's pure parts (ceiling, ratios, medians, report schema) against
hand-computed numbers, and its two measurement loops against independent greedy decoders: the
ktd loop on the tests' fake engine, the llama.cpp loop against llama-cpp-python's Llama.eval."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from ktd.bench import e2e
from fake_engine import FakeEngine, reference_greedy


def test_ceiling_tokens_per_s():
    # 20 GB/s over 392 MB per token: 20e9 / 392e6 = 51.0204... tokens/s
    assert e2e.ceiling_tokens_per_s(20e9, 392_000_000) == pytest.approx(51.020408163)
    # 25.5 tokens/s is 25.5 * 392e6 / 20e9 = 49.98 % of it
    assert e2e.pct_of(25.5, e2e.ceiling_tokens_per_s(20e9, 392_000_000)) == pytest.approx(49.98)
    assert e2e.pct_of(None, 50.0) is None and e2e.pct_of(10.0, None) is None
    with pytest.raises(ValueError, match="positive"):
        e2e.ceiling_tokens_per_s(0.0, 392_000_000)
    with pytest.raises(ValueError, match="positive"):
        e2e.ceiling_tokens_per_s(20e9, 0)


def _s(engine, test, rep, tps, model="m", threads=1):
    return {"model": model, "engine": engine, "threads": threads, "test": test, "rep": rep, "tokens_per_s": tps}


# ktd/llama.cpp per repetition: 10/10 = 1, 30/10 = 3, 20/40 = 0.5 -> median ratio 1.0, while the
# ratio of the medians would be 20/10 = 2.0 (the report quotes the median of the paired ratios).
PP = [_s("ktd", "pp128", 0, 10.0), _s("llama.cpp", "pp128", 0, 10.0),
      _s("llama.cpp", "pp128", 1, 10.0), _s("ktd", "pp128", 1, 30.0),
      _s("ktd", "pp128", 2, 20.0), _s("llama.cpp", "pp128", 2, 40.0),
      _s("ktd", "pp128", 3, 99.0)]           # no llama.cpp partner: in the row median, not in a ratio
TG = [_s("ktd", "tg128", 0, 20.0), _s("llama.cpp", "tg128", 0, 25.0),
      _s("ktd", "tg128", 1, 22.0), _s("llama.cpp", "tg128", 1, 22.0)]


def _report(samples, engines=e2e.DEFAULT_ENGINES, unavailable=None, greedy=None):
    return e2e.summarise(model_names=["m"], engines=engines, threads=[1], tests=["pp128", "tg128"],
                         samples=samples, unavailable=unavailable or {}, read_bandwidth={1: 20e9},
                         bytes_per_token={"m": 400_000_000}, greedy=greedy)


def test_paired_ratios_and_medians():
    assert e2e.paired_ratios(PP, "m", 1, "pp128") == [1.0, 3.0, 0.5]
    rep = _report(PP + TG, greedy={("m", "ktd", 1): [5, 6, 7, 8], ("m", "llama.cpp", 1): [5, 6, 9, 8]})
    rows = {(r["engine"], r["test"]): r for r in rep["rows"]}
    assert rows[("ktd", "pp128")]["tokens_per_s"] == 25.0          # median of 10, 30, 20, 99
    assert rows[("llama.cpp", "pp128")]["tokens_per_s"] == 10.0    # median of 10, 10, 40
    assert rows[("ktd", "tg128")]["tokens_per_s"] == 21.0
    assert rows[("llama.cpp", "tg128")]["tokens_per_s"] == 23.5
    ratios = {r["test"]: r for r in rep["ratios"]}
    assert ratios["pp128"]["ktd_over_llama_cpp"] == 1.0
    assert ratios["tg128"]["per_rep"] == [0.8, 1.0]
    assert ratios["tg128"]["ktd_over_llama_cpp"] == pytest.approx(0.9)
    assert ratios["tg128"]["greedy_tokens_agreeing"] == 2
    # ceiling 20e9 / 400e6 = 50 tokens/s; 21 -> 42 %, 23.5 -> 47 %
    (c,) = rep["ceiling"]
    assert c["ceiling_tokens_per_s"] == 50.0
    assert c["decode_pct_of_ceiling"]["ktd"] == pytest.approx(42.0)
    assert c["decode_pct_of_ceiling"]["llama.cpp"] == pytest.approx(47.0)
    assert rep["read_bandwidth"] == [{"threads": 1, "bytes_per_s": 20e9}]
    assert rep["models"] == [{"name": "m", "bytes_per_token": 400_000_000, "cache_assisted": None}]
    e2e.validate_report(rep)


def _tg_report_with_passes(passes):
    """The tg128 report of TG at 20 GB/s before the run, with read passes (rep, bytes/s) during decode."""
    bws = [{"model": "m", "threads": 1, "rep": r, "bytes_per_s": b} for r, b in passes]
    return e2e.summarise(model_names=["m"], engines=e2e.DEFAULT_ENGINES, threads=[1], tests=["tg128"], samples=TG,
                         unavailable={}, read_bandwidth={1: 20e9}, bytes_per_token={"m": 400_000_000},
                         bw_samples=bws)


def test_ceiling_during_decode_is_the_median_of_the_interleaved_passes():
    # tg medians: ktd 21.0, llama.cpp 23.5 (TG above); passes around the tg pairs 16, 20, 18 GB/s:
    # median 18e9 / 400e6 = 45 tokens/s -> ktd 21 / 45 = 46.67 %, llama.cpp 23.5 / 45 = 52.22 %;
    # at the 20 GB/s peak the ceiling is 50 tokens/s -> 42 % and 47 %.
    rep = _tg_report_with_passes([(0, 16e9), (0, 20e9), (1, 18e9)])
    (c,) = rep["ceiling"]
    assert c["decode_pct_of_ceiling"] == pytest.approx({"ktd": 42.0, "llama.cpp": 47.0})
    d = c["during_decode"]
    assert d["read_bandwidth_bytes_per_s"] == 18e9 and d["samples"] == [16e9, 20e9, 18e9]
    assert d["ceiling_tokens_per_s"] == pytest.approx(45.0)
    assert d["decode_pct_of_ceiling"] == pytest.approx({"ktd": 46.6667, "llama.cpp": 52.2222}, rel=1e-4)
    table = e2e.format_table(rep)
    assert "read bandwidth during m 1t decode: median 18.00 GB/s of 3 passes (16.00-20.00" in table
    line = next(x for x in table.splitlines() if x.startswith("m ") and "tg128" in x)
    assert line.split()[-2:] == ["46.7", "52.2"]
    assert c["peak_from"] == "before the run" and c["peak_read_bandwidth_bytes_per_s"] == 20e9  # a tie
    assert "peak for m" not in table
    # No passes (an old report, or no engine left to measure): no during-decode figures, "-" printed.
    rep = _report(PP + TG)
    assert rep["ceiling"][0]["during_decode"] is None
    line = next(x for x in e2e.format_table(rep).splitlines() if x.startswith("m ") and "tg128" in x)
    assert line.split()[-2:] == ["-", "-"]


def test_the_peak_is_a_pass_during_decode_when_one_beat_the_passes_before_the_run():
    # Before the run 20 GB/s; during decode 16, 25, 18: the ceiling is 25e9 / 400e6 = 62.5 tokens/s,
    # ktd 21 -> 33.6 %, llama.cpp 23.5 -> 37.6 % (at 20 GB/s they would read 42 % and 47 %, and a
    # decode at the 25 GB/s moment could read over 100 %). The %@tg figures keep the median, 18.
    rep = _tg_report_with_passes([(0, 16e9), (0, 25e9), (1, 18e9)])
    (c,) = rep["ceiling"]
    assert c["peak_from"] == "during decode" and c["peak_read_bandwidth_bytes_per_s"] == 25e9
    assert c["ceiling_tokens_per_s"] == pytest.approx(62.5)
    assert c["decode_pct_of_ceiling"] == pytest.approx({"ktd": 33.6, "llama.cpp": 37.6})
    assert c["during_decode"]["read_bandwidth_bytes_per_s"] == 18e9
    assert rep["read_bandwidth"] == [{"threads": 1, "bytes_per_s": 20e9}]  # the pass before the run, as measured
    table = e2e.format_table(rep)
    assert "peak for m 1t: 25.00 GB/s, a pass during its decode" in table
    line = next(x for x in table.splitlines() if x.startswith("m ") and "tg128" in x)
    assert line.split()[-5:-2] == ["62.5", "33.6", "37.6"]
    e2e.validate_report(rep)


def test_unavailable_engine_gets_no_number_and_its_reason():
    llama_only = [s for s in PP + TG if s["engine"] == "llama.cpp"]
    rep = _report(llama_only, unavailable={("m", "ktd"): "ktd.server.engine missing"})
    e2e.validate_report(rep)
    for r in rep["rows"]:
        if r["engine"] == "ktd":
            assert r["tokens_per_s"] is None and r["samples"] == [] and r["unavailable"] == "ktd.server.engine missing"
        else:
            assert r["tokens_per_s"] > 0 and "unavailable" not in r
    assert all(r["ktd_over_llama_cpp"] is None and r["per_rep"] == [] for r in rep["ratios"])
    assert rep["ratios"][1]["greedy_tokens_agreeing"] is None
    (c,) = rep["ceiling"]
    assert c["decode_pct_of_ceiling"] == {"ktd": None, "llama.cpp": pytest.approx(47.0)}
    table = e2e.format_table(rep)
    assert "m ktd: not available: ktd.server.engine missing" in table
    assert "read bandwidth, 1 thread(s): 20.00 GB/s" in table and "400.0 MB read per token" in table
    assert "busy" not in table
    rep["config"] = {"cpu_count": 2, "loadavg_start": [6.0, 5.0, 4.0]}
    assert "busy before the run (1-min load average 6.0 on 2 CPUs)" in e2e.format_table(rep)


def test_cache_assisted_rows_are_flagged():
    # 400 MB per token: under 4 x 128 MiB (536.9 MB) -> assisted; over 4 x 32 MiB (134.2 MB) -> not
    assert e2e.cache_assisted(400_000_000, 128 << 20) is True
    assert e2e.cache_assisted(400_000_000, 32 << 20) is False
    assert e2e.cache_assisted(None, 32 << 20) is None and e2e.cache_assisted(400_000_000, None) is None
    rep = e2e.summarise(model_names=["m"], engines=e2e.DEFAULT_ENGINES, threads=[1], tests=["pp128", "tg128"],
                        samples=PP + TG, unavailable={}, read_bandwidth={1: 20e9},
                        bytes_per_token={"m": 400_000_000}, llc_bytes=128 << 20)
    assert rep["models"][0]["cache_assisted"] is True
    rep["config"] = {"cpu_model_name": "Test CPU", "cpu_family": 25, "cpu_model": 1, "isa": "avx2",
                     "last_level_cache": {"level": 3, "bytes": 128 << 20}, "cpuid_l3_bytes": 256 << 20}
    table = e2e.format_table(rep)
    assert any(line.startswith("m*") for line in table.splitlines())
    assert "cache-assisted" in table
    assert "machine: Test CPU (family 25 model 1), kernels avx2, L3 128 MiB per instance (sysfs), CPUID L3 256 MiB" in table


def test_overhead_share():
    # steps of 1/20, 1/25, 1/10 s -> median 0.05 s; overhead median 0.5 ms -> 1 % of a step
    got = e2e.overhead_share([0.0004, 0.0005, 0.0009], [20.0, 25.0, 10.0])
    assert got["seconds_per_token"] == pytest.approx(0.0005)
    assert got["pct_of_step"] == pytest.approx(1.0)
    assert e2e.overhead_share([], [20.0]) == {"seconds_per_token": None, "pct_of_step": None}


def test_leading_agreement():
    assert e2e.leading_agreement([1, 2, 3], [1, 2, 3]) == 3
    assert e2e.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert e2e.leading_agreement([7], [8]) == 0
    assert e2e.leading_agreement(None, [1]) is None


def test_json_round_trip_and_schema(tmp_path):
    out = tmp_path / "results" / "bench.json"
    e2e.write_json(_report(PP + TG), out)
    loaded = json.loads(out.read_text())
    e2e.validate_report(loaded)
    assert loaded["schema"] == e2e.SCHEMA
    for r in loaded["rows"]:
        assert {"model", "engine", "threads", "test", "tokens_per_s"} <= r.keys()
    assert not list(tmp_path.glob("results/*.tmp"))


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(schema="other/1"), "schema"),
    (lambda r: r["rows"][0].update(engine="vllm"), "engine"),
    (lambda r: r["rows"][0].update(test="tg64"), "test"),
    (lambda r: r["rows"][0].update(threads="2"), "threads"),
    (lambda r: r["rows"][0].update(tokens_per_s=-1.0), "positive"),
    (lambda r: r["rows"][0].update(tokens_per_s=None), "no tokens_per_s and no reason"),
    (lambda r: r["models"][0].update(bytes_per_token=0), "bytes_per_token"),
    (lambda r: r["read_bandwidth"][0].update(bytes_per_s=-5.0), "bytes_per_s"),
    (lambda r: r.pop("ceiling"), "ceiling"),
])
def test_validate_rejects(mutate, message):
    rep = _report(PP + TG)
    mutate(rep)
    with pytest.raises(ValueError, match=message):
        e2e.validate_report(rep)


def test_model_selection_and_arguments():
    assert [m.name for m in e2e.select_models(None, quick=True)] == [e2e.MODELS[0].name]
    assert [m.name for m in e2e.select_models(None, quick=False)] == [m.name for m in e2e.MODELS]
    assert [m.name for m in e2e.select_models(["qwen2.5-coder-1.5b"], quick=True)] == ["qwen2.5-coder-1.5b"]
    with pytest.raises(ValueError, match="unknown model"):
        e2e.select_models(["nope"], quick=False)
    for argv in (["--bw-bytes", str(64 << 20)], ["--reps", "0"], ["--threads", "0"], ["--models", "nope"]):
        with pytest.raises(SystemExit) as exc:
            e2e.main(argv)
        assert exc.value.code == 2


def test_ktd_loop_on_the_fake_engine():
    """The ktd measurement loop drives forward as the Engine protocol says: the fake engine raises
    on any out-of-order position or a KV slot not freed, and its greedy tokens are known."""
    engine = FakeEngine(n_ctx=256, n_seq_max=1)
    runner = e2e.KtdRunner(engine)
    prompt = np.arange(65, 65 + e2e.TG_PROMPT_TOKENS, dtype=np.int32)
    tokens = np.arange(40, 40 + 100, dtype=np.int32)
    for _ in range(2):   # twice: the second prefill must start from a freed slot
        assert runner.prefill(tokens) > 0
        call = engine.calls[-1]
        np.testing.assert_array_equal(call.positions, np.arange(100))
        np.testing.assert_array_equal(call.want_logits, np.arange(100) == 99)
    sec, out = runner.decode(prompt, 20)
    assert sec > 0
    assert out == reference_greedy(prompt.tolist(), 21, stop_at_eos=False)
    assert [c.positions.tolist() for c in list(engine.calls)[-20:]] == [[p] for p in range(16, 36)]


def test_ktd_missing_is_reported_not_faked(monkeypatch):
    monkeypatch.setitem(sys.modules, "ktd.server.engine", None)   # import ktd.server.engine -> ImportError
    with pytest.raises(e2e.EngineUnavailable, match="^ktd.server.engine missing$"):
        e2e.KtdRunner.open(Path("x.gguf"), threads=1)


@pytest.mark.realmodel
def test_run_measures_a_ktd_engine_once_it_exists(monkeypatch, real_model, read_buffer_spy):
    """The whole run loop with a stand-in ``ktd.server.engine`` (the fake engine behind Engine.open):
    opened per thread count with the benchmark's options, every test measured every repetition,
    bytes per token from ktd.model.inspect, bandwidth per thread count; the report validates."""
    from ktd.model.inspect import inspect_model

    path = real_model("qwen2.5-coder-0.5b")   # its header only: bytes per token
    opened = []

    class Engine:
        @staticmethod
        def open(p, *, n_ctx, n_seq_max, threads):
            opened.append((p, n_ctx, n_seq_max, threads))
            return FakeEngine(n_ctx=n_ctx, n_seq_max=n_seq_max)

    module = types.ModuleType("ktd.server.engine")
    module.Engine = Engine
    monkeypatch.setitem(sys.modules, "ktd.server.engine", module)
    # token ids inside the fake engine's 260-entry vocabulary
    monkeypatch.setattr(e2e, "prompt_tokens", lambda p, n: (np.arange(n) % 200 + 32).astype(np.int32))
    from ktd import _native

    passes = []
    real_bw = _native.kernels.bench_read_bandwidth

    def bw_spy(nbytes, threads, reps, prefetch=-1):
        passes.append((threads, reps, prefetch))
        return real_bw(nbytes, threads, reps, prefetch)

    monkeypatch.setattr(_native.kernels, "bench_read_bandwidth", bw_spy)
    buffers, reads = read_buffer_spy
    rep = e2e.run([e2e.BenchModel("q", lambda: path)], ["ktd"], [1, 2], e2e.TESTS, reps=2,
                  bw_bytes=64 << 20, bw_reps=1)
    e2e.validate_report(rep)
    # The peak before the run keeps the best of every loop (fresh buffers); each pass during decode
    # is one pass of the loop that was fastest before it (the loop choice: two passes of each loop).
    loops = rep["config"]["read_bandwidth_loop"]
    assert set(loops) == {"1", "2"} and all(pf in _native.kernels.READ_BANDWIDTH_PREFETCH for pf in loops.values())
    assert [p for p in passes if p[1] == 1] == [(1, 1, -1), (2, 1, -1)]
    # The passes during decode read one buffer per thread count, kept for the run.
    assert buffers == [(64 << 20, 1), (64 << 20, 2)]
    assert reads == [(1, loops["1"])] * 4 * e2e.BRACKET_PASSES + [(2, loops["2"])] * 4 * e2e.BRACKET_PASSES
    assert sorted(p for p in passes if p[1] == 2) == sorted(
        (t, 2, int(pf)) for t in (1, 2) for pf in _native.kernels.READ_BANDWIDTH_PREFETCH)
    assert opened == [(str(path), e2e.N_CTX, 1, 1), (str(path), e2e.N_CTX, 1, 2)]
    assert len(rep["rows"]) == 2 * len(e2e.TESTS)
    assert all(len(r["samples"]) == 2 and r["tokens_per_s"] > 0 for r in rep["rows"])
    assert len(rep["samples"]) == 2 * 2 * len(e2e.TESTS)
    bpt = inspect_model(str(path))["bytes_per_token"]["total"]
    llc = rep["config"]["last_level_cache"]
    assert rep["models"] == [{"name": "q", "bytes_per_token": bpt,
                              "cache_assisted": (bpt < 4 * llc["bytes"]) if llc else None}]
    assert rep["config"]["isa"] in ("ref", "avx2", "avx512") and rep["config"]["cpu_model_name"]
    # One engine only (--engines ktd): the table prints it, the other column as "-", and says why.
    table = e2e.format_table(rep)
    assert "q llama.cpp: not available: not run (--engines)" in table
    assert table.count("\n") > 2 * len(e2e.TESTS) and "machine: " in table
    assert [bw["threads"] for bw in rep["read_bandwidth"]] == [1, 2]
    assert all(bw["bytes_per_s"] > 0 for bw in rep["read_bandwidth"])
    assert all(c["decode_pct_of_ceiling"]["ktd"] > 0 for c in rep["ceiling"])
    # BRACKET_PASSES bandwidth passes before and as many after each repetition's tg128, per
    # thread count.
    assert all(len(c["during_decode"]["samples"]) == 2 * 2 * e2e.BRACKET_PASSES and c["during_decode"]["decode_pct_of_ceiling"]["ktd"] > 0
               for c in rep["ceiling"])
    assert [(i["model"], i["threads"], i["info"]["name"]) for i in rep["config"]["ktd_engine_info"]] == [
        ("q", 1, "fake"), ("q", 2, "fake")]


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (requirements-dev.txt) draws the plot")
    from ktd.bench.e2e_plot import write_png
    llama_only = [s for s in PP + TG if s["engine"] == "llama.cpp"]
    for name, rep in (("both", _report(PP + TG)),
                      ("llama", _report(llama_only, unavailable={("m", "ktd"): "ktd.server.engine missing"}))):
        png = tmp_path / f"{name}.png"
        write_png(rep, png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.realmodel
@pytest.mark.slow
def test_llama_cpp_loop_matches_llama_eval(real_model):
    """The llama.cpp measurement loop (raw C API, one llama_decode per step) produces the greedy
    tokens that llama-cpp-python's own Llama.eval + argmax produce."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by `make oracle`")
    path = real_model("qwen2.5-coder-0.5b")
    prompt = e2e.prompt_tokens(path, e2e.TG_PROMPT_TOKENS)
    runner = e2e.LlamaCppRunner(path, threads=1)
    try:
        assert runner.prefill(e2e.prompt_tokens(path, 64)) > 0
        _, got = runner.decode(prompt, 12)
    finally:
        runner.close()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=e2e.N_CTX, n_batch=e2e.N_BATCH, n_ubatch=e2e.N_BATCH,
                          n_threads=1, n_threads_batch=1, verbose=False)
    want, ids = [], prompt.tolist()
    for _ in range(13):
        llm.eval(ids)   # its own batch (positions from n_past), logits for the last row only
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        ids = [int(np.argmax(logits))]
        want.append(ids[0])
    assert got == want


def test_synthetic_moe_models_resolve_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KTD_CACHE", str(tmp_path))
    m = {b.name: b for b in e2e.MODELS}["synthetic-qwen3moe-bench"]
    with pytest.raises(FileNotFoundError, match=r"tests\.models\.synthetic_moe --preset bench --arch qwen3moe"):
        m.resolve()
    path = tmp_path / "synthetic" / "qwen3moe-bench-q4_k_m-s0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    assert m.resolve() == path


@pytest.mark.parametrize("name, file, writer", [
    ("synthetic-qwen2-7b-bench", "qwen2-7b-bench-q4_k_m-s0.gguf", r"python -m tests\.models\.synthetic_dense"),
    ("synthetic-qwen3moe-dram", "qwen3moe-dram-q4_k_m-s0.gguf",
     r"python -m tests\.models\.synthetic_moe --preset dram --arch qwen3moe"),
    ("synthetic-deepseek2-v2-lite-dram", "deepseek2-v2-lite-dram-q4_k_m-s0.gguf",
     r"python -m tests\.models\.synthetic_moe --preset dram --arch deepseek2"),
])
def test_the_dram_bench_files_are_run_only_when_named(tmp_path, monkeypatch, name, file, writer):
    """The files that read GBs per token (synthetic-qwen2-7b-bench 4.4 GB, the MoE dram presets
    1.6-1.9 GB) are not in the default list; named, each resolves from the cache or says which command
    writes it."""
    monkeypatch.setenv("KTD_CACHE", str(tmp_path))
    assert name not in [m.name for m in e2e.select_models(None, quick=False)]
    (m,) = e2e.select_models([name], quick=False)
    with pytest.raises(FileNotFoundError, match=writer):
        m.resolve()
    path = tmp_path / "synthetic" / file
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    assert m.resolve() == path


def _fake_llama_bench(tmp_path, body=None):
    """An executable standing in for llama-bench: logs its argv, answers like ``-o json`` with
    avg_ns = 1 ms per prompt token + 10 ms per generated token (and one decoy result)."""
    log = tmp_path / "argv.log"
    exe = tmp_path / "llama-bench"
    body = body or (
        "a = sys.argv[1:]\n"
        "p, n = int(a[a.index('-p') + 1]), int(a[a.index('-n') + 1])\n"
        "print(json.dumps([{'n_prompt': p + 1, 'n_gen': n, 'avg_ns': 1},\n"
        "                  {'n_prompt': p, 'n_gen': n, 'avg_ns': p * 1_000_000 + n * 10_000_000}]))\n")
    exe.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n" + body)
    exe.chmod(0o755)
    return exe, log


def test_llama_bench_peer_runs_one_process_per_measurement(tmp_path):
    exe, log = _fake_llama_bench(tmp_path)
    r = e2e.LlamaBenchRunner(str(exe), Path("/models/m.gguf"), 2, ["-fmoe", "1"])
    assert r.prefill(np.arange(128, dtype=np.int32)) == pytest.approx(0.128)
    assert r.decode(np.arange(16, dtype=np.int32), 128) == (pytest.approx(1.28), None)
    argv = [json.loads(x) for x in log.read_text().splitlines()]
    assert argv[0] == ["-m", "/models/m.gguf", "-t", "2", "-p", "128", "-n", "0", "-b", "512", "-ub", "512",
                       "-ngl", "0", "-r", "1", "-o", "json", "-fmoe", "1"]
    assert argv[1][4:8] == ["-p", "0", "-n", "128"]
    # Interleaved with the other engines, every repetition, by the same loop (here alone).
    c = e2e._Collected()
    e2e._bench_threads(c, "m", Path("/models/m.gguf"), np.arange(600, dtype=np.int32), 2, ["llama-bench"],
                       e2e.TESTS, 2, lambda th: 30e9, e2e.PeerBench(str(exe)))
    got = {(s["test"], s["rep"]): s["tokens_per_s"] for s in c.samples}
    assert got == {("pp128", 0): pytest.approx(1000.0), ("pp512", 0): pytest.approx(1000.0),
                   ("tg128", 0): pytest.approx(100.0), ("pp128", 1): pytest.approx(1000.0),
                   ("pp512", 1): pytest.approx(1000.0), ("tg128", 1): pytest.approx(100.0)}
    assert c.greedy == {} and len(c.bw_samples) == 2 * 2 * e2e.BRACKET_PASSES and not c.unavailable


@pytest.mark.parametrize("body,message", [
    ("sys.stderr.write('error: failed to load model\\n'); sys.exit(1)\n", "exited with 1: error: failed to load model"),
    ("print('| model | t/s |')\n", "no single pp128/tg0 result with avg_ns"),
    ("print(json.dumps([{'n_prompt': 128, 'n_gen': 0, 'avg_ns': 0}]))\n", "avg_ns 0 is not positive"),
])
def test_llama_bench_failures_are_errors_with_the_reason(tmp_path, body, message):
    exe, _ = _fake_llama_bench(tmp_path, body)
    r = e2e.LlamaBenchRunner(str(exe), Path("m.gguf"), 1)
    with pytest.raises(RuntimeError, match=message):
        r.prefill(np.arange(128, dtype=np.int32))


def test_llama_bench_missing_is_unavailable(tmp_path, monkeypatch):
    with pytest.raises(e2e.EngineUnavailable, match="not executable: /nonexistent/llama-bench"):
        e2e.LlamaBenchRunner("/nonexistent/llama-bench", Path("m.gguf"), 1)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(e2e.EngineUnavailable, match="not found on PATH"):
        e2e.open_runner("llama-bench", Path("m.gguf"), 1)


def test_three_engines_report_a_ratio_per_peer():
    # llama-bench: 5/10/40 pp128 -> ktd/llama-bench 2, 3, 0.5 -> median 2; tg 10, 11 -> 2.0, 2.0
    lb = [_s("llama-bench", "pp128", 0, 5.0), _s("llama-bench", "pp128", 1, 10.0),
          _s("llama-bench", "pp128", 2, 40.0), _s("llama-bench", "tg128", 0, 10.0),
          _s("llama-bench", "tg128", 1, 11.0)]
    engines = ["ktd", "llama.cpp", "llama-bench"]
    rep = e2e.summarise(model_names=["m"], engines=engines, threads=[1], tests=["pp128", "tg128"],
                        samples=PP + TG + lb, unavailable={}, read_bandwidth={1: 20e9},
                        bytes_per_token={"m": 400_000_000})
    e2e.validate_report(rep)
    ratios = {r["test"]: r for r in rep["ratios"]}
    assert ratios["pp128"]["ktd_over"] == {"llama.cpp": 1.0, "llama-bench": 2.0}
    assert ratios["pp128"]["per_rep_over"]["llama-bench"] == [2.0, 3.0, 0.5]
    assert ratios["tg128"]["ktd_over"] == {"llama.cpp": pytest.approx(0.9), "llama-bench": 2.0}  # 20/25, 22/22
    assert rep["ceiling"][0]["decode_pct_of_ceiling"]["llama-bench"] == pytest.approx(21.0)  # 10.5 / 50
    rep["config"] = {"engines": engines}
    table = e2e.format_table(rep).splitlines()
    assert "lbench t/s" in table[0] and "ktd/lbench" in table[0] and "lbench %ceil" in table[0]
    pp = next(x for x in table if x.startswith("m ") and "pp128" in x).split()
    assert pp[3:8] == ["25.00", "10.00", "1.000", "10.00", "2.000"]


def test_the_avx2_engine_is_reported_against_ktd_and_llama_cpp():
    # ktd-avx2 pp128 5/10/20 -> ktd/avx2 2, 3, 1 -> 2; avx2/llama 0.5, 1, 0.5 -> 0.5; tg 16, 20:
    # ktd/avx2 1.25, 1.1 -> 1.175, avx2/llama 0.64, 0.909 -> 0.7745; % of the 50 tok/s ceiling 36.
    avx2 = [_s("ktd-avx2", "pp128", 0, 5.0), _s("ktd-avx2", "pp128", 1, 10.0), _s("ktd-avx2", "pp128", 2, 20.0),
            _s("ktd-avx2", "tg128", 0, 16.0), _s("ktd-avx2", "tg128", 1, 20.0)]
    engines = ["ktd", "ktd-avx2", "llama.cpp"]
    rep = e2e.summarise(model_names=["m"], engines=engines, threads=[1], tests=["pp128", "tg128"],
                        samples=PP + TG + avx2, unavailable={}, read_bandwidth={1: 20e9},
                        bytes_per_token={"m": 400_000_000}, config={"engines": engines})
    e2e.validate_report(rep)
    ratios = {r["test"]: r for r in rep["ratios"]}
    assert ratios["pp128"]["ktd_over"] == {"ktd-avx2": 2.0, "llama.cpp": 1.0}
    assert ratios["pp128"]["isa_engine_over_llama_cpp"] == {"ktd-avx2": 0.5}
    assert ratios["tg128"]["ktd_over"]["ktd-avx2"] == pytest.approx(1.175)
    assert ratios["tg128"]["isa_engine_over_llama_cpp"]["ktd-avx2"] == pytest.approx((0.64 + 20 / 22) / 2)
    assert rep["ceiling"][0]["decode_pct_of_ceiling"]["ktd-avx2"] == pytest.approx(36.0)
    table = e2e.format_table(rep).splitlines()
    assert table[0].split()[:12] == ["model", "thr", "test", "ktd", "t/s", "avx2", "t/s", "ktd/avx2", "avx2/llama",
                                     "llama", "t/s", "ktd/llama"]
    pp = next(x for x in table if x.startswith("m ") and "pp128" in x).split()
    assert pp[3:9] == ["25.00", "10.00", "2.000", "0.500", "10.00", "1.000"]
    tg = next(x for x in table if x.startswith("m ") and "tg128" in x).split()
    assert tg[10:13] == ["42.0", "36.0", "47.0"]   # % of the ceiling: ktd, avx2, llama.cpp
    assert any(x.startswith("avx2: ktd with KTD_ISA=avx2 (a process of its own") for x in table)


def test_default_engines_add_the_avx2_path_only_where_avx512_runs(monkeypatch):
    from ktd import _native
    from ktd.ops import machine
    monkeypatch.delenv("KTD_ISA", raising=False)
    uses_avx512 = "avx512" in {_native.kernels.active_isa(), *machine.kernel_isa_by_type().values()}
    want = ["ktd", "ktd-avx2", "llama.cpp"] if uses_avx512 and "avx2" in machine.runnable_isas() else ["ktd", "llama.cpp"]
    assert e2e.default_engines() == want
    monkeypatch.setenv("KTD_ISA", "avx2")   # the user fixed the ISA: measured as asked, nothing added
    assert e2e.default_engines() == ["ktd", "llama.cpp"]


def test_child_engine_decodes_as_the_in_process_one(tmp_path):
    """KtdChildRunner (a ktd engine in a process of its own with KTD_ISA set) on a tiny model: with
    this process's own ISA its greedy tokens are the in-process KtdRunner's; with KTD_ISA=ref the
    child reports the ref kernels; a file it cannot open is EngineUnavailable with the child's
    reason; an unknown ISA is refused before any process starts."""
    from models import tiny_dense
    from ktd import _native

    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    prompt = np.arange(40, 56, dtype=np.int32)
    local = e2e.KtdRunner.open(path, 1)
    _, want = local.decode(prompt, 12)
    local.close()
    child = e2e.KtdChildRunner(path, 1, _native.kernels.active_isa())
    try:
        assert child.info["isa"] == _native.kernels.active_isa()
        assert child.prefill(prompt) > 0
        assert child.finish_tuning(prompt) >= 0
        sec, got = child.decode(prompt, 12)
        assert got == want and len(got) == 13 and sec > 0 and child.n_vocab == local.n_vocab
    finally:
        child.close()
    assert child.proc.returncode == 0
    ref = e2e.KtdChildRunner(path, 1, "ref")
    try:
        assert ref.info["isa"] == "ref"
        assert len(ref.decode(prompt, 3)[1]) == 4
    finally:
        ref.close()
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(e2e.EngineUnavailable, match="cannot open bad.gguf"):
        e2e.KtdChildRunner(tmp_path / "bad.gguf", 1, "ref")
    with pytest.raises(ValueError):
        e2e.KtdChildRunner(path, 1, "sse9")
