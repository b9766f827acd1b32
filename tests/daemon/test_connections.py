"""ktd.server.connections without a socket: the policy, and a generate stream answering on its events."""

from __future__ import annotations

import asyncio
import io
import os
from collections import Counter

import msgpack

from ktd.ops import config as config_mod
from ktd.server.connections import Connection, Policy, _Stream, loop_delivery
from ktd.errors import Cancelled


def test_policy_from_config_and_the_allow_list():
    cfg = config_mod.load(None, text="server:\n  allowed_uids: [4242]\n  allowed_gids: [77]\n"
                                     "  request_deadline_s: 0\nlimits:\n  max_tokens: 9\n")
    p = Policy.from_config(cfg)
    assert p.limits.max_tokens == 9 and p.limits.max_frame_bytes == cfg.server.max_frame_bytes
    assert p.request_deadline_s is None and p.max_queue == cfg.server.max_queue
    assert p.allowed_uids == {4242, os.getuid()}
    assert p.authorized(4242, 1, frozenset()) and p.authorized(os.getuid(), 1, frozenset())
    assert p.authorized(5, 77, frozenset()) and p.authorized(5, 1, frozenset({77}))
    assert not p.authorized(5, 1, frozenset({2}))


class Writer:
    def __init__(self):
        self.out = bytearray()

    def is_closing(self):
        return False

    def write(self, data):
        self.out += data

    def messages(self):
        return list(msgpack.Unpacker(io.BytesIO(bytes(self.out)), raw=False))


def run_stream(stream_mode: bool, events):
    async def main():
        loop = asyncio.get_running_loop()
        writer = Writer()
        conn = Connection(1, None, writer, (1, os.getuid(), 0, frozenset()))
        conn.active[7] = 99
        counters = Counter()
        ended = loop.create_future()
        sink = _Stream(conn, 7, stream_mode, ended, counters, "r1")
        loop_delivery(loop)([(sink, kind, payload) for kind, payload in events])  # as the engine thread
        await asyncio.wait_for(ended, 5)
        return writer.messages(), conn.active, counters

    return asyncio.run(main())


def test_a_stream_writes_chunks_then_the_response_and_releases_its_msgid():
    done = {"finish_reason": "stop", "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    msgs, active, _ = run_stream(True, [("chunk", "a"), ("chunk", "b"), ("done", dict(done))])
    assert msgs == [[2, "generate.chunk", [7, 0, "a"]], [2, "generate.chunk", [7, 1, "b"]], [1, 7, None, done]]
    assert active == {}
    msgs, _, _ = run_stream(False, [("chunk", "a"), ("chunk", "b"), ("done", dict(done))])
    assert msgs == [[1, 7, None, {**done, "text": "ab"}]]


def test_a_stream_answers_an_error_once_and_counts_it():
    msgs, active, counters = run_stream(True, [("chunk", "a"), ("error", Cancelled("bye")),
                                               ("error", Cancelled("again"))])
    assert msgs == [[2, "generate.chunk", [7, 0, "a"]], [1, 7, {"code": "cancelled", "message": "bye"}, None]]
    assert counters == {"errors_cancelled": 1} and active == {}


def test_delivery_after_the_loop_closed_is_dropped():
    loop = asyncio.new_event_loop()
    loop.close()
    loop_delivery(loop)([(lambda kind, payload: None, "chunk", "x")])  # no exception
