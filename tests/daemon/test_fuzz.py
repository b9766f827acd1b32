"""The CI slice of the fuzz campaigns (tests/fuzz.py; `make fuzz` runs the full one): 10k hostile
frames against the daemon, 1k mutated model files through the loader, and 3k hostile requests
plus a round of slow and abandoned connections against the HTTP gateway, with fixed seeds, plus
hypothesis properties of the frame decoder and the request validator."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings, strategies as st

import fuzz
from ktd.server import protocol
from ktd.errors import KtdError


def _check(rep: fuzz.Report) -> None:
    print(fuzz.table([rep]))
    assert rep.crashes == 0 and rep.hangs == 0, rep.notes
    assert rep.unanswered == 0 and rep.untyped == 0, rep.notes
    assert fuzz.rss_ok(rep), f"RSS {rep.rss_before} -> {rep.rss_after}, budget +{fuzz.RSS_BUDGET}"


def test_protocol_fuzz_slice():
    rep = fuzz.protocol_campaign(10_000, seed=1)
    assert rep.inputs >= 10_000
    _check(rep)


def test_gateway_fuzz_slice():
    rep = fuzz.gateway_campaign(3_000, fuzz.SLOW_ROUND, seed=1)
    assert rep.inputs >= 3_000 and rep.slow >= fuzz.SLOW_ROUND
    assert rep.server_errors == 0, rep.notes
    _check(rep)


def test_gguf_loader_fuzz_slice():
    rep = fuzz.gguf_campaign(1_000, seed=1)
    assert rep.inputs == 1_000
    _check(rep)


msgpack_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
values = st.recursive(
    st.none() | st.booleans() | msgpack_ints | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | msgpack_ints, inner,
                                                                 max_size=5),
    max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(msgid=st.integers(0, 2**32 - 1), method=st.sampled_from(protocol.METHODS), params=values)
def test_any_request_shape_is_a_request_or_a_typed_error(msgid, method, params):
    wire = msgpack.packb([0, msgid, method, [params]], use_bin_type=True)
    (value,) = list(protocol.FrameDecoder(1 << 20).feed(wire))
    try:
        req = protocol.parse_request(value, protocol.Limits())
    except KtdError:
        return
    try:  # the per-method validators, as the daemon calls them
        {"generate": lambda: protocol.parse_generate(req.params, protocol.Limits()),
         "cancel": lambda: protocol.parse_cancel(req.params),
         "tokenize": lambda: protocol.parse_tokenize(req.params),
         "detokenize": lambda: protocol.parse_detokenize(req.params, 260)}.get(
            method, lambda: protocol.parse_empty(method, req.params))()
    except KtdError:
        pass


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300), cut=st.integers(1, 64))
def test_any_bytes_decode_or_fail_with_a_framing_error(data, cut):
    d = protocol.FrameDecoder(256)
    try:
        for i in range(0, len(data), cut):
            for v in d.feed(data[i:i + cut]):
                try:
                    protocol.parse_request(v, protocol.Limits())
                except KtdError:
                    pass
    except protocol.FramingError:
        pass
