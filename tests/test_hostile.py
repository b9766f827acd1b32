"""Hostile input (issue 19): what an attacker or an unlucky operator sends, one regression test
per finding. Daemon-level tests run the real daemon process with the fake engine
(tests/daemon_helpers.py); tokenizer and loader tests use generated tiny models."""

from __future__ import annotations

import tracemalloc

import pytest

from ktd import protocol

# 1,000 nested array32 headers, each claiming 8,192 elements: 5 KB on the wire.
NESTED_HEADERS = b"\xdd\x00\x00\x20\x00" * 1000


def test_a_partial_frame_of_nested_headers_costs_about_its_bytes():
    """msgpack preallocates a list for every array header it sees; a frame that never completes
    must not hold the lists its headers claim (finding 1: ~66 MB for a 5 KB frame)."""
    tracemalloc.start()
    try:
        d = protocol.FrameDecoder(1 << 20)
        before = tracemalloc.get_traced_memory()[0]
        assert list(d.feed(NESTED_HEADERS)) == []
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert d.partial
    assert held < 256 * 1024, f"{held} bytes held for a {len(NESTED_HEADERS)}-byte partial frame"


def test_the_decoder_still_yields_what_msgpack_decodes():
    values = [[0, 1, "health", []], [0, 2, "tokenize", [{"text": "é" * 300}]], {"a": [1, 2.5, None]},
              [[[[]]]], b"\x00\xff", -5, "x"]
    wire = b"".join(protocol.pack(v) for v in values)
    d = protocol.FrameDecoder(4096)
    out = [v for i in range(0, len(wire), 7) for v in d.feed(wire[i:i + 7])]
    assert out == values and not d.partial


@pytest.mark.parametrize("wire", [b"\x91" * 1000 + b"\xc0", b"\x92" + b"\x91" * 999 + b"\xc0\x00",
                                  b"\x94\x00\x01" + b"\x91" * 900 + b"\xc0\x90",
                                  b"\x94\x00\x01\xa6health" + b"\x91" * 900 + b"\x90"])
def test_deeply_nested_messages_get_a_typed_error(wire):
    """Finding 7: the error message quoted the message type's repr, which recursed 1,000 levels
    deep (RecursionError out of dispatch, connection dropped with no answer)."""
    (value,) = list(protocol.FrameDecoder(1 << 20).feed(wire))
    with pytest.raises((protocol.BadRequest, protocol.TooLarge)):
        protocol.parse_request(value, protocol.Limits())
