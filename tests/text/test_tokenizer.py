"""Tokenizer fidelity against llama.cpp (llama-cpp-python, installed by `make test` / tools/oracle.sh).

The oracle loads the same GGUF file with vocab_only=True; token ids, pieces and the
end-of-generation set must be identical. Tests that need no oracle (streaming decode, metadata
reader, malformed input) run without it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ktd.text.tokenizer import Tokenizer, TokenizerError
from ktd.text.tokenizer.metadata import GGUFMetadataError, _read_tokenizer_metadata

MODELS = ["qwen2.5-coder-0.5b", "gemma-3-270m"]

CORPUS = [
    "",
    " ",
    "  ",
    "Hello world",
    " Hello world",
    "Hello  world   and    many     spaces",
    "trailing spaces   ",
    "\t\ttabs\tand\n\nnewlines\r\n\r\nCRLF\n",
    "\n\n\n   \n \t \n",
    "   leading",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }  // C++ \u00e9\n",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment\n\n\n",
    "I'm sure you're right, they've said it's what we'd do. HE'LL GO. I'M",
    "1234567890 12 123 1234 12345678901234567890 3.14159 -42 1e10 0x1F",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "emoji \U0001F600\U0001F389\U0001F468\u200d\U0001F469\u200d\U0001F467 flags \U0001F1EF\U0001F1F5 \u2764\ufe0f",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u036b\u0343\u036a\u0302",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|><bos><eos> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "text<|im_end|>more<|im_start|><|im_start|>",
    "<|im_start",
    "\u2581 already escaped \u2581\u2581 spaces",
    "\x00 control \x07 chars \x1b[0m",
    "\ufffd replacement \ufffd\ufffd",
    "a" * 300,
    "=" * 100 + "\n" + "-" * 77,
    "ab" * 50 + " " * 40 + "\n" * 7,
    "\u00a0nbsp\u2003em space\u3000ideographic",
]

LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 40
    + "def f(x):\n\treturn x ** 2  # \u5e73\u65b9\n" * 40
    + "\U0001F600 " * 50
)


def _oracle():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python (the llama.cpp oracle) is not installed: {e}; "
                    "run tools/oracle.sh or make test")
    return llama_cpp


@pytest.fixture(scope="module", params=MODELS)
def model_path(request, real_model):
    return real_model(request.param)


@pytest.fixture(scope="module")
def tok(model_path):
    t0 = time.perf_counter()
    t = Tokenizer.from_gguf(model_path)
    print(f"\n{model_path.name}: tokenizer loaded in {time.perf_counter() - t0:.2f} s, n_vocab={t.n_vocab}")
    return t


@pytest.fixture(scope="module")
def llm(model_path):
    llama_cpp = _oracle()
    return llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)


@pytest.mark.realmodel
@pytest.mark.parametrize("add_special", [True, False])
@pytest.mark.parametrize("parse_special", [False, True])
def test_encode_matches_llama_cpp(tok, llm, add_special, parse_special):
    for text in CORPUS + [LONG_TEXT]:
        want = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        got = tok.encode(text, add_special=add_special, parse_special=parse_special)
        assert got == want, f"text={text[:80]!r}"


@pytest.mark.realmodel
def test_metadata_flags_match_llama_cpp(tok, llm):
    llama_cpp = _oracle()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert tok.n_vocab == llama_cpp.llama_vocab_n_tokens(vocab)
    bos = llama_cpp.llama_vocab_bos(vocab)
    assert tok.bos_id == (bos if bos >= 0 else None)
    assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    eog = np.flatnonzero([llama_cpp.llama_vocab_is_eog(vocab, i) for i in range(tok.n_vocab)])
    assert tok.eos_ids == frozenset(eog.tolist())


@pytest.mark.realmodel
@pytest.mark.parametrize("special", [False, True])
def test_token_bytes_match_llama_cpp(tok, llm, special):
    """Every token's piece, as llama_token_to_piece gives it."""
    import ctypes

    llama_cpp = _oracle()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(256)
    for i in range(tok.n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
        assert n >= 0, f"token {i} piece longer than {len(buf)} bytes"
        assert tok.token_bytes(i, special=special) == buf.raw[:n], f"token {i} {tok.token_text(i)!r}"


def _llama_detokenize(llama_cpp, vocab, ids, special=False) -> bytes:
    """llama.cpp's pieces concatenated (Llama.detokenize does the same with a 32-byte buffer,
    too small for some Gemma tokens)."""
    import ctypes

    buf = ctypes.create_string_buffer(1024)
    out = b""
    for i in ids:
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
        assert n >= 0
        out += buf.raw[:n]
    return out


@pytest.mark.realmodel
@pytest.mark.parametrize("special", [False, True])
def test_decode_round_trip_matches_llama_cpp(tok, llm, special):
    llama_cpp = _oracle()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    for text in CORPUS + [LONG_TEXT]:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        want = _llama_detokenize(llama_cpp, vocab, ids, special).decode("utf-8", errors="replace")
        assert tok.decode(ids, special=special) == want, f"text={text[:80]!r}"
        # Decoding gives the text back exactly (SentencePiece cannot tell a literal U+2581 from
        # an escaped space).
        if tok.model == "gpt2" or "\u2581" not in text:
            assert tok.decode(tok.encode(text, add_special=False)) == text


@pytest.mark.realmodel
def test_invalid_utf8_input(tok, llm):
    """llama.cpp takes bytes; ktd takes str. Invalid input reaches ktd as U+FFFD (bytes decoded
    with errors="replace") or as lone surrogates (JSON escapes), which are tokenized as U+FFFD.
    For byte-level BPE llama.cpp also turns each invalid byte into U+FFFD, so ids agree."""
    for raw in [b"abc\xffdef", b"\x80 start", b"end \xfe", b"mid \xc0 x \xf8\xf9 y"]:
        text = raw.decode("utf-8", errors="replace")
        assert tok.encode(text) == tok.encode(text.replace("\ufffd", "\ud800"))
        if tok.model == "gpt2":
            assert tok.encode(text) == llm.tokenize(raw, add_bos=True, special=False)
        else:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False)


# ---- streaming decode (no oracle needed) ------------------------------------------------------


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte value -> a token whose piece is exactly that one byte."""
    out = {}
    for i in range(tok.n_vocab):
        piece = tok.token_bytes(i)
        if len(piece) == 1:
            out.setdefault(piece[0], i)
    return out


@pytest.mark.realmodel
def test_stream_holds_back_split_characters(tok, byte_ids):
    """A 4-byte emoji spelled as single-byte tokens comes out only when complete."""
    ids = [byte_ids[b] for b in "\U0001F600".encode()]
    d = tok.decode_stream()
    assert [d.feed(i) for i in ids] == ["", "", "", "\U0001F600"]
    assert d.flush() == ""
    d = tok.decode_stream()
    assert d.feed(ids[0]) == "" and d.feed(ids[1]) == ""
    assert d.flush() == "\ufffd"
    assert tok.decode(ids[:2]) == "\ufffd"
    # An invalid continuation is replaced as soon as it cannot complete.
    d = tok.decode_stream()
    assert d.feed(ids[0]) == ""
    assert d.feed(byte_ids[ord("a")]) == "\ufffda"


@pytest.fixture(scope="module")
def byte_token_ids(byte_ids):
    return [i for b, i in byte_ids.items() if b >= 0x80]


@pytest.mark.realmodel
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_decode_property(tok, byte_token_ids, data):
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.n_vocab - 1), st.sampled_from(byte_token_ids)),
                             max_size=40))
    d = tok.decode_stream()
    pieces = [d.feed(i) for i in ids] + [d.flush()]
    for p in pieces:
        p.encode("utf-8")  # strict: no lone surrogates, each piece is valid UTF-8 text
    assert "".join(pieces) == tok.decode(ids)


# ---- loading, metadata reader, bad input (no oracle needed) ----------------------------------


def test_metadata_reader_matches_gguf_py(tmp_path):
    """The metadata reader against a file written by gguf-py's GGUFWriter."""
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<unk>", "<s>", "</s>", "\u2581a", "\u4f60\u597d", "<0x0A>"]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, -1.5, 2.25, -3.0, 4.0, 0.5])
    w.add_token_types([2, 3, 3, 1, 1, 6])
    w.add_bos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages }}")
    w.add_uint32("some.other.key", 7)
    w.add_array("some.other.array", [1, 2, 3])
    w.add_tensor("t", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta = _read_tokenizer_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"] == [t.encode() for t in tokens]
    np.testing.assert_array_equal(meta["tokenizer.ggml.scores"], np.float32([0.0, -1.5, 2.25, -3.0, 4.0, 0.5]))
    np.testing.assert_array_equal(meta["tokenizer.ggml.token_type"], [2, 3, 3, 1, 1, 6])
    assert meta["tokenizer.ggml.bos_token_id"] == 1
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.chat_template"] == "{{ messages }}"
    assert "some.other.key" not in meta

    tok = Tokenizer.from_gguf(path)
    assert tok.n_vocab == 6 and tok.bos_id == 1 and tok.add_bos
    assert tok.encode("a") == [1, 3]
    # The escaped space prefix has no token and no byte tokens here: one <unk>; "\n" is a byte.
    assert tok.encode("\n", add_special=False) == [0, 5]
    assert tok.decode([3, 5]) == " a\n"


@pytest.mark.realmodel
def test_bad_files(tmp_path, model_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_gguf(p)
    p.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(TokenizerError, match="bad magic"):
        Tokenizer.from_gguf(p)
    with open(model_path, "rb") as f:
        head = f.read(200_000)
    p.write_bytes(head)
    with pytest.raises(TokenizerError, match="truncated|past end"):
        Tokenizer.from_gguf(p)
    with pytest.raises(OSError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GGUFMetadataError):
        _read_tokenizer_metadata(tmp_path / "x.gguf")


def test_bad_metadata():
    with pytest.raises(TokenizerError, match="missing tokenizer metadata key"):
        Tokenizer({})
    with pytest.raises(TokenizerError, match="unsupported tokenizer model"):
        Tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": [b"a"]})
    with pytest.raises(TokenizerError, match="unsupported pre-tokenizer 'chameleon'") as e:
        Tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chameleon",
                   "tokenizer.ggml.tokens": [b"a"], "tokenizer.ggml.merges": []})
    assert "deepseek-v3" in str(e.value) and "qwen2" in str(e.value)  # the supported list


@pytest.mark.realmodel
def test_encode_rejects_bytes_and_bad_ids(tok):
    with pytest.raises(TypeError):
        tok.encode(b"abc")
    with pytest.raises(IndexError):
        tok.token_bytes(tok.n_vocab)
    with pytest.raises(IndexError):
        tok.decode([-1])


# Text mixing the character classes the pre-tokenizers distinguish, plus special-token texts.
_FUZZ_PIECES = st.sampled_from([
    " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "'s", "'LL", "'", "a", "Zz", "\u00e9",
    "e\u0301", "\u4f60", "\uac00", "\u0627", "1", "42", "12345", "\u0663", "\u00bd", ".", "!?", "...",
    "==", "->", "{", "}", "_", "#", "\U0001F600", "\u200d", "\ufe0f", "\x00", "\x7f", "\u2581",
    "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<|endoftext|>",
    "<", "|>", "\ufffd",
])
_FUZZ_TEXT = st.one_of(
    st.lists(_FUZZ_PIECES, max_size=30).map("".join),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cn", "Co"]), max_size=40),
)


@pytest.mark.realmodel
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_FUZZ_TEXT, parse_special=st.booleans())
def test_encode_random_text_matches_llama_cpp(tok, llm, text, parse_special):
    want = llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special)
    assert tok.encode(text, parse_special=parse_special) == want


# ---- other pre-tokenizers and SPM options: real vocabularies re-labelled, llama.cpp as the oracle


@pytest.fixture(scope="module", params=["llama-bpe", "gpt-2", "deepseek-v3", "deepseek-llm", "deepseek-coder",
                                        "spm-space-prefix"])
def relabelled(request, real_model, tmp_path_factory):
    """Vocabulary-only GGUFs that re-label a real vocabulary: Qwen2.5's tokens and merges with
    another pre-tokenizer type (the gpt-2 and llama3 word splitters), and Gemma 3's SentencePiece
    vocabulary with add_space_prefix on (the space prefix at the start and after special tokens),
    so these paths are checked against llama.cpp too."""
    import gguf

    llama_cpp = _oracle()
    path = tmp_path_factory.mktemp("vocab") / f"{request.param}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # The hyperparameters llama.cpp requires even for vocab_only (values are irrelevant).
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    if request.param == "spm-space-prefix":
        meta = _read_tokenizer_metadata(real_model("gemma-3-270m"))
        w.add_tokenizer_model("llama")
        w.add_token_scores(meta["tokenizer.ggml.scores"].tolist())
        w.add_add_space_prefix(True)
    else:
        meta = _read_tokenizer_metadata(real_model("qwen2.5-coder-0.5b"))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(request.param)
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = Tokenizer.from_gguf(path)
    if request.param == "spm-space-prefix":
        assert tok.model == "llama" and tok.add_space_prefix
    else:
        assert tok.model == "gpt2" and tok.pre == request.param
    return tok, llm


# Characters the DeepSeek splitters treat specially: CJK/kana runs and their borders, the ASCII
# symbols llama.cpp files under \\p{S} (or, like "~", under neither \\p{P} nor \\p{S}), fullwidth
# punctuation, non-ASCII digits, combining marks, Greek letters at the ends of DeepSeek-LLM's
# letter ranges, astral letters, non-ASCII whitespace.
_DEEPSEEK_CORPUS = [
    "x = a+b-c*d/e^f|g~h`i$j%k&l",
    "~~~ $$ ^^ `code` ||| @user #tag",
    "\u65e5\u672c\u8a9e\u3072\u3089\u304c\u306a\u30ab\u30bf\u30ab\u30ca\u30fc\u4e2d\u6587abc\u4e2d",
    "\uff01\uff1f\uff08\u5168\u89d2\uff09\u3001\u3002\u300c\u300d\u2018q\u2019 \u201cdq\u201d",
    "\u0663\u0664\u0665 \u00bd \u2460 \u0e51\u0e52 1234567 12 123456789012",
    "\u1f7d\u1f7c \u1fbe\u1fd3 \u212a\u2126 \u03ce\u03a9 \U00010400\U00010428 \U0001e900",
    "a\u3000b\u00a0c\u2003d \u3000\u3000 e\u0301\u0308 \u0915\u094d\u0937",
    "\uac00\ub098\ub2e4 \u0800\u0801 \ud7a3\ud7ff",
    "line1\r\nline2\n\n  line3\t\n \n",
]
_INVALID_UTF8 = [b"abc\xffdef", b"\x80 start", b"end \xfe", b"mid \xc0 x \xf8\xf9 y"]


@pytest.mark.realmodel
def test_other_pre_tokenizers_match_llama_cpp(relabelled):
    tok, llm = relabelled
    for text in CORPUS + _DEEPSEEK_CORPUS + [LONG_TEXT]:
        for parse_special in (False, True):
            want = llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special)
            assert tok.encode(text, parse_special=parse_special) == want, f"text={text[:80]!r}"
    if tok.model == "gpt2":  # byte-level BPE: llama.cpp turns each invalid byte into U+FFFD too
        for raw in _INVALID_UTF8:
            assert tok.encode(raw.decode("utf-8", errors="replace")) == llm.tokenize(raw, add_bos=True)


_FUZZ_TEXT_WIDE = st.one_of(
    _FUZZ_TEXT,
    st.lists(st.sampled_from(["~", "$", "+", "^", "`", "|", "@", "a", "Ab", " ", "  ", "\n", "\u3000",
                              "\u3042",
                              "\u30ab", "\u30fc", "\u4e2d", "\u9fa6", "\uac00", "\u0800", "\uff01", "\uff21",
                              "\u2018", "\u3001", "1", "22", "\u0663", "\u00bd", "\u0301", "\u1f7d", "\u212a",
                              "\U00010400", ".", "'s", "\ufffd"]), max_size=30).map("".join),
)


@pytest.mark.realmodel
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_FUZZ_TEXT_WIDE)
def test_other_pre_tokenizers_random_text(relabelled, text):
    tok, llm = relabelled
    assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def _tiny_spm() -> Tokenizer:
    """A SentencePiece vocabulary of all 256 byte tokens plus a few pieces (no model file)."""
    pieces = ["\u2581a", "\u00e9", "\u4f60\u597d", "\U0001F600", "<ctl>", "<usr>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1, 1, 1, 1, 3, 4]
    return Tokenizer({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t.encode() for t in tokens],
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.zeros(len(tokens), dtype=np.float32),
        "tokenizer.ggml.add_space_prefix": False,
    })


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 264), max_size=40))
def test_stream_decode_property_tiny_vocab(ids):
    tok = _tiny_spm()
    d = tok.decode_stream()
    pieces = [d.feed(i) for i in ids] + [d.flush()]
    for p in pieces:
        p.encode("utf-8")
    assert "".join(pieces) == tok.decode(ids)


def test_tiny_vocab_specials_and_byte_fallback():
    tok = _tiny_spm()
    ctl, usr = tok.n_vocab - 2, tok.n_vocab - 1
    # <usr> (USER_DEFINED) is always one token, <ctl> (CONTROL) only with parse_special.
    assert tok.encode("<usr>", add_special=False) == [usr]
    assert tok.encode("<ctl>", add_special=False, parse_special=True) == [ctl]
    assert tok.encode("<ctl>", add_special=False) == [3 + ord(c) for c in "<ctl>"]
    # A character without a piece falls back to its UTF-8 bytes; the text round-trips.
    ids = tok.encode("x\u00e9\u00e8 a", add_special=False)
    assert ids == [3 + 0x78, 259 + 1, 3 + 0xC3, 3 + 0xA8, 259]
    assert tok.decode(ids) == "x\u00e9\u00e8 a"
    assert tok.decode([ctl, usr]) == "<usr>" and tok.decode([ctl], special=True) == "<ctl>"
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == frozenset({2})


# ---- pre-tokenizer boundaries made visible: a vocabulary that merges any short word ----------
#
# A real vocabulary hides most split differences (Qwen's has no multi-digit tokens, so digit
# grouping is invisible). Here every string of up to _MERGE_LEN symbols of a small alphabet is a
# token reachable by merges, so a word of up to _MERGE_LEN symbols becomes exactly one token and a
# split in a different place gives different ids.

_ALPHABET = "0123456789aAb~$+^`|@.!'_ \n\t" + "\u00e9\u00b5\u00bd\u00a0\u0663"
_MERGE_LEN = 3


def _gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte -> printable codepoint table (the byte-level BPE alphabet)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


@pytest.fixture(scope="module",
                params=["deepseek-v3", "deepseek-llm", "deepseek-coder", "qwen2", "llama-bpe"])
def merge_all_vocab(request, tmp_path_factory):
    import itertools

    import gguf

    llama_cpp = _oracle()
    sym = _gpt2_byte_symbols()
    alphabet = sorted({sym[b] for ch in _ALPHABET for b in ch.encode("utf-8")})
    tokens = ["<s>", "</s>"] + sym
    merges = []
    for n in range(2, _MERGE_LEN + 1):  # every split of every n-symbol string, shorter merges first
        for combo in itertools.product(alphabet, repeat=n):
            for cut in range(1, n):
                merges.append("".join(combo[:cut]) + " " + "".join(combo[cut:]))
            tokens.append("".join(combo))
    path = tmp_path_factory.mktemp("vocab") / f"merge-all-{request.param}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(request.param)
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Tokenizer.from_gguf(path), llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.realmodel  # needs the oracle only, but builds a 70k-merge vocabulary
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from(_ALPHABET), max_size=40))
def test_pre_tokenizer_boundaries_match_llama_cpp(merge_all_vocab, text):
    tok, llm = merge_all_vocab
    assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def test_regex_cascade_splits_without_oracle():
    """Splits worked out by hand from llama.cpp's regex lists (llama-vocab.cpp)."""
    from ktd.text.tokenizer.pretokenize import (RegexCascade, split_deepseek3, split_deepseek_coder,
                                           split_deepseek_llm)

    # DeepSeek-V3: digits in groups of three first, then CJK/kana runs, then words (a leading ASCII
    # punctuation joins ASCII letters), punctuation runs and whitespace.
    assert split_deepseek3("x1234567 \u65e5\u672c\u8a9eab a.Net .Net ,,  \n\n y") == [
        "x", "123", "456", "7", " ", "\u65e5\u672c\u8a9e", "ab", " a", ".Net", " .", "Net", " ,,",
        "  \n\n", " y"]
    # DeepSeek-LLM: newlines alone, \\s? + letters, \\s? + ASCII/fullwidth punctuation, CJK runs,
    # digit runs whole (what no regex matches stays one piece: the "  " before the digits).
    assert split_deepseek_llm("a\nb  12345!? \u4e2d\u6587") == [
        "a", "\n", "b", "  ", "12345", "!?", " ", "\u4e2d\u6587"]
    # DeepSeek-Coder: single digits.
    assert split_deepseek_coder("ab12, x") == ["ab", "1", "2", ",", " x"]
    # Non-ASCII whitespace is \s; "~" is a symbol.
    assert split_deepseek3("a\u3000b ~~c") == ["a", "\u3000b", " ~~", "c"]
    with pytest.raises(ValueError, match="unicode categories and non-ASCII"):
        RegexCascade(["\\p{L}\u00e9"])
