"""model.weights_map: auto after a cache miss: the engine serves from the model file while the
background builder (ktd.ops.cache_builder) writes the prepared entry, then opens the entry (mapped,
checksums verified) and switches to it when no request is in flight (WeightsManager.switch, called
by the scheduler's engine thread).

Oracles: an arena load of the same file (repacked, no cache) for the tokens after the switch and,
bit for bit, its logits; the arena path without repacking for the logits before it (test_weights_map
holds gguf equal to it); greedy tokens of every request before, during and after the build equal
the arena load's. The build is held at a gate (KTD_TEST_CACHE_BUILD_GATE) so that "before" does not
depend on the machine's speed; KTD_TEST_CACHE_BUILD_FAIL / _CORRUPT make it fail or write a
corrupted entry. Scheduler-level ordering (never while a sequence runs) is tested with the fake
engine in test_scheduler.py.
"""

from __future__ import annotations

import gc
import logging
import os
import time

import numpy as np
import pytest

from engine_probes import file_ranges, greedy_in_process, model_logits
from ktd import _native
from ktd.server.engine import Engine
from ktd.server.scheduler import Scheduler
from ktd.server.engine_api import model_info
from ktd.server.weights import WeightsManager
from models.tiny_dense import make_model
from scheduler_helpers import RecordingTokenizer, run_greedy_job

PROMPTS = [[1, 5, 9, 3, 7], [1, 5, 9, 3, 7, 2, 11], [1, 4, 4, 8, 2]]
MAX_TOKENS = 8
BUILD_S = 300  # upper bound on the tiny model's build and open (a loaded machine), not a speed check


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    """MAX_TOKENS greedy tokens (end of text ignored) by direct forwards in slot 0."""
    out, batch, pos = [], list(prompt), 0
    for _ in range(MAX_TOKENS):
        n = len(batch)
        logits = engine.forward(np.array(batch, np.int32), np.arange(pos, pos + n, dtype=np.int32),
                                np.zeros(n, np.int32), np.arange(n) == n - 1)
        pos += n
        batch = [int(np.argmax(logits[-1]))]
        out.append(batch[0])
    engine.free_seq(0)
    return out


def _open_auto(path, cache) -> tuple[Engine, WeightsManager]:
    e = Engine.open(str(path), n_ctx=64, n_seq_max=2, threads=2, pin=False, weights_cache=str(cache),
                    weights_map="auto", cache_slots=2)
    return e, WeightsManager.start(e)


@pytest.fixture
def model(tmp_path):
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    cache = tmp_path / "cache"
    cache.mkdir()
    return path, cache


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """The builder waits until this file exists."""
    g = tmp_path / "build-may-start"
    monkeypatch.setenv("KTD_TEST_CACHE_BUILD_GATE", str(g))
    return g


def test_the_switch_serves_what_an_arena_load_serves(model, gate, caplog):
    path, cache = model
    arena = Engine.open(str(path), n_ctx=64, threads=2, pin=False)  # repacked, no cache
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    expected = [_greedy(arena, p) for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e, w = _open_auto(path, cache)
        try:
            assert w.status()["state"] == "building" and e.model.memory["weights_map"] == "gguf"
            np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(plain).view(np.uint32))
            before = [_greedy(e, p) for p in PROMPTS]
            assert w.switch() is False  # nothing to switch to yet
            gate.touch()
            st = w.wait(timeout=BUILD_S)
            assert st["state"] == "ready", st
            assert e.model.memory["weights_map"] == "gguf"  # until the engine thread switches
            assert w.switch() is True
            assert w.switch() is False  # once
            assert e.model.memory["weights_map"] == "arena" and e.model.cache["state"] == "hit"
            np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(arena.model).view(np.uint32))
            after = [_greedy(e, p) for p in PROMPTS]
            assert before == expected and after == expected
            sw = model_info(e, w)["memory"]["weights_map_switch"]
            assert sw["state"] == "done" and sw["from"] == "gguf" and sw["to"] == "arena" and sw["at"]
            assert sw["entry"] == e.model.cache["path"]
            assert w.builder.poll() == 0
        finally:
            w.close()
    del plain, arena
    gc.collect()
    assert file_ranges(path) == []  # the file's pages the gguf map served are released
    assert "switched from gguf to arena" in caplog.text


def test_a_switch_in_a_multi_request_run_gives_the_arena_tokens(model, gate):
    """Requests before the build (held at the gate), right after it is let go (before or after the
    switch, whichever the machine makes it), and after the switch; the prefix cache holds entries
    across the switch (they must be dropped: the new KV cache is empty)."""
    path, cache = model
    arena = Engine.open(str(path), n_ctx=64, threads=2, pin=False)
    expected = [_greedy(arena, p) for p in PROMPTS]
    e, w = _open_auto(path, cache)
    rec = RecordingTokenizer(e.tokenizer)
    e.tokenizer = rec
    s = Scheduler(e, prefill_tokens_per_step=16, max_queue=4, weights=w)
    s.start()
    try:
        got = [run_greedy_job(s, rec, p, MAX_TOKENS)[0] for p in PROMPTS]
        assert s.prefix.stats()["entries"] > 0 and w.status()["state"] == "building"
        gate.touch()
        got += [run_greedy_job(s, rec, p, MAX_TOKENS)[0] for p in PROMPTS]
        st = w.wait(("done", "failed"), timeout=BUILD_S)
        assert st["state"] == "done", st
        assert e.model.memory["weights_map"] == "arena"
        got += [run_greedy_job(s, rec, p, MAX_TOKENS)[0] for p in PROMPTS]
        got += [run_greedy_job(s, rec, p, MAX_TOKENS)[0] for p in PROMPTS]  # from the prefix cache filled after it
        assert s.prefix.stats()["hits"] > 0
    finally:
        s.stop(timeout=30)
        w.close()
    assert got == expected * 4


@pytest.mark.parametrize("hook,why", [("KTD_TEST_CACHE_BUILD_FAIL", "the background build failed: exit 1"),
                                      ("KTD_TEST_CACHE_BUILD_CORRUPT", "the entry cannot be used: checksum mismatch")])
def test_a_failed_switch_keeps_serving_from_the_file(model, monkeypatch, caplog, hook, why):
    path, cache = model
    monkeypatch.setenv(hook, "1")
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e, w = _open_auto(path, cache)
        try:
            st = w.wait(("ready", "failed"), timeout=BUILD_S)
            assert st["state"] == "failed" and why in st["reason"], st
            assert w.switch() is False
            assert e.model.memory["weights_map"] == "gguf"
            assert model_info(e, w)["memory"]["weights_map_switch"] == st
            # the entry's path and the reason name the model's path: operators only
            from ktd.server.connections import _unprivileged_model
            assert _unprivileged_model(model_info(e, w))["memory"]["weights_map_switch"] == {
                "state": "failed", "from": "gguf", "to": "arena"}
            np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(plain).view(np.uint32))
        finally:
            w.close()
    assert "not switching to the prepared entry" in caplog.text


def test_close_stops_a_running_build(model, gate):
    path, cache = model
    e, w = _open_auto(path, cache)
    b = w.builder
    assert b.poll() is None  # held at the gate
    w.close()
    assert b.poll() is not None
    assert not [p for p in cache.iterdir() if p.suffix == ".ktdw"]


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _wait_status(c, pred, timeout: float = BUILD_S) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_daemon_switches_and_shows_it_in_status(model, gate):
    """A real daemon with weights_map: auto and a weights cache: serves from the file, status
    shows the build, then the switch; generations equal the arena engine's."""
    from daemon_helpers import RealServe
    from ktd.client import Client

    path, cache = model
    sock = path.parent / "ktd.sock"
    with RealServe(path, sock, {"KTD_MODEL__N_CTX": "128", "KTD_MODEL__WEIGHTS_CACHE": str(cache),
                                "KTD_MODEL__WEIGHTS_MAP": "auto", "KTD_MODEL__THREADS": "1"}) as daemon:
        with Client(str(sock), timeout=60) as c:
            st = c.status()
            assert st["memory"]["weights_map"] == "gguf"
            assert st["model"]["memory"]["weights_map_switch"]["state"] == "building"
            first = "".join(c.stream("hello", temperature=0, max_tokens=MAX_TOKENS))
            gate.touch()
            st = _wait_status(c, lambda s: s["model"]["memory"]["weights_map_switch"]["state"] in ("done", "failed"))
            sw = st["model"]["memory"]["weights_map_switch"]
            assert sw["state"] == "done" and sw["from"] == "gguf" and sw["to"] == "arena", sw
            assert st["memory"]["weights_map"] == "arena"
            second = "".join(c.stream("hello", temperature=0, max_tokens=MAX_TOKENS))
    assert "weights map: switched from gguf to arena" in daemon.output
    expected = greedy_in_process(Engine.open(str(path), n_ctx=128, n_seq_max=1, threads=1), "hello", MAX_TOKENS)
    assert first == second == expected


def test_daemon_stop_leaves_no_builder(model, gate):
    from daemon_helpers import RealServe

    path, cache = model
    sock = path.parent / "ktd.sock"
    with RealServe(path, sock, {"KTD_MODEL__N_CTX": "64", "KTD_MODEL__WEIGHTS_CACHE": str(cache),
                                "KTD_MODEL__WEIGHTS_MAP": "auto", "KTD_MODEL__THREADS": "1"}) as daemon:
        builders = _children(daemon.proc.pid)
        assert len(builders) == 1  # held at the gate
    assert not os.path.exists(f"/proc/{builders[0]}"), "the builder outlived the daemon"


def test_ktd_run_starts_no_builder_and_prepares_with_prepare(model, gate, monkeypatch, capsys, caplog):
    """``ktd run`` (one shot) with the default auto and no entry: serves from the file and starts
    no builder (no child process, nothing written); --prepare writes the entry in the foreground,
    and the next run maps it."""
    from ktd import cli

    path, cache = model
    monkeypatch.setenv("KTD_MODEL__WEIGHTS_CACHE", str(cache))
    argv = ["run", str(path), "--prompt", "hello", "--max-tokens", "4", "--threads", "1"]
    children = set(_children(os.getpid()))
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert "no background build here" in caplog.text
    assert set(_children(os.getpid())) == children and list(cache.iterdir()) == []
    assert cli.main(argv + ["--prepare"]) == 0
    assert capsys.readouterr().out == first
    assert [p.suffix for p in cache.iterdir()] == [".ktdw"] and set(_children(os.getpid())) == children
    e = Engine.open(str(path), n_ctx=32, threads=1, pin=False, weights_cache=str(cache), weights_map="auto")
    assert e.model.cache["state"] == "hit" and WeightsManager.start(e).builder is None


def _forward_logits(engine: Engine) -> np.ndarray:
    """A prefill of PROMPTS[1] and two decode steps through the engine's own context (its backend)."""
    p = np.array(PROMPTS[1], np.int32)
    n = len(p)
    out = [engine.forward(p, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.ones(n, bool))]
    for i, t in enumerate((6, 8)):
        out.append(engine.forward(np.array([t], np.int32), np.array([n + i], np.int32), np.zeros(1, np.int32),
                                  np.ones(1, bool)))
    engine.free_seq(0)
    return np.concatenate(out)


@pytest.mark.parametrize("backend", ["loopback", "cuda-emulated"])
def test_the_switch_keeps_the_backend(tmp_path, gate, backend):
    """The hybrid backends (the loopback device, the emulated CUDA device: its own KV cache and
    copy of the weights) are set on the new context as at load; the old device is released first.
    The forward equals an arena load's on the same backend, bit for bit."""
    from models import synthetic_moe as S

    path = S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0")
    cache = tmp_path / "cache"
    cache.mkdir()
    arena = Engine.open(str(path), n_ctx=64, threads=2, pin=False)
    arena.context.set_backend(backend)
    e, w = _open_auto(path, cache)
    try:
        e.context.set_backend(backend)
        e.backend_args = (backend, {})
        gate.touch()
        assert w.wait(timeout=BUILD_S)["state"] == "ready"
        assert w.switch() is True and e.model.memory["weights_map"] == "arena"
        assert e.context.backend == backend
        np.testing.assert_array_equal(_forward_logits(e).view(np.uint32), _forward_logits(arena).view(np.uint32))
    finally:
        w.close()


@pytest.mark.parametrize("arch,wtype", [("qwen3moe", "Q8_0"), ("deepseek2", "Q8_0"), ("qwen2", "Q4_0"),
                                        ("gemma3", "Q5_0")])
def test_the_switch_of_other_architectures(tmp_path, gate, arch, wtype):
    """Expert stacks (MoE), the MLA stacks (deepseek2), tied output (qwen2) and other block types:
    logits before the switch equal the plain arena's, after it a repacked arena load's, bit for bit."""
    from models import synthetic_moe as S

    if arch in ("qwen3moe", "deepseek2"):
        path = S.make_model(arch, tmp_path / "m.gguf", wtype=wtype)
    else:
        path = make_model(arch, tmp_path / "m.gguf", wtype=wtype, variant="tied" if arch == "qwen2" else None)
    cache = tmp_path / "cache"
    cache.mkdir()
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    arena = _native.Model(str(path), n_threads=2, pin=False)
    e, w = _open_auto(path, cache)
    try:
        np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(plain).view(np.uint32))
        _greedy(e, PROMPTS[0])
        routed = e.expert_counts()
        gate.touch()
        assert w.wait(timeout=BUILD_S)["state"] == "ready"
        assert w.switch() is True and e.model.repacked_bytes == arena.repacked_bytes
        np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(arena).view(np.uint32))
        # MoE: the routing statistics stay cumulative across the switch (the routing profile's)
        np.testing.assert_array_equal(e.expert_counts(), routed)
        _greedy(e, PROMPTS[0])
        assert e.expert_counts().sum() == 2 * routed.sum() and (e.expert_counts() >= routed).all()
        assert (routed.sum() > 0) == (e.model.n_expert > 0)
        e.reset_expert_counts()
        assert not e.expert_counts().any()
    finally:
        w.close()
