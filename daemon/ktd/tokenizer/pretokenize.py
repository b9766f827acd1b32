"""BPE pre-tokenizers: split text into words before byte-level BPE, as llama.cpp does.

llama.cpp does not run the pre-tokenizer regexes through a regex engine for the common
pre-tokenizer types; it uses hand-written scanners (src/unicode.cpp, unicode_regex_split_custom_*)
whose edge-case behaviour is the reference for GGUF models. These are ports of those scanners,
driven by the same codepoint classes (\\p{L}, \\p{N}, \\s as llama.cpp defines whitespace).

The codepoint categories come from Python's ``unicodedata``; llama.cpp ships its own tables, so
codepoints assigned in a newer Unicode version than Python's may be classified differently.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from functools import lru_cache

# Codepoint class bits. PRESENT marks "inside the fragment": llama.cpp returns empty flags (0) past
# the end of the fragment and a non-zero value for every real codepoint (UNDEFINED included).
PRESENT = 0x1
NUMBER = 0x2
LETTER = 0x4
WHITESPACE = 0x8

# llama.cpp's \s set (unicode-data.cpp: unicode_set_whitespace).
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

@lru_cache(maxsize=1 << 16)  # bounded: hostile text may use every codepoint
def cpt_flags(c: str) -> int:
    cat = unicodedata.category(c)
    f = PRESENT
    if cat[0] == "L":
        f |= LETTER
    elif cat[0] == "N":
        f |= NUMBER
    if c in _WHITESPACE:
        f |= WHITESPACE
    return f


def _contraction_len(text: str, pos: int, n: int, fold_case: bool) -> int:
    """Length of 's|'t|'re|'ve|'m|'ll|'d at text[pos] (text[pos] == "'"), 0 if none."""
    if pos + 1 >= n:
        return 0
    c1 = text[pos + 1]
    if fold_case and c1.isascii():
        c1 = c1.lower()
    if c1 in "stmd":
        return 2
    if pos + 2 < n:
        c2 = text[pos + 2]
        if fold_case and c2.isascii():
            c2 = c2.lower()
        if (c1, c2) in (("r", "e"), ("v", "e"), ("l", "l")):
            return 3
    return 0


def split_gpt2(text: str) -> list[str]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    n = len(text)

    def fl(i: int) -> int:
        return cpt_flags(text[i]) if 0 <= i < n else 0

    words: list[str] = []
    pos = 0
    while pos < n:
        start = pos
        c = text[pos]
        f = fl(pos)
        if c == "'":
            k = _contraction_len(text, pos, n, fold_case=False)
            if k:
                pos += k
                words.append(text[start:pos])
                continue
        f2 = fl(pos + 1) if c == " " else f
        if f2 & LETTER:
            pos += c == " "
            while fl(pos) & LETTER:
                pos += 1
        elif f2 & NUMBER:
            pos += c == " "
            while fl(pos) & NUMBER:
                pos += 1
        elif not (f2 & (WHITESPACE | LETTER | NUMBER)) and f2:
            pos += c == " "
            while True:
                g = fl(pos)
                if (g & (WHITESPACE | LETTER | NUMBER)) or not g:
                    break
                pos += 1
        else:
            nws = 0
            while fl(pos + nws) & WHITESPACE:
                nws += 1
            if nws > 1 and pos + nws < n:
                pos += nws - 1  # \s+(?!\S): leave the last space to prefix the next word
            elif nws > 0:
                pos += nws
            else:
                pos += 1
        if pos > start:
            words.append(text[start:pos])
    return words


def _split_llama3_like(text: str, max_digits: int) -> list[str]:
    """(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,max_digits}|
    ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"""
    n = len(text)

    def fl(i: int) -> int:
        return cpt_flags(text[i]) if 0 <= i < n else 0

    words: list[str] = []
    append = words.append
    pos = 0
    while pos < n:
        start = pos
        c = text[pos]
        f = fl(pos)
        if c == "'":
            k = _contraction_len(text, pos, n, fold_case=True)
            if k:
                pos += k
                append(text[start:pos])
                continue
        # [^\r\n\p{L}\p{N}]?\p{L}+
        if not (c == "\r" or c == "\n" or f & NUMBER) and (f & LETTER or fl(pos + 1) & LETTER):
            pos += 1
            while fl(pos) & LETTER:
                pos += 1
            append(text[start:pos])
            continue
        # \p{N}{1,max_digits}: a run of digits is cut into groups of max_digits
        if f & NUMBER:
            ini = pos
            while fl(pos) & NUMBER:
                pos += 1
                if pos - ini >= max_digits:
                    append(text[ini:pos])
                    ini = pos
            if pos > ini:
                append(text[ini:pos])
            continue
        # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        f2 = fl(pos + 1) if c == " " else f
        if not (f2 & (WHITESPACE | LETTER | NUMBER)) and f:
            pos += c == " "
            while True:
                g = fl(pos)
                if (g & (WHITESPACE | LETTER | NUMBER)) or not g:
                    break
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            append(text[start:pos])
            continue
        nws = 0
        last_end_r_or_n = 0
        while fl(pos + nws) & WHITESPACE:
            if text[pos + nws] in "\r\n":
                last_end_r_or_n = pos + nws + 1
            nws += 1
        if last_end_r_or_n > 0:  # \s*[\r\n]+
            pos = last_end_r_or_n
        elif nws > 1 and pos + nws < n:  # \s+(?!\S)
            pos += nws - 1
        elif nws > 0:  # \s+
            pos += nws
        else:  # no match: a single codepoint
            pos += 1
        append(text[start:pos])
    return words


def split_llama3(text: str) -> list[str]:
    return _split_llama3_like(text, 3)


def split_qwen2(text: str) -> list[str]:
    return _split_llama3_like(text, 1)


# tokenizer.ggml.pre -> (splitter, ignore_merges, default add_bos), as in llama-vocab.cpp
# llama_vocab::impl::load. Other pre-tokenizer types are rejected with a clear error.
PRE_TYPES: dict[str, tuple[Callable[[str], list[str]], bool, bool]] = {}
for _name in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
              "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"):
    PRE_TYPES[_name] = (split_gpt2, False, False)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):
    PRE_TYPES[_name] = (split_llama3, True, True)
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"):
    PRE_TYPES[_name] = (split_qwen2, False, False)
