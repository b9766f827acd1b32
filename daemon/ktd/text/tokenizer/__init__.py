"""Tokenizer built from GGUF metadata, matching llama.cpp's tokenization token for token.

Supported vocabularies: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE with the pre-tokenizers
of ktd.text.tokenizer.pretokenize: gpt-2, llama3/llama-bpe, qwen2 families, deepseek-llm, deepseek-coder,
deepseek-v3) and ``"llama"``
(SentencePiece BPE by score with ``<0xXX>`` byte fallback). Anything else is a TokenizerError.

Text is ``str``. A Python str always encodes to valid UTF-8 except for lone surrogates (which e.g.
JSON ``"\\ud800"`` escapes can produce); each lone surrogate is tokenized as U+FFFD, which is what
llama.cpp does with an invalid UTF-8 byte in BPE vocabularies. Callers holding raw bytes decode
them with ``errors="replace"`` first.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ktd import GGUFError
from ktd.text.chat import ChatTemplateError, RenderLimits, builtin_template, render_chat_template
from ktd.text.tokenizer.metadata import GGUFMetadataError, _read_tokenizer_metadata
from ktd.text.tokenizer.models import BYTE_DECODER, BytePairEncoder, SentencePieceEncoder, TokenizerError
from ktd.text.tokenizer.pretokenize import PRE_TYPES

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "TokenizerMetadataError", "ChatTemplateError"]


def _decode_all(raw: list[bytes]) -> list[str]:
    """Each bytes decoded (UTF-8, surrogateescape). One decode of the newline-joined list when no
    item holds a newline byte (the same strings: a newline ends any incomplete sequence before it,
    and surrogateescape escapes each invalid byte on its own), else one by one."""
    if not raw:
        return []
    joined = b"\n".join(raw)
    if joined.count(b"\n") == len(raw) - 1:
        return joined.decode("utf-8", errors="surrogateescape").split("\n")
    return [b.decode("utf-8", errors="surrogateescape") for b in raw]


class TokenizerMetadataError(TokenizerError, GGUFError):
    """The model file's tokenizer metadata is malformed or unsupported: a GGUFError, like every
    other reason a model file cannot be loaded."""

# tokenizer.ggml.token_type values (gguf-py TokenType / llama.h llama_token_type)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6

# Token attributes (bit set, as llama.cpp's llama_token_attr; a token can gain CONTROL below).
ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL = 0x0, 0x1, 0x2, 0x4
ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 0x8, 0x10, 0x20
_TYPE_TO_ATTR = {
    TOKEN_TYPE_NORMAL: ATTR_NORMAL, TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL, TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED, TOKEN_TYPE_BYTE: ATTR_BYTE,
}

# Token texts that llama.cpp (llama_vocab::impl::load) treats as end-of-generation and forces to
# CONTROL, because converters do not always mark them: the metadata has no per-token EOG flag.
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])
# Fill-in-the-middle tokens llama.cpp detects by text (forced CONTROL); pad/repo/sep also end
# generation. key -> (metadata key of the explicit id, texts, ends generation)
_FIM_TEXTS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
            "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"), False),
    "suf": ("tokenizer.ggml.fim_suf_token_id", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
            "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"), False),
    "mid": ("tokenizer.ggml.fim_mid_token_id", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
            "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"), False),
    "pad": ("tokenizer.ggml.fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
            "[PAD]"), True),
    "rep": ("tokenizer.ggml.fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
            "<REPO>", "<reponame>"), True),
    "sep": ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",), True),
}
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")

_SPM_SPACE = "\u2581"  # SentencePiece's escaped space
# Unicode noncharacters (never assigned, "for internal use"): encode_chat's escape candidates.
_ESCAPE_MARKS = tuple(chr(c) for c in range(0xFDD0, 0xFDF0))
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class StreamDecoder:
    """Incremental detokenizer: ``feed(id)`` returns only complete UTF-8 text.

    A character split across tokens is held back until its last byte arrives; a byte sequence
    that can no longer become valid UTF-8 is emitted as U+FFFD. The concatenation of all
    ``feed`` results and ``flush()`` equals ``Tokenizer.decode`` of the same ids.
    """

    def __init__(self, tokenizer: "Tokenizer"):
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(id))

    def flush(self) -> str:
        """Return the held-back tail (incomplete sequences become U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class _Metadata:
    """Typed reads of a tokenizer's GGUF metadata; each error names the key and ``source``."""

    def __init__(self, meta: dict, source: str):
        self.meta, self.source = meta, source
        self.n_vocab = 0  # set once the tokens are read (token_id checks against it)

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise TokenizerError(f"{self.source}: missing tokenizer metadata key {key!r}")
        return self.meta[key]

    def fail(self, key: str, expected: str) -> TokenizerError:
        return TokenizerError(f"{self.source}: {key} must be {expected}")

    def flag(self, key: str, default: bool) -> bool:
        v = self.meta.get(key, default)
        if not isinstance(v, (bool, int)):  # an array, a string
            raise self.fail(key, "a boolean")
        return bool(v)

    def numbers(self, key: str, kinds: str, expected: str) -> np.ndarray | None:
        """A 1-D array of a numpy dtype kind in ``kinds`` (``iu``: integers, ``fiu``: numbers), or None."""
        v = self.meta.get(key)
        if v is not None and not (isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in kinds):
            raise self.fail(key, expected)
        return v

    def token_id(self, key: str, default: int | None) -> int | None:
        """A token id; a missing or out-of-range one falls back to the vocabulary type's default,
        like llama.cpp (which warns)."""
        n = self.n_vocab
        v = self.meta.get(key)
        if isinstance(v, int) and 0 <= v < n:
            return v
        return default if default is not None and 0 <= default < n else None


class Tokenizer:
    """A model's tokenizer: text <-> token ids exactly as llama.cpp tokenizes the same GGUF.

    Build it with ``Tokenizer.from_gguf(path)`` (or from a metadata dict as returned by
    ``_read_tokenizer_metadata``). ``eos_ids`` is llama.cpp's end-of-generation set: the
    eos/eot/eom ids of the metadata plus the turn/end tokens it recognises by text
    (``<|im_end|>``, ``<end_of_turn>``, ``<|endoftext|>``, FIM pad/repo/file-separator, ...).
    """

    n_vocab: int
    bos_id: int | None
    eos_ids: frozenset[int]
    add_bos: bool
    chat_template: str | None
    fim_ids: dict[str, int]          # fill-in-the-middle tokens by role: pre, suf, mid, pad, rep, sep

    def __init__(self, meta: dict, source: str = "<metadata>"):
        m = _Metadata(meta, source)
        model = m.need("tokenizer.ggml.model")
        self._read_vocabulary(m)
        self.model = model
        add_bos, bos_default, eos_default = self._make_encoder(m, model)
        self._read_token_ids(m, model, add_bos, bos_default, eos_default)
        self.eos_ids = frozenset(self._find_end_and_fim_tokens(m))
        self._index_special_tokens()

    def _read_vocabulary(self, m: "_Metadata") -> None:
        """The token texts (n_vocab of them), text → id, each token's attributes (from its type)
        and the architecture name."""
        raw_tokens = m.need("tokenizer.ggml.tokens")
        if not isinstance(raw_tokens, list) or not raw_tokens:
            raise TokenizerError(f"{m.source}: tokenizer.ggml.tokens must be a non-empty string array")
        n = len(raw_tokens)
        self.n_vocab = m.n_vocab = n
        arch = m.meta.get("general.architecture")
        if arch is not None and not (isinstance(arch, str) and not _LONE_SURROGATE.search(arch)):
            raise m.fail("general.architecture", "a UTF-8 string")
        self.architecture = arch

        types = m.numbers("tokenizer.ggml.token_type", "iu", "an integer array")
        if types is not None and len(types) < n:
            raise TokenizerError(f"{m.source}: tokenizer.ggml.token_type has {len(types)} entries "
                                 f"for {n} tokens")
        try:
            texts = _decode_all(raw_tokens)
        except (AttributeError, TypeError) as e:
            raise TokenizerError(f"{m.source}: tokenizer.ggml.tokens must be a string array") from e
        if b"" in raw_tokens:
            for i, b in enumerate(raw_tokens):
                if not b:
                    texts[i] = f"[EMPTY_{i}]"
        self._texts = texts
        # A duplicate text maps to its last id, as in llama.cpp.
        self._token_to_id = dict(zip(texts, range(n)))
        if types is None:
            self._attrs = [ATTR_NORMAL] * n
            return
        tv = types[:n].astype(np.int64)
        if tv.min() < 0 or tv.max() > max(_TYPE_TO_ATTR):
            raise m.fail("tokenizer.ggml.token_type", f"token types in [0, {max(_TYPE_TO_ATTR)}]")
        table = np.zeros(max(_TYPE_TO_ATTR) + 1, dtype=np.int64)  # 0: undefined
        for t, a in _TYPE_TO_ATTR.items():
            table[t] = a
        self._attrs = table[tv].tolist()

    def _make_encoder(self, m: "_Metadata", model: str) -> tuple[bool, int | None, int | None]:
        """The subword encoder of the vocabulary type (byte-level BPE or SentencePiece) and the
        type's defaults (llama_vocab::impl::load): (add_bos, bos id, eos id)."""
        if model == "gpt2":
            pre = m.meta.get("tokenizer.ggml.pre") or "default"
            if not isinstance(pre, str):
                raise m.fail("tokenizer.ggml.pre", "a string")
            if pre not in PRE_TYPES:
                raise TokenizerError(f"{m.source}: unsupported pre-tokenizer {pre!r} "
                                     f"(supported: {', '.join(sorted(PRE_TYPES))})")
            split, ignore_merges, add_bos = PRE_TYPES[pre]
            merges = m.meta.get("tokenizer.ggml.merges")
            if not isinstance(merges, list):
                raise TokenizerError(f"{m.source}: gpt2 tokenizer without tokenizer.ggml.merges")
            self._bpe: BytePairEncoder | None = BytePairEncoder(self._token_to_id, merges, ignore_merges, split)
            self._spm: SentencePieceEncoder | None = None
            self.add_space_prefix = False
            self.pre = pre
            return add_bos, None, None
        if model == "llama":
            scores = m.numbers("tokenizer.ggml.scores", "fiu", "a number array")
            if scores is None or len(scores) < self.n_vocab:
                raise TokenizerError(f"{m.source}: llama (SentencePiece) tokenizer needs "
                                     f"tokenizer.ggml.scores for every token")
            self._spm = SentencePieceEncoder(self._token_to_id, scores[:self.n_vocab].tolist(),
                                             m.token_id("tokenizer.ggml.unknown_token_id", 0))
            self._bpe = None
            self.add_space_prefix = True
            self.pre = "default"
            return True, 1, 2
        raise TokenizerError(f"{m.source}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")

    def _read_token_ids(self, m: "_Metadata", model: str, add_bos: bool, bos_default: int | None,
                        eos_default: int | None) -> None:
        """The special token ids and flags of the metadata over the vocabulary type's defaults,
        and the chat template."""
        self.add_space_prefix = m.flag("tokenizer.ggml.add_space_prefix", self.add_space_prefix)
        self.bos_id = m.token_id("tokenizer.ggml.bos_token_id", bos_default)
        self.eos_id = m.token_id("tokenizer.ggml.eos_token_id", eos_default)
        self.eot_id = m.token_id("tokenizer.ggml.eot_token_id", None)
        self.eom_id = m.token_id("tokenizer.ggml.eom_token_id", None)
        self.unk_id = m.token_id("tokenizer.ggml.unknown_token_id", 0 if model == "llama" else None)
        self.pad_id = m.token_id("tokenizer.ggml.padding_token_id", None)
        add_bos = m.flag("tokenizer.ggml.add_bos_token", add_bos)
        self.add_bos = add_bos and self.bos_id is not None
        self.add_eos = m.flag("tokenizer.ggml.add_eos_token", False) and self.eos_id is not None
        tmpl = m.meta.get("tokenizer.chat_template")
        self.chat_template = tmpl if isinstance(tmpl, str) else None

    def _find_end_and_fim_tokens(self, m: "_Metadata") -> set[int]:
        """The end-of-generation ids (returned) and the FIM ids by role (``fim_ids``): from the
        metadata, else recognised by their text as llama.cpp does (and then made control tokens)."""
        token_to_id, attrs = self._token_to_id, self._attrs
        eog: set[int] = set()
        if self.eot_id is None:
            found = sorted(token_to_id[t] for t in _EOT_TEXTS if t in token_to_id)
            if found:
                self.eot_id = found[0]
                attrs[found[0]] |= ATTR_CONTROL
        if self.eom_id is None and "<|eom_id|>" in token_to_id:
            self.eom_id = token_to_id["<|eom_id|>"]
            attrs[self.eom_id] |= ATTR_CONTROL
        self.fim_ids: dict[str, int] = {}
        for role, (key, fim_texts, ends) in _FIM_TEXTS.items():
            fid = m.token_id(key, None)
            if fid is None:
                found = sorted(token_to_id[t] for t in fim_texts if t in token_to_id)
                if found:
                    fid = found[0]
                    attrs[fid] |= ATTR_CONTROL
            if fid is not None:
                self.fim_ids[role] = fid
            if ends and fid is not None:
                eog.add(fid)
        for t in _EOG_TEXTS:
            i = token_to_id.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for i in (self.eos_id, self.eot_id, self.eom_id):
            if i is not None:
                eog.add(i)
        return eog

    def _index_special_tokens(self) -> None:
        """The special tokens split out of the text before subword encoding (USER_DEFINED ones
        always; CONTROL/UNKNOWN only with parse_special) and the byte value of each <0xXX> BYTE
        token."""
        texts = self._texts
        av = np.asarray(self._attrs, dtype=np.int64)
        special = np.flatnonzero(av & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)).tolist()
        self._special_all = _SpecialMatcher({texts[i]: i for i in special})
        always = np.flatnonzero(((av & ATTR_USER_DEFINED) != 0)
                                & ((av & (ATTR_CONTROL | ATTR_UNKNOWN)) == 0)).tolist()
        self._special_user = _SpecialMatcher({texts[i]: i for i in always})
        self._byte_value: dict[int, int] = {}
        for i in np.flatnonzero(av & ATTR_BYTE).tolist():
            t = texts[i]
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                try:
                    self._byte_value[i] = int(t[3:5], 16)
                except ValueError:
                    pass
        self._piece_cache: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer of a model file; a malformed or unsupported one is a
        TokenizerMetadataError (a GGUFError) naming the key."""
        try:
            meta = _read_tokenizer_metadata(path)
            return cls(meta, source=str(path))
        except (GGUFMetadataError, TokenizerError) as e:
            raise TokenizerMetadataError(str(e)) from None

    # ---- encoding -------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; add_special adds BOS/EOS as the model asks (tokenizer.ggml.add_*),
        parse_special matches CONTROL token texts (``<|im_start|>``) in the text as single tokens."""
        return self._encode(text, add_special, parse_special, None)

    def _encode(self, text: str, add_special: bool, parse_special: bool, mark: str | None) -> list[int]:
        # mark: a character escape_specials put into special-token texts so that they are not
        # matched; it is removed from the text fragments before they are encoded.
        if not isinstance(text, str):
            raise TypeError(f"encode() needs str, not {type(text).__name__}")
        if _LONE_SURROGATE.search(text):
            text = _LONE_SURROGATE.sub("\ufffd", text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        matcher = self._special_all if parse_special else self._special_user
        is_prev_special = True  # SPM prefixes a space to the first fragment and after specials
        for frag, special_id in matcher.split(text) if text else ():
            if special_id is not None:
                out.append(special_id)
                is_prev_special = True
                continue
            if mark is not None:
                frag = frag.replace(mark, "")
            if self._spm is not None:
                if self.add_space_prefix and is_prev_special:
                    frag = " " + frag
                self._spm.encode(frag.replace(" ", _SPM_SPACE), out)
            else:
                self._bpe.encode(frag, out)
            is_prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # ---- decoding -------------------------------------------------------------------------

    def token_bytes(self, id: int, *, special: bool = False) -> bytes:
        """The bytes token ``id`` contributes to the text (llama.cpp token_to_piece).

        CONTROL and UNKNOWN tokens contribute nothing unless special=True (then their text);
        USER_DEFINED tokens always contribute their text. Raises IndexError for ids outside the
        vocabulary.
        """
        if not 0 <= id < self.n_vocab:
            raise IndexError(f"token id {id} outside the vocabulary (n_vocab={self.n_vocab})")
        attr = self._attrs[id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            if not special:
                return b""
            return self._texts[id].encode("utf-8", errors="surrogateescape")
        piece = self._piece_cache.get(id)
        if piece is None:
            piece = self._piece(id, attr)
            self._piece_cache[id] = piece
        return piece

    def _piece(self, id: int, attr: int) -> bytes:
        text = self._texts[id]
        if attr & ATTR_USER_DEFINED:
            return text.encode("utf-8", errors="surrogateescape")
        if attr & ATTR_NORMAL:
            if self._spm is not None:
                return text.replace(_SPM_SPACE, " ").encode("utf-8", errors="surrogateescape")
            # byte-level BPE: each codepoint of the token text stands for one byte; a codepoint
            # outside that alphabet (malformed vocabulary) is kept as its UTF-8.
            out = bytearray()
            for c in text:
                b = BYTE_DECODER.get(c)
                if b is None:
                    out += c.encode("utf-8", errors="surrogateescape")
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            b = self._byte_value.get(id)
            return bytes([b]) if b is not None else b""
        return b""  # UNUSED / UNDEFINED tokens have no text

    def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.token_bytes(i, special=special) for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self) -> StreamDecoder:
        return StreamDecoder(self)

    def token_text(self, id: int) -> str:
        """The vocabulary entry of ``id`` as stored (e.g. ``"Ġhello"``, ``"<|im_end|>"``)."""
        if not 0 <= id < self.n_vocab:
            raise IndexError(f"token id {id} outside the vocabulary (n_vocab={self.n_vocab})")
        return self._texts[id]

    def is_control(self, id: int) -> bool:
        return bool(self._attrs[id] & (ATTR_CONTROL | ATTR_UNKNOWN))

    # ---- chat -----------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], *, add_special: bool = True,
                    add_generation_prompt: bool = True, limits: RenderLimits = RenderLimits(),
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the chat: the template's markup becomes control tokens, the messages'
        content is text. A content containing ``<|im_end|>`` (any CONTROL or UNKNOWN token's
        text) gets that text's tokens, never the control token: it cannot forge a turn. The
        special texts in the content are escaped with a character that occurs nowhere in the
        template or the messages and is dropped again before encoding, which also survives
        what templates do with content (trim, concatenation, slicing at other places).
        ``tools`` (OpenAI's tool definitions) are given to the template as ``tools``; every
        string in the messages and the tools (tool calls' arguments, tool results, descriptions)
        is escaped the same way. Raises ChatTemplateError (see ``render_chat``)."""
        template = self._template()
        present = template + json.dumps([messages, tools], ensure_ascii=False, default=str)
        mark = next((c for c in _ESCAPE_MARKS if c not in present), None)
        if mark is None:
            raise ChatTemplateError("the messages use every escape character U+FDD0..U+FDEF")
        escaped = self._escape_all(messages, mark)
        extra = {} if tools is None else {"tools": self._escape_all(tools, mark)}
        text = self.render_chat(escaped, add_generation_prompt=add_generation_prompt, limits=limits, **extra)
        return self._encode(text, add_special, True, mark)

    def _escape_all(self, value: Any, mark: str) -> Any:
        """``value`` with ``_escape_specials`` applied to every string in it (map keys too)."""
        if isinstance(value, str):
            return self._escape_specials(value, mark)
        if isinstance(value, dict):
            return {self._escape_all(k, mark): self._escape_all(v, mark) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._escape_all(v, mark) for v in value]
        return value

    def _escape_specials(self, text: str, mark: str) -> str:
        """``text`` with ``mark`` after the first character of every special-token text that
        only parse_special would match (USER_DEFINED tokens are matched in any text anyway)."""
        parts = []
        for frag, tid in self._special_all.split(text):
            if tid is not None and tid not in self._special_user.ids:
                frag = frag[0] + mark + frag[1:]
            parts.append(frag)
        return "".join(parts)

    def _template(self) -> str:
        template = self.chat_template
        if template is None:
            template = builtin_template(self.architecture)
            if template is None:
                raise ChatTemplateError("the model has no chat template (tokenizer.chat_template)")
        return template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    limits: RenderLimits = RenderLimits(), **extra) -> str:
        """Prompt text for ``messages`` from the model's chat template (ktd.text.chat).

        Raises ChatTemplateError (a ValueError) when the model has no template or the template
        fails. The rendered text contains special-token text, also any the messages wrote: a
        prompt is tokenized with ``encode_chat``, which keeps the two apart.
        """
        return render_chat_template(
            self._template(), messages, limits=limits, add_generation_prompt=add_generation_prompt,
            bos_token=self._texts[self.bos_id] if self.bos_id is not None else "",
            eos_token=self._texts[self.eos_id] if self.eos_id is not None else "",
            **extra,
        )


class _SpecialMatcher:
    """Splits text at occurrences of special-token texts.

    Scanning left to right, at each position the longest special text that starts there wins.
    (llama.cpp partitions per token, longest text first, over the whole text; the two agree
    except for overlapping special texts, which real vocabularies do not have.) Candidates are
    found with a regex over the distinct first characters; a regex alternation of all texts
    would take seconds to compile for 6k+ special tokens.
    """

    def __init__(self, specials: dict[str, int]):
        self.specials = specials
        self.ids = frozenset(specials.values())
        lengths: dict[str, set[int]] = {}
        for t in specials:
            lengths.setdefault(t[0], set()).add(len(t))
        self.lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self.first = re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]") if lengths else None

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """[(raw text, None) | (special text, id)] covering ``text`` in order."""
        if self.first is None:
            return [(text, None)]
        out: list[tuple[str, int | None]] = []
        specials, lengths = self.specials, self.lengths
        start = pos = 0
        search = self.first.search
        while True:
            m = search(text, pos)
            if m is None:
                break
            p = m.start()
            for ln in lengths[text[p]]:
                tid = specials.get(text[p:p + ln])
                if tid is not None:
                    if p > start:
                        out.append((text[start:p], None))
                    out.append((text[p:p + ln], tid))
                    start = pos = p + ln
                    break
            else:
                pos = p + 1
        if start < len(text):
            out.append((text[start:], None))
        return out
