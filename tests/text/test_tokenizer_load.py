"""The tokenizer's load-time shortcuts give what the plain code gives: the native string-array
reader (ktd._native.gguf_string_array) against the metadata reader's Python loop, the one-decode
token texts against decoding each token, and the merge ranks keyed by merge text against the
(left, right) pairs of llama.cpp's split rule. (The tokenizer's correctness against llama.cpp is
tests/text/test_tokenizer.py, unchanged.)"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from ktd import _native
from ktd.text.tokenizer import _decode_all
from ktd.text.tokenizer import metadata as M
from ktd.text.tokenizer.models import BytePairEncoder

MODEL = os.path.expanduser("~/.cache/ktd/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def _string_array_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(b)) + b for b in items)


def test_native_string_array_matches_the_python_loop():
    rng = np.random.default_rng(3)
    items = [rng.integers(0, 256, int(n), np.uint8).tobytes() for n in rng.integers(0, 40, 500)] + [b"", b"\n"]
    prefix = b"xyz"
    buf = memoryview(prefix + _string_array_bytes(items) + b"tail")
    out, end = _native.gguf_string_array(buf, len(prefix), len(items))
    assert out == items and all(type(b) is bytes for b in out) and end == len(buf) - 4
    assert _native.gguf_string_array(buf, len(prefix), 0) == ([], len(prefix))
    # Past the end: None (the Python loop then names the byte), never a read out of bounds.
    for cut in (1, 5, 8, 9, len(buf) - 4 - len(prefix) - 1):
        short = memoryview(bytes(buf[:len(prefix) + cut]))
        assert _native.gguf_string_array(short, len(prefix), len(items)) is None
    huge = memoryview(struct.pack("<Q", 1 << 62) + b"abc")
    assert _native.gguf_string_array(huge, 0, 1) is None
    assert _native.gguf_string_array(memoryview(b"\0" * 16), 0, 1 << 40) is None
    assert _native.gguf_string_array(memoryview(b"\0" * 16), 1 << 40, 1) is None


@pytest.mark.skipif(not os.path.exists(MODEL), reason=f"{MODEL} not downloaded (make fetch-models)")
def test_tokenizer_metadata_is_the_same_with_and_without_the_native_reader(monkeypatch):
    fast = M._read_tokenizer_metadata(MODEL)
    monkeypatch.setattr(M, "_native_string_array", None)
    slow = M._read_tokenizer_metadata(MODEL)
    assert fast.keys() == slow.keys()
    for k in fast:
        if isinstance(fast[k], np.ndarray):
            np.testing.assert_array_equal(fast[k], slow[k])
        else:
            assert fast[k] == slow[k], k


def test_a_truncated_string_array_gets_the_python_readers_error(tmp_path, monkeypatch):
    """A vocabulary cut short: the native reader declines, the Python loop says where."""
    body = struct.pack("<Q", 1) + struct.pack("<Q", len(b"tokenizer.ggml.tokens")) + b"tokenizer.ggml.tokens"
    body += struct.pack("<II", 9, 8) + struct.pack("<Q", 3) + _string_array_bytes([b"a", b"bb"])
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQ", 3, 0) + body)
    with pytest.raises(M.GGUFMetadataError) as fast:
        M._read_tokenizer_metadata(path)
    monkeypatch.setattr(M, "_native_string_array", None)
    with pytest.raises(M.GGUFMetadataError) as slow:
        M._read_tokenizer_metadata(path)
    assert str(fast.value) == str(slow.value) and "truncated string array" in str(fast.value)


def test_decode_all_is_decoding_each_token():
    rng = np.random.default_rng(4)
    # Invalid and incomplete UTF-8 (escaped), multi-byte characters, empty tokens.
    pool = [b"\xe4\xb8", b"\xe4\xb8\xad", b"\xff", b"\xed\xa0\x80", b"abc", b"", b"\xc3", b"\xa9", "é".encode()]
    raw = [b"".join(pool[i] for i in rng.integers(0, len(pool), int(n))) for n in rng.integers(0, 5, 3000)]
    want = [b.decode("utf-8", errors="surrogateescape") for b in raw]
    assert _decode_all(raw) == want
    with_newline = raw[:10] + [b"a\nb", b"\n"]  # the one-by-one path
    assert _decode_all(with_newline) == [b.decode("utf-8", errors="surrogateescape") for b in with_newline]
    assert _decode_all([]) == []


def test_merge_ranks_by_text_are_llama_cpp_pairs():
    """rank_of(a, b) against the dictionary of (left, right) pairs that llama.cpp's rule gives
    (split at the first space after position 0, first rank of a repeated merge kept), for every
    pair of the merges and for near misses."""
    merges = [b"a b", b"ab c", b" a b", b"  x", b"a  b", b"nospace", b" lead", b"a b", b"x y z", b"x y", b"",
              b"\xff \xfe", b"q r", "é ü".encode()]
    enc = BytePairEncoder({}, merges, False, lambda t: [t])
    pairs: dict[tuple[str, str], int] = {}
    for rank, m in enumerate(merges):
        s = m.decode("utf-8", errors="surrogateescape")
        sp = s.find(" ", 1)
        pairs.setdefault((s[:sp], s[sp + 1:]) if sp >= 0 else ("", ""), rank)
    for (a, b), rank in pairs.items():
        if a:
            assert enc.rank_of(a, b) == rank, (a, b)
    texts = ["a", "b", "ab", "c", " a", " ", "x", "x y", "y", "z", "y z", " x", "", "no", "space", "nospace", "lead",
             " lead", "\udcff", "\udcfe", "q", "r", "é", "ü"]
    for a in texts:
        for b in texts:
            assert enc.rank_of(a, b) == (pairs.get((a, b)) if a else None), (a, b)
