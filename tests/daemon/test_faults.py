"""Fault scenarios: what an unlucky operator's machine does to the daemon. Each runs
the real daemon process (the fake engine, or the real one on a generated tiny model)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import msgpack
import pytest

from daemon_helpers import DaemonProcess, NotifySocket, wait_for
from ktd.server import protocol
from ktd.client import Internal
from paths import TESTS


def test_a_client_that_connects_and_sends_nothing_is_closed_after_the_idle_timeout():
    with DaemonProcess(server={"idle_timeout_s": 0.5}) as d:
        quiet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        quiet.settimeout(20)
        quiet.connect(d.socket)
        partial = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a slow partial message
        partial.settimeout(20)
        partial.connect(d.socket)
        partial.sendall(protocol.pack([0, 1, "tokenize", [{"text": "x" * 100}]])[:20])
        with d.client() as busy:  # a client with a request in progress is not idle
            s = busy.stream("slow", max_tokens=3, ignore_eos=True)
            for sock in (quiet, partial):
                u = msgpack.Unpacker(raw=False)
                while chunk := sock.recv(4096):  # until the daemon closes
                    u.feed(chunk)
                msgs = list(u)
                assert msgs and msgs[-1][1] == "error" and "idle_timeout_s" in msgs[-1][2][0]["message"]
                sock.close()
            assert len(s.text()) > 0


def test_the_engine_thread_ending_makes_the_daemon_unhealthy_and_stops_the_watchdog():
    d = DaemonProcess(fake={"die_after_steps": 2}, env={"WATCHDOG_USEC": "200000"})
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    try:
        d.start()
        assert wait_for(lambda: notify.keys().count("WATCHDOG") >= 2, 10)
        with d.client(timeout=30) as c:
            with pytest.raises(Internal, match="engine thread failed"):
                c.generate("x", max_tokens=20, ignore_eos=True)
            # the thread ends just after it has answered the request it failed
            assert wait_for(lambda: c.health()["status"] == "unhealthy", 10), c.health()
            assert wait_for(lambda: "the engine thread has ended: watchdog not fed" in d.log(), 10)
            n = notify.keys().count("WATCHDOG")
            assert not wait_for(lambda: notify.keys().count("WATCHDOG") > n + 1, 1.0)
            with pytest.raises(Internal, match="not running"):  # no silent queueing for nobody
                c.generate("y", max_tokens=2)
    finally:
        notify.close()
        d.proc.kill()
        d.close()


# The real engine on a tiny model whose file changes under it. Runs in a child process: a SIGBUS
# must fail this test, not take pytest down. The model no longer reads its file after the load
# (every tensor the forward reads is in its arenas, the file's mapping is gone), so the logits
# after the change must be bit-identical to those before it.
_FILE_CHANGES = textwrap.dedent("""
    import os, shutil, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from models.tiny_dense import make_model
    from ktd.server.engine import Engine
    path = str(make_model("llama", os.path.join(sys.argv[1], "m.gguf"), wtype=sys.argv[3]))
    e = Engine.open(path, n_ctx=32, threads=1, pin=False, allow_repack=sys.argv[5] == "repack")
    ids = e.tokenizer.encode("hello")
    def logits():
        l = e.forward(np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32),
                      np.zeros(len(ids), np.int32), np.ones(len(ids), bool))
        e.free_seq(0)
        return l
    before = logits()
    mapped = any(path in line for line in open("/proc/self/maps"))
    if sys.argv[4] == "truncate":
        os.truncate(path, 64)
    elif sys.argv[4] == "overwrite":  # rewritten in place: same inode, other bytes, then shorter
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
            f.truncate(size // 3)
    else:  # replaced by a new file under the same name (a package upgrade)
        shutil.copy(path, path + ".new")
        os.truncate(path + ".new", 64)
        os.replace(path + ".new", path)
    after = logits()
    print("mapped" if mapped else "unmapped",
          "identical" if np.array_equal(before, after) and np.isfinite(after).all() else "changed")
""")


def _after_the_file_changes(tmp_path, wtype: str, how: str, repack: bool = True) -> subprocess.CompletedProcess:
    here = str(TESTS)
    return subprocess.run([sys.executable, "-c", _FILE_CHANGES, str(tmp_path), here, wtype, how,
                           "repack" if repack else "plain"], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_a_model_file_replaced_by_rename_while_serving_changes_nothing(tmp_path, wtype):
    p = _after_the_file_changes(tmp_path, wtype, "replace")
    assert p.returncode == 0 and p.stdout.split() == ["unmapped", "identical"], p.stderr[-2000:]


# F32 and (without repacking) Q8_0 matrices are copied into the arena as they are; Q8_0 with
# repacking is repacked; token_embd is copied in every case.
@pytest.mark.parametrize("how", ["truncate", "overwrite"])
@pytest.mark.parametrize("wtype,repack", [("F32", True), ("Q8_0", True), ("Q8_0", False)])
def test_a_model_file_changed_in_place_while_serving_changes_nothing(tmp_path, wtype, repack, how):
    p = _after_the_file_changes(tmp_path, wtype, how, repack)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    assert p.stdout.split() == ["unmapped", "identical"], p.stdout


def test_the_daemon_keeps_answering_the_same_after_its_model_file_is_truncated_and_rewritten(tmp_path):
    """The real daemon on a tiny model: the file truncated in place, then rewritten in place with
    other bytes; greedy answers stay identical and the daemon stays healthy (no SIGBUS)."""
    from ktd.client import Client
    from models.tiny_dense import make_model
    model = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    data = model.read_bytes()
    sock = tmp_path / "ktd.sock"
    proc = _serve_real(model, sock)
    try:
        assert wait_for(lambda: sock.exists() or proc.poll() is not None, 60)
        with Client(str(sock), timeout=30) as c:
            assert wait_for(lambda: c.health()["status"] == "ok", 30)
            ask = lambda: c.generate("hello there", max_tokens=8, ignore_eos=True, temperature=0)["text"]  # noqa: E731
            first = ask()
            os.truncate(model, 100)
            assert ask() == first
            with open(model, "r+b") as f:  # the same inode, other bytes
                f.write(bytes(255 - b for b in data))
            assert ask() == first
            assert c.health()["status"] == "ok"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out


def test_logs_to_a_full_disk_do_not_stop_the_daemon():
    """stdout/stderr (the journal's stream, or a log file) on a full disk: every log write fails
    with ENOSPC; requests are still served and SIGTERM still stops the daemon cleanly."""
    d = DaemonProcess()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KTD_", "NOTIFY_SOCKET", "LISTEN_",
                                                                    "WATCHDOG_", "JOURNAL_STREAM"))}
    try:
        with open("/dev/full", "wb") as full:
            d.proc = subprocess.Popen(d.command(), stdout=full, stderr=subprocess.STDOUT, env=env)
        d.wait_ready()
        with d.client() as c:
            assert c.generate("disk full", max_tokens=4, ignore_eos=True)["finish_reason"] == "length"
            assert c.tokenize("abc", add_special=False) == [97, 98, 99]
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
        shutil.rmtree(d.dir, ignore_errors=True)


def _hugepages_free() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["HugePages_Free"].split()[0]) - int(info["HugePages_Rsvd"].split()[0])


def _serve_real(model, sock, **env) -> subprocess.Popen:
    env = dict(os.environ, KTD_MODEL__PATH=str(model), KTD_MODEL__N_CTX="64", KTD_MODEL__THREADS="1",
               KTD_SERVER__SOCKET_GROUP="null", **env)
    return subprocess.Popen([sys.executable, "-m", "ktd", "serve", "--socket", str(sock)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_enomem_from_the_huge_page_pool_at_load_falls_back_with_a_log_line(tmp_path):
    """The arena's mmap(MAP_HUGETLB) fails with ENOMEM when the pool lacks pages: hugepages auto
    loads on other pages and logs why; hugepages hugetlb (required) is a one-line startup error."""
    if _hugepages_free() > 0:
        pytest.skip("the huge page pool has free pages: MAP_HUGETLB would not fail here")
    from ktd.client import Client
    from models.tiny_dense import make_model
    model = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    sock = tmp_path / "ktd.sock"
    proc = _serve_real(model, sock, KTD_MODEL__HUGEPAGES="auto")
    try:
        assert wait_for(lambda: sock.exists() or proc.poll() is not None, 60)
        with Client(str(sock), timeout=30) as c:
            assert wait_for(lambda: c.health()["status"] == "ok", 30)
            assert c.generate("hi", max_tokens=2, ignore_eos=True)["finish_reason"] == "length"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "weights memory (hugepages: auto)" in out and "Cannot allocate memory" in out, out
    proc = _serve_real(model, tmp_path / "ktd2.sock", KTD_MODEL__HUGEPAGES="hugetlb")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1 and "cannot load the model" in out and "Traceback" not in out, out
