"""Protocol: pure framing/validation, and property tests against a real daemon process.

Every malformed input (random and mutated frames, wrong types, huge integers, deep nesting,
invalid UTF-8, truncated and oversized frames) must get a typed error, and the daemon must keep
serving other clients.
"""

from __future__ import annotations

import socket

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ktd.server import protocol
from ktd.errors import ERRORS, BadRequest, TooLarge

LIMITS = protocol.Limits(max_frame_bytes=65536)


# --- pure -----------------------------------------------------------------------------------

def test_decoder_byte_at_a_time_and_many_per_read():
    frames = [protocol.pack([0, i, "health", []]) for i in range(5)]
    d = protocol.FrameDecoder(1024)
    got = [v for b in b"".join(frames) for v in d.feed(bytes([b]))]
    assert got == [[0, i, "health", []] for i in range(5)]
    # many frames in one read, together larger than the limit, each below it
    big = [protocol.pack([0, i, "tokenize", [{"text": "x" * 600}]]) for i in range(10)]
    d = protocol.FrameDecoder(1024)
    assert len(list(d.feed(b"".join(big)))) == 10
    assert not d.partial


def test_decoder_oversize_and_malformed_lose_framing():
    d = protocol.FrameDecoder(1024)
    with pytest.raises(protocol.FramingError) as e:
        list(d.feed(protocol.pack(["x" * 2000])))
    assert isinstance(e.value.error, TooLarge)
    # a nested message fed in small pieces: the unpacker consumes it incrementally, the bound
    # must still hold for the whole message
    d = protocol.FrameDecoder(1000)
    nested = protocol.pack([[1] * 300] * 10)
    with pytest.raises(protocol.FramingError) as e:
        for i in range(0, len(nested), 100):
            list(d.feed(nested[i:i + 100]))
    assert isinstance(e.value.error, TooLarge)
    with pytest.raises(protocol.FramingError) as e:
        list(protocol.FrameDecoder(1024).feed(b"\xc1"))  # never-used msgpack byte
    assert isinstance(e.value.error, BadRequest)


def test_parse_request_shapes():
    assert protocol.parse_request([0, 3, "health", []], LIMITS) == protocol.Request(3, "health", {})
    assert protocol.parse_request([0, 3, "tokenize", [{"text": "a"}]], LIMITS).params == {"text": "a"}
    bad = [5, [], [1, 2, None, None], [2, "x", []], [0, -1, "health", []], [0, 2**32, "health", []],
           [0, 1, "nope", []], [0, 1, "health", {}], [0, 1, "health", [1]], [0, 1, b"health", []],
           [0, 1, "health", [{}, {}]], [0, True, "health", []], [0.0, 1, "health", []],
           [0, 1, "health", [{"\udcff": 1}]], [0, 1, "health", [{1: 2}]]]
    for v in bad:
        with pytest.raises((BadRequest, TooLarge)):
            protocol.parse_request(v, LIMITS)
    deep: list = []
    for _ in range(30):
        deep = [deep]
    with pytest.raises(TooLarge, match="nesting"):
        protocol.parse_request([0, 1, "tokenize", [{"text": deep}]], LIMITS)
    assert protocol.request_id([0, 9, 1, 2, 3]) == 9 and protocol.request_id([0, -3]) is None


def test_parse_generate_validation():
    g = protocol.parse_generate({"prompt": "hi", "stop": "\n", "seed": 2**64 - 1, "top_k": 0}, LIMITS)
    assert g.stop == ("\n",) and g.sampling.seed == 2**64 - 1 and g.stream
    for params, err, text in [
        ({}, BadRequest, "exactly one of"),
        ({"prompt": "a", "messages": []}, BadRequest, "exactly one of"),
        ({"prompt": 3}, BadRequest, "prompt must be a string"),
        ({"prompt": "a", "max_tokens": 0}, BadRequest, "max_tokens"),
        ({"prompt": "a", "max_tokens": 10**9}, TooLarge, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, BadRequest, "temperature"),
        ({"prompt": "a", "top_p": 2.0}, BadRequest, "top_p"),
        ({"prompt": "a", "seed": 2**64}, BadRequest, "seed"),
        ({"prompt": "a", "stop": [""]}, BadRequest, "stop"),
        ({"prompt": "a", "stop": ["x"] * 17}, TooLarge, "stop strings"),
        ({"prompt": "a", "bogus": 1}, BadRequest, "unknown parameter 'bogus'"),
        ({"messages": [{"role": "user"}]}, BadRequest, "messages[0]"),
        ({"messages": [{"role": "u", "content": "c"}] * 300}, TooLarge, "messages"),
        ({"tokens": [-1]}, BadRequest, "tokens"),
        ({"prompt": "a", "deadline_s": -1}, BadRequest, "deadline_s"),
        ({"prompt": "a", "suffix": 3}, BadRequest, "suffix must be a string"),
        ({"prompt": "a", "suffix": ["b"]}, BadRequest, "suffix must be a string"),
        ({"messages": [{"role": "user", "content": "c"}], "suffix": "b"}, BadRequest, "suffix .* needs prompt"),
        ({"tokens": [1, 2], "suffix": "b"}, BadRequest, "suffix .* needs prompt"),
        ({"suffix": "b"}, BadRequest, "exactly one of"),
    ]:
        with pytest.raises(err, match=text.replace("[", r"\[").replace("]", r"\]")):
            protocol.parse_generate(params, LIMITS)


def test_parse_generate_suffix():
    """Fill-in-the-middle: suffix goes with a text prompt, either of them may be empty; without it
    a request is as before."""
    assert protocol.parse_generate({"prompt": "def f(", "suffix": ")"}, LIMITS).suffix == ")"
    g = protocol.parse_generate({"prompt": "", "suffix": "", "parse_special": True}, LIMITS)
    assert (g.prompt, g.suffix, g.parse_special) == ("", "", True)
    assert protocol.parse_generate({"prompt": "a"}, LIMITS).suffix is None


# --- against the real daemon ----------------------------------------------------------------

DAEMON = dict(server={"max_frame_bytes": 65536}, limits={"max_nesting": 16})  # the module's daemon (conftest)


@pytest.fixture(scope="module")
def watcher(daemon):
    """A long-lived client: checks after each example that other clients are unaffected."""
    c = daemon.client(timeout=10)
    yield c
    c.close()


def exchange(path: str, data: bytes, timeout: float = 10.0) -> list:
    """Send ``data``, shut down writing, read everything until the server closes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close early after an oversized prefix; its answer is still readable
    s.shutdown(socket.SHUT_WR)
    buf = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
    s.close()
    u = msgpack.Unpacker(raw=False, strict_map_key=False)
    u.feed(buf)
    return list(u)


def assert_well_formed(msgs: list, *, need_answer: bool = True) -> None:
    if need_answer:
        assert msgs, "no answer"
    for m in msgs:
        assert isinstance(m, list) and m[0] in (1, 2)
        if m[0] == 2:
            assert m[1] in (protocol.ERROR_NOTIFICATION, protocol.CHUNK)
            if m[1] == protocol.ERROR_NOTIFICATION:
                assert m[2][0]["code"] in ERRORS and m[2][0]["message"]
        elif m[2] is not None:
            assert m[2]["code"] in ERRORS and isinstance(m[2]["message"], str)


def still_serving(watcher) -> None:
    assert watcher.health()["status"] == "ok"


VALID = [protocol.pack(v) for v in (
    [0, 1, "health", []],
    [0, 2, "tokenize", [{"text": "héllo"}]],
    [0, 3, "generate", [{"prompt": "abc", "max_tokens": 3, "stream": True}]],
    [0, 4, "detokenize", [{"tokens": [104, 105]}]],
)]

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.binary(min_size=1, max_size=3000))
def test_random_bytes(daemon, watcher, data):
    assert_well_formed(exchange(daemon.socket, data), need_answer=True)
    still_serving(watcher)


@SETTINGS
@given(st.sampled_from(VALID), st.data())
def test_mutated_frames(daemon, watcher, frame, data):
    b = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "flip" and b:
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            b.insert(i, data.draw(st.integers(0, 255)))
        elif op == "delete" and len(b) > 1:
            del b[i]
        elif op == "truncate" and len(b) > 1:
            del b[i:]
    msgs = exchange(daemon.socket, bytes(b))
    assert_well_formed(msgs, need_answer=bool(b))
    still_serving(watcher)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


@SETTINGS
@given(st.sampled_from(protocol.METHODS + ("nope",)), msgpack_values, st.integers(0, 2**32 - 1))
def test_wrong_types_get_a_response_to_their_msgid(daemon, watcher, method, value, msgid):
    params = [value] if not isinstance(value, list) else value
    if method == "generate" and isinstance(value, dict):
        value.setdefault("max_tokens", 2)  # a random but valid request must stay short
    msgs = exchange(daemon.socket, protocol.pack([0, msgid, method, params]))
    assert_well_formed(msgs)
    responses = [m for m in msgs if m[0] == 1]
    assert len(responses) == 1 and responses[0][1] == msgid
    still_serving(watcher)


@pytest.mark.parametrize("value, code", [
    ([0, 2**64 - 1, "health", []], "bad_request"),
    ([0, -(2**63), "health", []], "bad_request"),
    ([0, 1, "generate", [{"prompt": "a", "max_tokens": 2**64 - 1}]], "too_large"),
    ([0, 1, "generate", [{"prompt": "a", "temperature": float("nan")}]], "bad_request"),
    ([0, 1, "generate", [{"prompt": "a", "top_k": -(2**63)}]], "bad_request"),
    ([0, 1, "detokenize", [{"tokens": [2**64 - 1]}]], "bad_request"),
    ([0, 1, "cancel", [{"id": 2**40}]], "bad_request"),
    ([1, 1, None, None], "bad_request"),
    ([2, "cancel", [1]], "bad_request"),
    ("just a string", "bad_request"),
])
def test_huge_integers_and_wrong_shapes(daemon, watcher, value, code):
    msgs = exchange(daemon.socket, protocol.pack(value))
    assert_well_formed(msgs)
    errors = [m[2] if m[0] == 1 else m[2][0] for m in msgs]
    assert errors[0]["code"] == code
    still_serving(watcher)


@pytest.mark.parametrize("depth", [17, 100, 5000])
def test_deep_nesting(daemon, watcher, depth):
    inner = b"\x91" * depth + b"\x00"
    frame = b"\x94\x00\x05\xa8tokenize\x91\x81\xa4text" + inner  # [0, 5, "tokenize", [{"text": [[...]]}]]
    msgs = exchange(daemon.socket, frame)
    assert_well_formed(msgs)
    err = msgs[0][2] if msgs[0][0] == 1 else msgs[0][2][0]
    assert err["code"] in ("too_large", "bad_request")
    still_serving(watcher)


def test_invalid_utf8_is_answered_and_framing_kept(daemon, watcher):
    bad = b"\x94\x00\x06\xa8tokenize\x91\x81\xa4text\xa3\xff\xfe\xfd"
    msgs = exchange(daemon.socket, bad + protocol.pack([0, 7, "health", []]))
    assert msgs[0][:2] == [1, 6] and msgs[0][2]["code"] == "bad_request" and "UTF-8" in msgs[0][2]["message"]
    assert msgs[1] == [1, 7, None, {"status": "ok"}]  # the same connection keeps working
    still_serving(watcher)


def test_truncated_and_oversized_frames(daemon, watcher):
    frame = protocol.pack([0, 1, "tokenize", [{"text": "x" * 100}]])
    msgs = exchange(daemon.socket, frame[:-10])
    assert msgs == [[2, "error", [{"code": "bad_request", "message": "connection closed inside a message"}]]]
    msgs = exchange(daemon.socket, protocol.pack([0, 1, "tokenize", [{"text": "x" * 70000}]]))
    assert msgs[0][0] == 2 and msgs[0][2][0]["code"] == "too_large"
    still_serving(watcher)


def test_framing_error_closes_only_that_connection(daemon, watcher):
    c = daemon.client()
    s = c.stream("keep going", max_tokens=30, ignore_eos=True)
    first = next(iter(s))
    msgs = exchange(daemon.socket, b"\xc1")
    assert msgs[0][0] == 2 and msgs[0][2][0]["code"] == "bad_request"
    rest = "".join(s)
    assert len(first + rest) > 0 and s.result["finish_reason"] == "length"
    c.close()
    still_serving(watcher)
