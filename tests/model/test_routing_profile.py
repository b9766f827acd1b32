"""The MoE routing profile (ktd.ops.routing_profile): counts saved atomically under the state
directory, added up over runs, keyed by the GGUF header; the daemon writes it on shutdown, answers
`profile` (ktctl profile) and keeps serving when the file cannot be written (disk full, a file
size limit). The oracle for the counts is the engine's own routing statistics
(Context.expert_counts), which tests/model/test_moe_forward.py checks against the numpy MoE reference."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon_helpers import spawn_real_serve
from ktd.ops import routing_profile as rp
from ktd.client import Client
from ktd.server.engine import Engine
from models import synthetic_moe


# --- the store --------------------------------------------------------------------------------

def test_save_load_add_up_and_reset(tmp_path):
    p = rp.RoutingProfile(tmp_path, "k", (3, 4))
    live = np.array([[0, 0, 0, 0], [1, 2, 3, 4], [5, 0, 0, 1]], np.uint64)
    p.update(live)
    assert p.save() and p.path.exists()
    assert not list(p.path.parent.glob(".routing-*"))          # no temporary file left
    q = rp.RoutingProfile(tmp_path, "k", (3, 4))                # the next run starts from it
    np.testing.assert_array_equal(q.counts(), live)
    q.update(live * 2)
    np.testing.assert_array_equal(q.counts(), live * 3)
    s = q.summary()
    assert s["routed"] == int(live.sum()) * 3 and [l["layer"] for l in s["layers"]] == [1, 2]
    assert s["layers"][0]["top"][0] == [3, 12]
    q.reset()
    assert q.counts().sum() == 0
    q.update(live * 2 + 1)                                      # routed after the reset: counted
    np.testing.assert_array_equal(q.counts(), np.ones((3, 4), np.uint64))


def test_unreadable_or_mismatched_files_start_from_zero(tmp_path, caplog):
    d = tmp_path / "routing"
    d.mkdir()
    np.save(d / "a.npy", np.ones((2, 5), np.uint64))
    assert rp.RoutingProfile(tmp_path, "a", (3, 4)).counts().sum() == 0
    (d / "b.npy").write_bytes(b"not numpy")
    assert rp.RoutingProfile(tmp_path, "b", (3, 4)).counts().sum() == 0
    np.save(d / "c.npy", np.ones((3, 4), np.float32))
    assert rp.RoutingProfile(tmp_path, "c", (3, 4)).counts().sum() == 0
    assert sum("starting from zero" in r.message for r in caplog.records) == 3


def test_a_write_that_fails_is_logged_once_and_reported(tmp_path, caplog):
    (tmp_path / "routing").write_text("a file where the directory should be")
    p = rp.RoutingProfile(tmp_path, "k", (1, 2))
    p.update(np.array([[1, 2]], np.uint64))
    assert p.save() is False and p.save() is False
    assert p.summary()["last_error"] and p.summary()["saved_at"] is None
    assert sum("not written" in r.message for r in caplog.records) == 1


def test_model_key_names_the_header(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    synthetic_moe.make_model("qwen2moe", a, seed=0)
    synthetic_moe.make_model("qwen3moe", b, seed=0)
    ka = rp.model_key(a)
    assert ka == rp.model_key(a) and ka != rp.model_key(b) and len(ka) == 64
    c = tmp_path / "c.gguf"                      # same header, other weights: the same model shape
    c.write_bytes(a.read_bytes()[:-64] + bytes(64))
    assert rp.model_key(c) == ka


# --- the daemon -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_model(tiny_model):
    return tiny_model("qwen2moe")


def _start(model: Path, sock: Path, state: Path, preexec=None) -> subprocess.Popen:
    return spawn_real_serve(model, sock, {"KTD_MODEL__N_CTX": "128", "KTD_MODEL__N_SEQ_MAX": "2",
                                          "STATE_DIRECTORY": str(state), "KTD_MODEL__ROUTING_PROFILE": "auto"},
                            preexec=preexec)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return out


def test_daemon_keeps_the_profile_across_restarts(moe_model, tmp_path):
    sock, state = tmp_path / "ktd.sock", tmp_path / "state"
    proc = _start(moe_model, sock, state)
    try:
        with Client(str(sock)) as c:
            c.generate("hello experts", max_tokens=6, temperature=0, ignore_eos=True)
            first = c.call("profile")
    finally:
        _stop(proc)
    assert first["enabled"] and first["n_expert"] > 0
    saved = np.load(state / "routing" / f"{rp.model_key(moe_model)}.npy")
    assert saved.sum() >= first["routed"] > 0       # the shutdown write holds at least what was shown

    # Every forwarded token is routed to expert_used_count experts in every MoE layer: the prompt
    # and the first 5 of the 6 generated tokens were forwarded (the last one is only sampled).
    from ktd.model.gguf import GGUFFile
    f = GGUFFile(str(moe_model))
    k = int(f.metadata["qwen2moe.expert_used_count"])
    n_moe = sum(1 for name in f.tensors if name.endswith(".ffn_gate_exps.weight"))
    n_prompt = len(Engine.open(str(moe_model), n_ctx=128, n_seq_max=1, threads=1).tokenizer.encode("hello experts"))
    assert int(saved.sum()) == n_moe * k * (n_prompt + 5)
    assert saved.shape == (int(f.metadata["qwen2moe.block_count"]), int(f.metadata["qwen2moe.expert_count"]))

    proc = _start(moe_model, sock, state)
    try:
        with Client(str(sock)) as c:
            again = c.call("profile")
            assert again["routed"] == int(saved.sum())          # the earlier run's counts are back
            c.generate("more", max_tokens=3, temperature=0, ignore_eos=True)
            reset = c.call("profile", reset=True)              # the daemon's own uid may reset
            assert reset["routed"] == 0 and reset["layers"] == []
    finally:
        _stop(proc)
    out = subprocess.run([sys.executable, "-c", "import sys; from ktd.ctl import main; sys.exit(main())",
                          "-s", str(sock), "profile"], capture_output=True, text=True)
    assert out.returncode == 1 and "ktctl: error" in out.stderr     # daemon gone: a clear error


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


def test_daemon_serves_on_when_the_profile_cannot_be_written(moe_model, tmp_path):
    """A file size limit (as a full disk or a quota would) makes every profile write fail: the
    daemon logs it once, reports it, answers requests and stops cleanly."""
    sock, state = tmp_path / "ktd.sock", tmp_path / "state"
    proc = _start(moe_model, sock, state, preexec=_limit_file_size)
    try:
        with Client(str(sock)) as c:
            r = c.generate("hello", max_tokens=4, temperature=0, ignore_eos=True)
            assert r["usage"]["completion_tokens"] == 4
            p = c.call("profile", reset=True)          # reset writes at once: it fails
            assert p["last_error"] and "large" in p["last_error"].lower()
            assert c.health()["status"] == "ok"
    finally:
        out = _stop(proc)
    assert out.count("routing profile not written") == 1, out
    assert not list((state / "routing").glob("*.npy"))


def test_ktctl_profile_prints_the_layers(moe_model, tmp_path):
    sock, state = tmp_path / "ktd.sock", tmp_path / "state"
    proc = _start(moe_model, sock, state)
    try:
        with Client(str(sock)) as c:
            c.generate("hello", max_tokens=4, temperature=0, ignore_eos=True)
        ctl = [sys.executable, "-c", "import sys; from ktd.ctl import main; sys.exit(main())", "-s", str(sock)]
        out = subprocess.run(ctl + ["profile"], capture_output=True, text=True, check=True).stdout
        assert "routing profile" in out and "layer" in out and "top experts" in out
        doc = json.loads(subprocess.run(ctl + ["profile", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
        assert doc["routed"] > 0
    finally:
        _stop(proc)
