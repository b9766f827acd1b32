"""The real daemon process (ktd serve + fake engine) over its real Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading

import msgpack
import pytest

import fake_engine
from daemon_helpers import DaemonProcess, reply_as_uid, wait_for
from ktd.server import protocol
from ktd.client import AsyncClient, Busy, Cancelled, Client, ContextOverflow, NotFound, BadRequest


def expected_greedy(prompt: str, max_tokens: int) -> tuple[str, str]:
    tok = fake_engine.ByteTokenizer()
    out = fake_engine.reference_greedy(tok.encode(prompt), max_tokens)
    finish = "stop" if out[-1] in tok.eos_ids else "length"
    text = tok.decode([t for t in out if t not in tok.eos_ids])
    return text, finish


# the module's daemon (conftest)
DAEMON = dict(fake={"step_delay_s": 0.002}, model={"n_ctx": 256, "n_seq_max": 8}, server={"max_queue": 64})


def test_32_concurrent_streaming_clients_get_their_own_greedy_text(daemon):
    prompts = [f"client {i} says: " + "xyz"[: i % 4] for i in range(32)]

    async def one(prompt):
        async with await AsyncClient.connect(daemon.socket, timeout=60) as c:
            s = await c.stream(prompt, temperature=0, max_tokens=24)
            pieces = [p async for p in s]
            return "".join(pieces), s.result

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    for prompt, (text, result) in zip(prompts, results):
        want_text, want_finish = expected_greedy(prompt, 24)
        assert text == want_text
        assert result["finish_reason"] == want_finish
        assert result["usage"]["prompt_tokens"] == len(prompt.encode()) + 1
    with daemon.client() as c:
        st = c.status()["scheduler"]
        assert st["slots_in_use"] == 0 and st["queued"] == 0
        # 32 requests x up to 24 tokens through 8 slots: batching means far fewer steps than tokens
        assert "ktd_generated_tokens_total" in c.metrics()


def test_non_streaming_generate_chat_and_tokens(daemon):
    with daemon.client() as c:
        r = c.generate("hello", temperature=0, max_tokens=16)
        assert (r["text"], r["finish_reason"]) == expected_greedy("hello", 16)
        r = c.generate(messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=8)
        tok = fake_engine.ByteTokenizer()
        rendered = tok.render_chat([{"role": "user", "content": "hi"}])
        assert r["usage"]["prompt_tokens"] == len(tok.encode(rendered, parse_special=True))
        with pytest.raises(BadRequest, match="unsupported role"):
            c.generate(messages=[{"role": "robot", "content": "hi"}])
        assert c.tokenize("ab") == [fake_engine.BOS, 97, 98]
        assert c.tokenize("<|im_end|>", add_special=False, parse_special=True) == [fake_engine.IM_END]
        assert c.detokenize([104, 105, 0xE2]) == "hi\ufffd"
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            c.detokenize([100000])
        r = c.generate(tokens=[fake_engine.BOS, 104], temperature=0, max_tokens=4)
        assert r["usage"]["prompt_tokens"] == 2
        h = c.hello()
        assert h["protocol"] == protocol.PROTOCOL_VERSION and h["n_ctx"] == 256


def test_fim_on_a_model_without_fim_tokens_is_a_bad_request(daemon):
    with daemon.client() as c:
        assert c.hello()["fim"] is None
        with pytest.raises(BadRequest, match="suffix .*fill-in-the-middle.* this model has none"):
            c.generate("def f(", suffix=")", max_tokens=4)
        r = c.generate("hello", temperature=0, max_tokens=8)  # the connection goes on
        assert (r["text"], r["finish_reason"]) == expected_greedy("hello", 8)


def test_same_seed_same_text(daemon):
    with daemon.client() as c:
        a = c.generate("seeded", seed=42, temperature=1.0, max_tokens=20, ignore_eos=True)["text"]
        b = c.generate("seeded", seed=42, temperature=1.0, max_tokens=20, ignore_eos=True)["text"]
        assert a == b


def test_cancel_ends_the_stream_and_frees_the_slot(daemon):
    with daemon.client() as c:
        s = c.stream("cancel me", max_tokens=200, ignore_eos=True, temperature=0)
        it = iter(s)
        for _ in range(3):
            next(it)
        s.cancel()
        with pytest.raises(Cancelled):
            for _ in it:
                pass
        with pytest.raises(NotFound):
            c.cancel(9999)
        assert wait_for(lambda: c.status()["scheduler"]["slots_in_use"] == 0)


def test_disconnect_mid_stream_frees_the_slot():
    with DaemonProcess(fake={"step_delay_s": 0.02}, model={"n_seq_max": 2}) as d:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(d.socket)
        raw.sendall(protocol.pack([0, 1, "generate", [{"prompt": "x", "max_tokens": 200,
                                                         "ignore_eos": True}]]))
        unpacker = msgpack.Unpacker(raw=False)
        while True:
            unpacker.feed(raw.recv(4096))
            msgs = list(unpacker)
            if any(m[0] == 2 for m in msgs):
                break
        with d.client() as c:
            assert c.status()["scheduler"]["slots_in_use"] == 1
            raw.close()
            assert wait_for(lambda: c.status()["scheduler"]["slots_in_use"] == 0, timeout=5)
            assert "client disconnected" in d.log() or "cancelled 1 requests" in d.log()
            metrics = c.metrics()
            assert 'ktd_generate_finished_total{reason="cancelled"} 1' in metrics


def test_busy_when_slots_and_queue_are_full():
    with DaemonProcess(fake={"step_delay_s": 0.05}, model={"n_seq_max": 1}, server={"max_queue": 1}) as d:
        clients = [d.client() for _ in range(3)]
        try:
            first = clients[0].stream("a", max_tokens=100, ignore_eos=True)
            second = clients[1].stream("b", max_tokens=100, ignore_eos=True)
            next(iter(first))  # the first one runs
            with d.client() as c:  # the second one waits in the queue
                assert wait_for(lambda: c.status()["scheduler"]["queued"] == 1)
            with pytest.raises(Busy, match="slots busy"):
                clients[2].generate("c", max_tokens=5)
            for s in (first, second):
                s.cancel()  # the cancel is acknowledged at once; the stream ends at the next step
                with pytest.raises(Cancelled):
                    s.text()
            assert clients[2].generate("c", max_tokens=3, ignore_eos=True)["finish_reason"] == "length"
        finally:
            for c in clients:
                c.close()


def test_context_overflow_and_size_limits():
    with DaemonProcess(model={"n_ctx": 64}, limits={"max_tokens": 100, "max_prompt_tokens": 100}) as d:
        with d.client() as c:
            with pytest.raises(ContextOverflow, match="exceed n_ctx 64"):
                c.generate("0123456789", max_tokens=60)
            with pytest.raises(ContextOverflow, match="no room"):
                c.generate(tokens=[65] * 64)
            with pytest.raises(protocol.TooLarge):
                c.generate("x" * 110)
            with pytest.raises(protocol.TooLarge):
                c.generate("x", max_tokens=101)
            r = c.generate("0123456789", ignore_eos=True)  # no max_tokens: until n_ctx is full
            assert r["finish_reason"] == "length"
            assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 64


def test_deadline_cancels():
    with DaemonProcess(fake={"step_delay_s": 0.02}, server={"request_deadline_s": 0.3}) as d:
        with d.client() as c:
            with pytest.raises(Cancelled, match="deadline"):
                c.generate("slow", max_tokens=200, ignore_eos=True)
            with pytest.raises(Cancelled, match="deadline"):
                c.generate("slow", max_tokens=200, ignore_eos=True, deadline_s=0.1)
            assert c.health()["status"] == "ok"


@contextlib.contextmanager
def _daemon_at_its_connection_limit():
    """A daemon with server.max_connections 2 and both taken (by two clients that have been
    answered), so the next connection is refused."""
    with DaemonProcess(server={"max_connections": 2}) as d:
        a, b = d.client(), d.client()
        try:
            a.health(), b.health()
            yield d
        finally:
            a.close()
            b.close()


def test_connection_limit():
    with _daemon_at_its_connection_limit() as d:
        with d.client() as c, pytest.raises(Busy, match="too many connections"):
            c.health()


def test_connection_limit_refusal_read_after_the_daemon_closed():
    # The request is sent only after the daemon has answered the refused connection and closed
    # it: the send fails (EPIPE), and the client still raises the daemon's error, not the pipe's.
    with _daemon_at_its_connection_limit() as d:
        with d.client() as c:
            c._sock.settimeout(10)
            received = b""
            while chunk := c._sock.recv(65536):  # the notification, then the daemon's close
                received += chunk
            assert received
            c._unpacker.feed(received)  # as the client would have read it
            with pytest.raises(Busy, match="too many connections"):
                c.health()


def test_async_connection_limit_refusal_read_after_the_daemon_closed():
    # AsyncClient's twin of the test above: the request is written before the read loop has run,
    # to a connection the daemon has already answered and closed (POLLRDHUP: its close arrived).
    # The write fails (EPIPE) and the transport stops reading; the client still raises the
    # daemon's error, not the pipe's, and stays closed with it.
    with _daemon_at_its_connection_limit() as d:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(d.socket)
        poll = select.poll()
        poll.register(sock, select.POLLRDHUP)
        assert poll.poll(10_000), "the daemon did not close the refused connection"

        async def refused() -> None:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            c = AsyncClient(reader, writer, d.socket, 10.0)
            try:
                with pytest.raises(Busy, match="too many connections"):
                    await c.health()
                assert c.closed
                with pytest.raises(Busy, match="too many connections"):
                    await c.health()
            finally:
                await c.close()

        asyncio.run(refused())


def test_unauthorized_peer_is_refused_and_logged():
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as uid 65534")
    with DaemonProcess(server={"socket_mode": 0o666, "allowed_uids": [0], "allowed_gids": []}) as d:
        reply = reply_as_uid(65534, d.socket, protocol.pack([0, 7, "health", []]))
        msgs = _unpack_all(reply)
        assert msgs and msgs[0][:2] == [1, 7]
        assert msgs[0][2]["code"] == "unauthorized"
        assert "refused peer" in d.log() and "uid=65534" in d.log()
        with d.client() as c:
            assert c.health()["status"] == "ok"
    with DaemonProcess(server={"socket_mode": 0o666, "allowed_uids": [0, 65534]}) as d:
        reply = reply_as_uid(65534, d.socket, protocol.pack([0, 7, "health", []]))
        assert list(_unpack_all(reply))[0] == [1, 7, None, {"status": "ok"}]


def _unpack_all(data: bytes):
    u = msgpack.Unpacker(raw=False)
    u.feed(data)
    return list(u)


def test_pipelined_flood_is_answered_in_full(daemon):
    """Thousands of requests written at once: backpressure, every one answered, others unaffected."""
    n = 3000
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(daemon.socket)
    payload = b"".join(protocol.pack([0, i, "health", []]) for i in range(n))
    sender = threading.Thread(target=raw.sendall, args=(payload,))
    sender.start()
    unpacker = msgpack.Unpacker(raw=False)
    ids = set()
    with daemon.client() as other:
        while len(ids) < n:
            unpacker.feed(raw.recv(65536))
            ids.update(m[1] for m in unpacker if m[0] == 1 and m[2] is None)
        assert other.health()["status"] == "ok"
    sender.join()
    raw.close()
    assert ids == set(range(n))


def test_prefix_cache_through_the_socket_chat_turns_and_opt_out(daemon):
    """A chat re-sent with one more turn starts from the previous turn's KV (usage.cached_tokens,
    status, metrics); the text is the uncached greedy text; cache_prompt false opts out."""
    tok = fake_engine.ByteTokenizer()
    with daemon.client() as c:
        before = c.status()["scheduler"]["prefix_cache"]
        assert before["slots"] == 4  # the default prefix_cache.slots
        messages = [{"role": "user", "content": "prefix cache turn one"}]
        r1 = c.generate(messages=messages, temperature=0, max_tokens=10, ignore_eos=True)
        messages += [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": "and two"}]
        r2 = c.generate(messages=messages, temperature=0, max_tokens=10, ignore_eos=True)
        prompt2 = tok.encode_chat(messages)
        assert r2["text"] == tok.decode(fake_engine.reference_greedy(prompt2, 10, stop_at_eos=False))
        # turn one's prompt and the 9 reply tokens fed back, then <|im_end|> differs from what was sampled
        assert r2["usage"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
        r3 = c.generate(messages=messages, temperature=0, max_tokens=10, ignore_eos=True, cache_prompt=False)
        assert r3["usage"]["cached_tokens"] == 0 and r3["text"] == r2["text"]
        with pytest.raises(BadRequest, match="cache_prompt"):
            c.generate("x", cache_prompt="yes")
        after = c.status()["scheduler"]["prefix_cache"]
        assert after["hits"] >= before["hits"] + 1
        metrics = c.metrics()
        assert f"ktd_prefix_cache_hits_total {after['hits']}" in metrics.splitlines()
        assert "ktd_prefix_cache_bytes" in metrics
