"""BPE pre-tokenizers: split text into words before byte-level BPE, as llama.cpp does.

llama.cpp does not run the pre-tokenizer regexes through a regex engine for the common
pre-tokenizer types; it uses hand-written scanners (src/unicode.cpp, unicode_regex_split_custom_*)
whose edge-case behaviour is the reference for GGUF models. These are ports of those scanners,
driven by the same codepoint classes (\\p{L}, \\p{N}, \\s as llama.cpp defines whitespace).

The other types (the DeepSeek ones) are cascades of regexes that llama.cpp runs through
std::regex (ECMAScript) after "collapsing" the text to one byte per codepoint; RegexCascade
reproduces that mechanism with Python's re, whose semantics agree with ECMAScript on these
patterns (ordered alternation, greedy quantifiers, lookahead).

The codepoint categories come from Python's ``unicodedata``; llama.cpp ships its own tables, so
codepoints assigned in a newer Unicode version than Python's may be classified differently.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
import re
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


# ---- regex cascades (llama.cpp unicode_regex_split, the std::regex fallback) -------------------

# Each \\p{..} class llama.cpp knows -> the category letter; the Lu/Ll/Lt/Lm/Lo subclasses all
# collapse to L (llama.cpp keeps no finer letter classes).
_UCAT = {r"\p{N}": "N", r"\p{L}": "L", r"\p{P}": "P", r"\p{M}": "M", r"\p{S}": "S",
         r"\p{Lu}": "L", r"\p{Ll}": "L", r"\p{Lt}": "L", r"\p{Lm}": "L", r"\p{Lo}": "L"}
# The byte a non-ASCII codepoint of that category collapses to (0xD0 for any other category).
_UCAT_CPT = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER_CPT = "\xd0"
# The ASCII members of each class in the collapsed regex, as llama.cpp (the pinned version; older
# ones left "~" out of \\p{S}) lists them.
_UCAT_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}", "M": "", "S": r"\$\+<->^`\|\~"}
# Non-ASCII whitespace becomes a vertical tab, which \\s matches in both std::regex and re.ASCII.
_WS_STANDIN = "\x0b"


@lru_cache(maxsize=1 << 16)
def _collapsed_cpt(c: str) -> str:
    if c < "\x80":
        return c
    if c in _WHITESPACE:
        return _WS_STANDIN
    return _UCAT_CPT.get(unicodedata.category(c)[0], _OTHER_CPT)


def _collapse_regex(expr: str) -> str:
    """llama.cpp's rewrite of a regex with \\p{..} classes for the collapsed text: each class
    becomes its collapsed byte plus its ASCII members, bracketed unless already inside [...]."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
        elif expr.startswith("\\p{", i):
            close = expr.find("}", i + 3)
            cat = _UCAT.get(expr[i:close + 1]) if 0 <= close <= i + 10 else None
            if cat is not None:
                body = _UCAT_CPT[cat] + _UCAT_ASCII[cat]
                out.append(body if inside else "[" + body + "]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _ecmascript_to_python(expr: str) -> str:
    """The few ECMAScript spellings Python's re reads differently: an unescaped "$" outside a
    class is end of input (re's "$" would also match before a final newline)."""
    out: list[str] = []
    inside = escaped = False
    for c in expr:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c == "$" and not inside:
            out.append(r"\Z")
            continue
        out.append(c)
    return "".join(out)


class RegexCascade:
    """Splits text with a list of regexes applied in turn, as llama.cpp's unicode_regex_split
    does for pre-tokenizers without a hand-written scanner: each regex cuts every current piece
    into its matches and the text between them (both kept). A regex with \\p{..} classes runs on
    the collapsed text (one char per codepoint: ASCII as is, other codepoints by category); one
    without runs on the codepoints with non-ASCII whitespace replaced by a vertical tab. llama.cpp
    rejects a regex mixing \\p{..} with non-ASCII characters; so does this class."""

    def __init__(self, exprs: list[str]):
        self.exprs = list(exprs)
        self._steps: list[tuple[re.Pattern[str], bool]] = []
        for expr in exprs:
            collapsed = any(k in expr for k in _UCAT)
            if collapsed:
                if not expr.isascii():
                    raise ValueError(f"regex mixes unicode categories and non-ASCII characters: {expr!r}")
                expr = _collapse_regex(expr)
            self._steps.append((re.compile(_ecmascript_to_python(expr), re.ASCII), collapsed))

    def __call__(self, text: str) -> list[str]:
        collapsed = wide = ""
        if any(c for _, c in self._steps):
            collapsed = "".join(map(_collapsed_cpt, text))
        if not all(c for _, c in self._steps):
            wide = "".join(_WS_STANDIN if c >= "\x80" and c in _WHITESPACE else c for c in text)
        bounds = [0, len(text)]  # piece i is text[bounds[i]:bounds[i + 1]]
        for pattern, use_collapsed in self._steps:
            subject = collapsed if use_collapsed else wide
            cuts = [0]
            for lo, hi in zip(bounds, bounds[1:]):
                for m in pattern.finditer(subject, lo, hi):
                    if m.start() > cuts[-1]:
                        cuts.append(m.start())
                    cuts.append(m.end())
                if hi > cuts[-1]:
                    cuts.append(hi)
            bounds = cuts
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# llama-vocab.cpp llm_tokenizer_bpe: the regex lists of the DeepSeek pre-tokenizer types, verbatim
# (non-ASCII characters escaped: some of the range ends, e.g. U+1F7D, are not NFC-stable).
DEEPSEEK_LLM_REGEXES = [
    "[\r\n]",
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-'
    '\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5'
    '\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-'
    '\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20'
    '-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc'
    '\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6'
    '-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-'
    '\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-'
    '\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-'
    '\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-'
    '\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-'
    '\U000118df\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    "\\s+$",
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    "\\p{N}+",
]
DEEPSEEK_CODER_REGEXES = [
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    "\\p{N}",
]
DEEPSEEK3_LLM_REGEXES = [
    "\\p{N}{1,3}",
    '[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
    '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p'
    '{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
]
split_deepseek_llm = RegexCascade(DEEPSEEK_LLM_REGEXES)
split_deepseek_coder = RegexCascade(DEEPSEEK_CODER_REGEXES)
split_deepseek3 = RegexCascade(DEEPSEEK3_LLM_REGEXES)


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
# llama.cpp also turns off clean_spaces for these (a detokenizer option ktd does not apply anyway).
PRE_TYPES["deepseek-llm"] = (split_deepseek_llm, False, False)
PRE_TYPES["deepseek-coder"] = (split_deepseek_coder, False, False)
PRE_TYPES["deepseek-v3"] = (split_deepseek3, False, False)
