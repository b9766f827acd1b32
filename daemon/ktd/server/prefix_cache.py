"""The prefix cache: KV of finished sequences kept in spare KV slots, reused by new requests.

The engine's context has ``n_kv_slots`` KV slots; ``n_seq_max`` of them belong to the running
sequences at any time, the rest (``prefix_cache.slots``) to this pool. Slots change owner
rather than data: a finished sequence's slot (its KV intact) becomes an entry here and the pool
hands back one of its own slots (an empty one, or the least recently used entry's, evicted) to
the scheduler in exchange. So finishing a sequence copies nothing.

A new request looks up the entry that shares the longest token prefix with its prompt and
starts from it:

- the whole entry is a prefix of the prompt (a chat re-sent with one more turn): the request
  takes the entry's slot (the entry leaves the pool; the scheduler's slot takes its place), no
  copy;
- otherwise (a shared system prompt, a regenerated last turn): ``engine.copy_seq`` copies the
  common prefix into the request's slot and the entry stays.

Entries are owned: a lookup sees only the entries of its own owner (the scheduler's job says
who: the peer's uid on the socket, narrowed by the caller the gateway names; None when the
operator shares the cache, ``prefix_cache.share``). Shared, the cache is a membership oracle:
whether a prompt's prefix is cached shows in ``usage.cached_tokens`` and in the time to the
first token, so one user could test whether another sent a given document.

At least the last prompt token is always recomputed, so the first sampled token comes from
fresh logits. An entry whose tokens are a prefix of a newer entry's is dropped (the newer one
serves every lookup it would). The pool is bounded by its slots and by ``max_bytes`` of KV held
(tokens × the engine's bytes per token); least recently used entries go first.

Engine thread only (the scheduler calls it there); ``stats`` may be read from any thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Entry:
    slot: int
    tokens: np.ndarray               # int32: the tokens whose KV the slot holds, in order
    used: int = 0                    # LRU clock
    owner: str | None = None         # who may reuse it (None: everyone, a shared cache)


@dataclass
class Reuse:
    """The outcome of ``PrefixCache.take``: the slot the request now uses and how many leading
    tokens of its prompt are already in that slot's KV."""

    slot: int
    n_cached: int
    moved: bool = False              # the entry's slot was taken (no copy)


@dataclass
class PrefixCache:
    engine: object                   # ktd.server.engine_api.Engine: free_seq, copy_seq
    slots: list[int]                 # the KV slots this pool owns (initially empty)
    max_bytes: int                   # 0: bounded by the slots only
    bytes_per_token: int
    entries: list[_Entry] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    cached_tokens: int = 0           # prompt tokens served from the pool (sum over hits)
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._empty = list(self.slots)

    @property
    def enabled(self) -> bool:
        return bool(self.slots)

    @property
    def tokens_held(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def stats(self) -> dict[str, int]:
        entries = list(self.entries)
        held = sum(len(e.tokens) for e in entries)
        return {"slots": len(self.slots), "entries": len(entries), "tokens_held": held,
                "bytes_held": held * self.bytes_per_token, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "cached_tokens": self.cached_tokens}

    # --- lookup ------------------------------------------------------------------------------

    @staticmethod
    def _common(a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        if n == 0:
            return 0
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if diff.size else n

    def longest(self, prompt: Sequence[int], owner: str | None = None) -> tuple[_Entry | None, int]:
        """The entry of ``owner`` sharing the longest prefix with ``prompt`` and that length (0: none)."""
        p = np.asarray(prompt, dtype=np.int32)
        best, n_best = None, 0
        for e in self.entries:
            if e.owner != owner:
                continue
            n = self._common(e.tokens, p)
            if n > n_best or (n == n_best and n and best is not None and e.used > best.used):
                best, n_best = e, n
        return best, n_best

    def take(self, prompt: Sequence[int], slot: int, owner: str | None = None) -> Reuse:
        """Start a request of ``owner`` with ``prompt`` in ``slot`` (a scheduler slot, free): reuse
        the longest prefix cached for that owner, leaving at least the last prompt token to compute."""
        entry, n = self.longest(prompt, owner)
        n = min(n, len(prompt) - 1)
        if entry is None or n <= 0:
            self.misses += 1
            return Reuse(slot, 0)
        self.hits += 1
        self.cached_tokens += n
        if n == len(entry.tokens):
            # The request extends the whole entry: it takes the entry's slot, the pool takes the
            # request's (empty: it may hold a stale tail, which forward overwrites or ignores).
            self.entries.remove(entry)
            self._empty.append(slot)
            return Reuse(entry.slot, n, moved=True)
        self.engine.copy_seq(entry.slot, slot, n)
        entry.used = next(self._clock)
        return Reuse(slot, n)

    # --- insertion and eviction ---------------------------------------------------------------

    def put(self, tokens: Sequence[int], slot: int, owner: str | None = None) -> int:
        """A finished sequence of ``owner`` whose KV (of ``tokens``) is in ``slot``: keep it and
        return the slot the scheduler gets back in exchange (``slot`` itself when it is not kept)."""
        t = np.asarray(tokens, dtype=np.int32)
        if not self.enabled or len(t) < 2 or (self.max_bytes and len(t) * self.bytes_per_token > self.max_bytes):
            return slot
        # The owner's entries the new one contains serve no lookup it would not serve better.
        for e in [e for e in self.entries if e.owner == owner and len(e.tokens) <= len(t)
                  and self._common(e.tokens, t) == len(e.tokens)]:
            self._drop(e)
        # Room: one empty slot, and max_bytes with the new entry in.
        while not self._empty or (self.max_bytes and (self.tokens_held + len(t)) * self.bytes_per_token
                                  > self.max_bytes):
            self._drop(min(self.entries, key=lambda e: e.used), evicted=True)
        out = self._empty.pop()
        self.entries.append(_Entry(slot=slot, tokens=t, used=next(self._clock), owner=owner))
        return out

    def _drop(self, e: _Entry, *, evicted: bool = False) -> None:
        self.entries.remove(e)
        if evicted:
            self.evictions += 1
        try:
            self.engine.free_seq(e.slot)
        finally:
            self._empty.append(e.slot)

    def clear(self) -> None:
        for e in list(self.entries):
            self._drop(e)
