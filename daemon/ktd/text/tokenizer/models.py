"""The two subword algorithms of llama.cpp: byte-level BPE (``gpt2``) and SentencePiece BPE (``llama``).

Both follow llama-vocab.cpp (llm_tokenizer_bpe_session, llm_tokenizer_spm_session): a priority
queue of adjacent symbol pairs, merged best-first (BPE: lowest merge rank; SPM: highest token
score), ties broken by leftmost position; stale queue entries are skipped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: every byte maps to one printable codepoint."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}
_BYTE_TABLE = [BYTE_ENCODER[b] for b in range(256)]


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing, malformed or of an unsupported kind, or the
    vocabulary cannot represent the text."""


# The BPE word cache: words up to this many characters, up to this many bytes in all (an entry's
# dict slot, key and id tuple objects are about _CACHE_ENTRY_BYTES besides their contents).
_CACHE_WORD_CHARS = 256
_CACHE_BYTES = 32 << 20
_CACHE_ENTRY_BYTES = 200


class BytePairEncoder:
    """Byte-level BPE over pre-tokenized words (``tokenizer.ggml.model == "gpt2"``)."""

    def __init__(self, token_to_id: dict[str, int], merges: list[bytes], ignore_merges: bool,
                 split: Callable[[str], list[str]]):
        self.token_to_id = token_to_id
        self.ignore_merges = ignore_merges
        self.split = split
        # merge "a b" -> rank; llama.cpp splits at the first space after position 0 and keeps
        # the first rank of a repeated pair.
        try:
            joined = b"\n".join(merges)
        except TypeError as e:
            raise TokenizerError("tokenizer.ggml.merges must be a string array") from e
        if not merges:
            lines = []
        elif joined.count(b"\n") == len(merges) - 1:
            lines = joined.decode("utf-8", errors="surrogateescape").split("\n")
        else:  # a merge containing a newline byte
            lines = [m.decode("utf-8", errors="surrogateescape") for m in merges]
        # Keyed by the merge's own text rather than a (left, right) tuple per merge (a third of a
        # tokenizer's load): rank_of(a, b) looks up a + " " + b only when a is non-empty and has
        # no space after its first character, which inverts the split rule above, so a pair finds
        # exactly the line that splits into it (a line without such a space splits into no pair).
        self.ranks = dict(zip(reversed(lines), range(len(lines) - 1, -1, -1)))
        self._cache: dict[str, tuple[int, ...]] = {}
        self._cache_bytes = 0

    def rank_of(self, a: str, b: str) -> int | None:
        """The merge rank of the pair (a, b); None when it is not a merge."""
        if not a or a.find(" ", 1) >= 0:
            return None
        return self.ranks.get(a + " " + b)

    def encode(self, text: str, out: list[int]) -> None:
        cache = self._cache
        for word in self.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                # Words repeat when they are short; a long one is rarely seen twice and would
                # hold its length plus 8 bytes per id. The cache has a byte budget, not a count.
                if len(word) <= _CACHE_WORD_CHARS and self._cache_bytes < _CACHE_BYTES:
                    cache[word] = ids
                    self._cache_bytes += _CACHE_ENTRY_BYTES + len(word) + 8 * len(ids)
            out.extend(ids)

    def _encode_word(self, word: str) -> tuple[int, ...]:
        data = word.encode("utf-8", errors="surrogatepass")
        enc = "".join([_BYTE_TABLE[b] for b in data])
        tid = self.token_to_id.get(enc)
        if self.ignore_merges and tid is not None:
            return (tid,)
        syms = _merge(list(enc), self.rank_of, lowest_first=True)
        out: list[int] = []
        for s in syms:
            tid = self.token_to_id.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp falls back to the single-byte pieces of the (byte-encoded) symbol text.
            for ch in s.encode("utf-8", errors="surrogatepass"):
                t = self.token_to_id.get(chr(ch))
                if t is not None:
                    out.append(t)
        return tuple(out)


def _merge(symbols: list[str], pair_key: Callable[[str, str], float | int | None],
           lowest_first: bool) -> list[str]:
    """Best-first pair merging over a doubly linked list of symbols.

    ``pair_key(left, right)`` is the priority of merging the pair (None: not mergeable);
    lowest_first picks the smallest key (BPE rank), otherwise the largest (SPM score). Ties go to
    the leftmost pair. Returns the surviving symbols in order.
    """
    n = len(symbols)
    if n < 2:
        return symbols
    text = symbols[:]  # text[i]: current symbol text ("" once merged away)
    nxt = list(range(1, n)) + [-1]
    prv = list(range(-1, n - 1))
    sign = 1 if lowest_first else -1
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        k = pair_key(text[left], text[right])
        if k is None:
            return
        joined = text[left] + text[right]
        heap.append((sign * k, left, right, joined))

    for i in range(n - 1):
        push(i, i + 1)
    heapq.heapify(heap)

    def push_heap(left: int, right: int) -> None:
        before = len(heap)
        push(left, right)
        if len(heap) > before:
            item = heap.pop()
            heapq.heappush(heap, item)

    while heap:
        _, left, right, joined = heapq.heappop(heap)
        lt, rt = text[left], text[right]
        if not lt or not rt or nxt[left] != right or lt + rt != joined:
            continue
        text[left] = joined
        text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push_heap(prv[left], left)
        push_heap(left, nxt[left])

    out = []
    i = 0
    while i >= 0:
        out.append(text[i])
        i = nxt[i]
    return out


class SentencePieceEncoder:
    """SentencePiece BPE by token score with ``<0xXX>`` byte fallback (``tokenizer.ggml.model == "llama"``)."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], unk_id: int | None):
        self.token_to_id = token_to_id
        self.unk_id = unk_id
        self.scores = scores
        byte_ids: list[int | None] = []
        for b in range(256):
            t = token_to_id.get(f"<0x{b:02X}>")
            if t is None:
                t = token_to_id.get(chr(b)) if b < 0x80 else None
            byte_ids.append(t)
        self.byte_ids = byte_ids

    def encode(self, text: str, out: list[int]) -> None:
        """Encode one raw-text fragment (spaces already escaped as U+2581)."""
        if not text:
            return
        token_to_id = self.token_to_id
        scores = self.scores

        def score(a: str, b: str) -> float | None:
            t = token_to_id.get(a + b)
            return None if t is None else float(scores[t])

        # Every queued pair's text is a token, so a surviving symbol that is not a token is a
        # single character; it falls back to its UTF-8 bytes (llama.cpp's resegment).
        byte_ids = self.byte_ids
        for s in _merge(list(text), score, lowest_first=False):
            t = token_to_id.get(s)
            if t is not None:
                out.append(t)
                continue
            fallback = [byte_ids[b] for b in s.encode("utf-8", errors="surrogatepass")]
            if None not in fallback:
                out.extend(fallback)
            elif self.unk_id is not None:
                out.append(self.unk_id)  # a vocabulary without byte tokens: one <unk> per character
            else:
                raise TokenizerError(f"cannot encode {s!r}: the vocabulary has neither byte "
                                     "tokens for it nor an unknown token")
