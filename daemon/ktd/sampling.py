"""Token sampling and the per-sequence stop logic (eos, stop strings, max tokens).

Pure numpy, no engine dependency. Shapes: ``logits`` is float32 ``[n_vocab]`` (one row of an
engine forward). The filter order is fixed and documented (docs/PROTOCOL.md, generate):

    penalties (window of the last ``penalty_last_n`` tokens of prompt + output)
    → temperature (0 = greedy: argmax of the penalised logits)
    → top-k → softmax → top-p (nucleus) → min-p → seeded draw

The draw is defined independently of how the candidates are found: the kept tokens in
increasing id order, inverse CDF at one ``rng.random()`` per token; ties in the filters go to
the lower id. So any exact implementation gives the same tokens for the same seed.

Cost matters: at n_vocab = 152k a decode step is tens of milliseconds and sampling must stay
under 2 % of it, so nothing sorts the whole vocabulary in the common cases: top-k uses a
sampled threshold and a small partition; top-p on a flat distribution sorts only a band of
weights around the cut (a strided sample brackets it), on a peaked one a candidate set
{w >= tau} whose mass is checked to hold the nucleus, and in both only the weights, not
(weight, id) pairs; the draw uses a two-level cumulative sum. ``python -m ktd.bench.sampling``
measures every mode as a share of a real decode step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_NUCLEUS_PROBE = 1024  # first top-p guess: the nucleus lies in the 1024 most likely tokens
_DRAW_BLOCK = 1024     # block size of the two-level draw
_TOPK_SAMPLE_MIN_N = 16384  # top-k by a sampled threshold from this vocabulary size on
_TOPK_STRIDE = 37      # prime sample stride, so it does not align with structure in token ids
_BAND_MIN_N = 16384    # top-p over the whole vocabulary by a bracketed band from this size on
_BAND_MIN_RANK = 256   # ... when the nucleus reaches this rank of the strided sample (~9.5k tokens)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8     # 0 = greedy
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1 = off
    min_p: float = 0.05          # 0 = off; keep tokens with p >= min_p * p_max
    repeat_penalty: float = 1.0  # 1 = off; >1 discourages repeats (llama.cpp semantics)
    presence_penalty: float = 0.0   # subtracted once from a token present in the window
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window
    penalty_last_n: int = 64     # window of most recent tokens the penalties look at; 0 = off
    seed: int | None = None      # same seed + same logits → same tokens

    def validate(self) -> None:
        """Raise ValueError naming the parameter if a value is out of range."""
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_k", 0 <= self.top_k <= 1 << 20, "in [0, 1048576]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repeat_penalty", 0.0 < self.repeat_penalty <= 100.0, "in (0, 100]"),
            ("presence_penalty", -100.0 <= self.presence_penalty <= 100.0, "in [-100, 100]"),
            ("frequency_penalty", -100.0 <= self.frequency_penalty <= 100.0, "in [-100, 100]"),
            ("penalty_last_n", 0 <= self.penalty_last_n <= 1 << 20, "in [0, 1048576]"),
            ("seed", self.seed is None or 0 <= self.seed < 1 << 64, "in [0, 2**64)"),
        ]
        for name, ok, rng in checks:
            if not ok:
                raise ValueError(f"{name} must be {rng}, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")


def penalised_values(logits: np.ndarray, window: Sequence[int],
                     p: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, new logits of those ids) for the tokens the penalties change, or None when no
    penalty applies. ``window``: recent token ids (out-of-vocabulary ids are ignored)."""
    if not window or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                      and p.frequency_penalty == 0.0):
        return None
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ok], counts[ok]
    v = logits[ids]
    if p.repeat_penalty != 1.0:
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
    return ids, (v - counts * p.frequency_penalty - p.presence_penalty).astype(logits.dtype)


def apply_penalties(logits: np.ndarray, window: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Return penalised logits (a copy when anything changes). ``window``: recent token ids."""
    change = penalised_values(logits, window, p)
    if change is None:
        return logits
    out = logits.copy()
    out[change[0]] = change[1]
    return out


def _top_k_of(x: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    """The k largest of ``x[cand]`` (``cand``: ascending ids, len >= k), ties at the k-th value
    resolved to the lowest ids; ascending ids."""
    vals = x[cand]
    m = vals.shape[0]
    if m == k:
        return cand
    kth = np.partition(vals, m - k)[m - k]
    above = vals > kth
    n_tied = k - int(np.count_nonzero(above))
    tied = np.flatnonzero(vals == kth)[:n_tied]
    keep = above
    keep[tied] = True
    return cand[keep]


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of x [n], ascending; among equal values the lower ids first
    (the order of ``sorted(range(n), key=lambda i: -x[i])``).

    A full partition of 152k logits costs about a millisecond; instead a strided sample gives a
    threshold that about 4k entries reach, one comparison pass collects them, and the small set
    is partitioned. Exact: when at least k entries reach the threshold, the k largest are among
    them; otherwise (an unlucky sample) the whole vocabulary is partitioned.
    """
    n = x.shape[0]
    if n >= _TOPK_SAMPLE_MIN_N and k * 64 < n:
        sample = x[::_TOPK_STRIDE]
        m = sample.shape[0]
        j = min(m - 1, 4 * k * m // n + 4)  # rank from the top of the sample
        tau = np.partition(sample, m - 1 - j)[m - 1 - j]
        cand = np.flatnonzero(x >= tau)
        if k <= cand.shape[0] <= 64 * k:
            return _top_k_of(x, cand, k)
    return _top_k_of(x, np.arange(n), k)


def _nucleus_of(ids: np.ndarray, w: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """The top-p nucleus of a set that holds it: (ids, weights) of the shortest prefix of the
    (decreasing weight, then increasing id) order whose float64 running sum reaches ``target``
    (all of them if none does), in increasing id order. ``ids`` ascending, ``w`` float32 >= 0.

    Only the weights are sorted: equal weights are interchangeable in the running sum, so the
    sorted values give the cut's weight v and how many of the tokens weighing exactly v it takes;
    those are the lowest ids among them.
    """
    vals = np.sort(w)[::-1]
    cum = np.cumsum(vals, dtype=np.float64)
    keep = min(int(np.searchsorted(cum, target, side="left")) + 1, vals.shape[0])
    v = vals[keep - 1]
    n_tied = keep - int(np.count_nonzero(vals[:keep] > v))
    return _take_above(ids, w, v, n_tied)


def _take_above(ids: np.ndarray | None, w: np.ndarray, v: np.float32,
                n_tied: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of the entries of ``w`` above ``v`` and the first ``n_tied`` equal to it,
    in the given (ascending id) order; ``ids`` None: the positions are the ids."""
    mask = w > v
    if n_tied:
        mask[np.flatnonzero(w == v)[:n_tied]] = True
    kept = np.flatnonzero(mask)  # then take(): faster than boolean indexing at any density
    return (kept if ids is None else ids.take(kept)), w.take(kept)


def _nucleus_by_band(w: np.ndarray, sample: np.ndarray, top_p: float,
                     total: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The top-p nucleus of the whole vocabulary ``w`` [n] (as ``_nucleus_of(arange(n), w,
    top_p * total)`` gives it) without sorting it, or None when this shortcut does not apply.

    For a flat distribution (the nucleus is tens of thousands of tokens) the sorted strided
    ``sample`` (decreasing) brackets the cut's weight between two sample values t_lo <= t_hi;
    everything above t_hi is certainly kept, and only the band [t_lo, t_hi] is sorted. The
    running sum then starts from the mass above t_hi, summed in another order than the full
    sort's running sum: both are within n·2^-53·total of the exact sums (sums of non-negative
    terms), so wherever the target is further than twice that from the band's running sums at
    the cut, the cut is the same token; otherwise (or when the bracket misses) None, and the
    caller takes the exact path. Ties at t_hi stay in the band, so the tie rule is applied
    there with all the tied ids.
    """
    n, m = w.shape[0], sample.shape[0]
    target = top_p * total
    margin = 4.0 * n * 2.0 ** -53 * total
    cum_s = np.cumsum(sample, dtype=np.float64)
    j = int(np.searchsorted(cum_s, top_p * float(cum_s[-1]), side="left"))
    if j < _BAND_MIN_RANK:
        return None  # a nucleus of a few thousand tokens: the candidate set is small to sort
    # The estimate's relative rank error stays under ~1/sqrt(n_eff) for flat distributions
    # (n_eff: the sample's effective size, (sum s)^2 / sum s^2), a few times that for heavy tails.
    n_eff = float(cum_s[-1]) ** 2 / float(np.dot(sample, sample))
    d = int(j * min(0.25, 3.0 / np.sqrt(n_eff))) + 8
    t_hi, t_lo = sample[max(0, j - d)], sample[min(m - 1, j + d)]
    above = w > t_hi
    # multiply by the mask rather than index with it: a mask of random density makes boolean
    # indexing branch-bound (several times slower)
    s_hi = float(np.multiply(w, above, dtype=np.float32).sum(dtype=np.float64))
    if not s_hi + margin < target:
        return None
    asc = np.sort(w.take(np.flatnonzero((w >= t_lo) & ~above)))
    cum = np.cumsum(asc[::-1], dtype=np.float64)  # the band in decreasing order
    cum += s_hi
    i = int(np.searchsorted(cum, target, side="left"))
    if i >= asc.shape[0] or cum[i] < target + margin or (cum[i - 1] if i else s_hi) > target - margin:
        return None
    v = asc[asc.shape[0] - 1 - i]
    n_gt = asc.shape[0] - int(np.searchsorted(asc, v, side="right"))  # band entries above v
    return _take_above(None, w, v, i + 1 - n_gt)


def _sorted_sample(w: np.ndarray) -> np.ndarray:
    """Every ``_TOPK_STRIDE``-th weight, in decreasing order."""
    return np.sort(w[::_TOPK_STRIDE])[::-1]


def _is_flat(sample: np.ndarray, n: int, total: float) -> bool:
    """The strided sample carries at least half its share of the mass: many plausible tokens."""
    return float(sample.sum(dtype=np.float64)) * n / sample.shape[0] >= 0.5 * total


def _nucleus_candidates(w: np.ndarray, top_p: float, total: float,
                        sample: np.ndarray | None = None) -> np.ndarray:
    """Ascending ids of a set that holds the top-p nucleus of ``w`` [n] (float32, max 1): every
    token of the (decreasing weight, then id) order up to where the mass reaches
    ``top_p * total`` (``total`` = the sum of ``w``).

    Any set {w >= tau} whose mass reaches the target holds it; each guess at tau costs one
    checked pass. A sorted strided sample gives the guesses. If the sample carries its share of
    the mass, the distribution is flat (thousands of plausible tokens) and the sample's own
    estimate of the nucleus is used, with a margin, then a 4x wider one. Otherwise a few
    tokens the sample missed hold the mass (peaked): first about the ``_NUCLEUS_PROBE`` most
    likely tokens. If every guess falls short, all positive weights are candidates (exact,
    slower). ``sample``: ``_sorted_sample(w)`` when the caller has it.
    """
    n = w.shape[0]
    target = top_p * total
    if n > 4 * _NUCLEUS_PROBE:
        if sample is None:
            sample = _sorted_sample(w)
        m = sample.shape[0]
        cum = np.cumsum(sample, dtype=np.float64)
        # the sample's estimate of where the mass reaches a bit more than top_p, plus 25 % ranks
        j = int(np.searchsorted(cum, (top_p + 0.25 * (1.0 - top_p)) * float(cum[-1]), side="left"))
        j_mass = min(m - 1, j + j // 4 + 4)
        guesses = [j_mass, min(m - 1, 4 * j_mass)]
        if float(cum[-1]) * n / m < 0.5 * total:  # peaked (not _is_flat)
            guesses.insert(0, min(m - 1, _NUCLEUS_PROBE * m // n))
        for j in guesses:
            cand = np.flatnonzero(w >= sample[j])
            if float(w[cand].sum(dtype=np.float64)) >= target:
                return cand
    return np.flatnonzero(w)


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens that may be drawn and their weights (probabilities up to a common factor).

    ``logits`` float32 [n_vocab], already penalised; temperature > 0. Returns ``(idx, w)``:
    token ids in ascending order and their weights; ``idx`` None means ``w`` is [n_vocab] (no
    filter cut anything). Definitions (the order of every filter is decreasing logit, equal
    logits by increasing id): top-k keeps the first k of that order of the penalised logits
    (temperature does not change it); softmax of logit / temperature over those; top-p keeps
    the shortest prefix whose mass reaches top_p of the total; min-p keeps weights >= min_p
    times the largest. Without top-k the whole vocabulary is handled in place in float32
    (scale, subtract the max, exp); nothing sorts the whole vocabulary.
    """
    n = logits.shape[0]
    idx: np.ndarray | None
    if 0 < p.top_k < n:
        idx = top_k_indices(logits, p.top_k)
        xs = logits[idx].astype(np.float64) / p.temperature
        w = np.exp(xs - xs.max()).astype(np.float32)
    else:
        idx = None
        w = np.multiply(logits, np.float32(1.0 / p.temperature), dtype=np.float32)
        np.subtract(w, w.max(), out=w)
        np.exp(w, out=w)  # max 1; far-below-max tokens underflow to exactly 0
    if p.top_p < 1.0:
        total = float(w.sum(dtype=np.float64))
        target = p.top_p * total
        if idx is not None:
            idx, w = _nucleus_of(idx, w, target)
        else:
            kept, sample = None, None
            if n > _BAND_MIN_N:
                sample = _sorted_sample(w)
                if _is_flat(sample, n, total):
                    kept = _nucleus_by_band(w, sample, p.top_p, total)
            if kept is None:
                cand = _nucleus_candidates(w, p.top_p, total, sample)
                kept = _nucleus_of(cand, w[cand], target)
            idx, w = kept
    if p.min_p > 0.0:
        threshold = p.min_p * float(w.max())
        if idx is None:
            idx = np.flatnonzero(w >= threshold)
            w = w[idx]
        else:
            keep_mask = w >= threshold
            idx, w = idx[keep_mask], w[keep_mask]
    return idx, w


def draw(w: np.ndarray, u: float) -> int:
    """Position j drawn with probability w[j] / sum(w), for u uniform in [0, 1): the first j
    whose cumulative weight exceeds u * sum(w) (inverse CDF in the given order).

    Two levels (sums of ``_DRAW_BLOCK`` weights, then one block) so a draw over the whole
    vocabulary costs one reduction pass instead of a full cumulative sum.
    """
    n = w.shape[0]
    if n <= 4 * _DRAW_BLOCK:
        cum = np.cumsum(w, dtype=np.float64)
        start, target = 0, u * cum[-1]
        inner = cum
    else:
        nb = n // _DRAW_BLOCK
        sums = w[: nb * _DRAW_BLOCK].reshape(nb, _DRAW_BLOCK).sum(axis=1, dtype=np.float64)
        cum = np.cumsum(np.append(sums, w[nb * _DRAW_BLOCK:].sum(dtype=np.float64)))
        target = u * cum[-1]
        b = min(int(np.searchsorted(cum, target, side="right")), cum.shape[0] - 1)
        start = b * _DRAW_BLOCK
        target -= cum[b - 1] if b else 0.0
        inner = np.cumsum(w[start:start + _DRAW_BLOCK], dtype=np.float64)
    j = int(np.searchsorted(inner, target, side="right"))
    if j >= inner.shape[0] or w[start + j] == 0:  # rounding at a block edge: last positive weight
        j = int(np.flatnonzero(w[start:start + inner.shape[0]])[-1])
    return start + j


class Sampler:
    """Draws tokens for one sequence; owns its seeded random generator."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """One token id from float32 ``logits [n_vocab]``; ``history`` = prompt + output so far."""
        p = self.params
        window = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else ()
        change = penalised_values(logits, window, p)
        if change is None:
            return self._sample(logits)
        if not logits.flags.writeable:
            return self._sample(apply_penalties(logits, window, p))
        # penalise the few window entries in place and put them back after: no copy of the
        # [n_vocab] row per token
        ids, values = change
        saved = logits[ids]
        logits[ids] = values
        try:
            return self._sample(logits)
        finally:
            logits[ids] = saved

    def _sample(self, x: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(x))
        idx, w = candidates(x, p)
        j = draw(w, self._rng.random())
        return j if idx is None else int(idx[j])


class StopMatcher:
    """Finds stop strings in streamed text, also across token boundaries.

    The result does not depend on how the text is split: generation ends before the stop
    string that *starts* first in the whole text. ``feed(text)`` returns the text that can be
    emitted now; it holds back everything from the earliest position where a stop string may
    still be in progress, so a client never sees part of a stop string.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def _first_match(self, buf: str) -> int:
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def _first_partial(self, buf: str) -> int:
        """Earliest j such that buf[j:] is a proper prefix of a stop string (len(buf) if none)."""
        longest = max(len(s) for s in self.stops)
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return j
        return len(buf)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        first = self._first_match(buf)
        partial = self._first_partial(buf)
        if first >= 0 and first <= partial:
            self.stopped = True
            self._held = ""
            return buf[:first]
        # no match yet, or a longer stop string starting earlier may still complete
        self._held = buf[partial:]
        return buf[:partial]

    def flush(self) -> str:
        """At the end of generation: the held-back text, up to a stop string found in it."""
        buf, self._held = self._held, ""
        if self.stopped:
            return ""
        first = self._first_match(buf) if self.stops else -1
        if first >= 0:
            self.stopped = True
            return buf[:first]
        return buf


class StreamDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class Generation:
    """Everything that decides the next token and when a sequence ends, for one request.

    ``accept(logits)`` samples a token, appends it, and returns ``(token, text, finish)``:
    the text that may be streamed now and ``finish`` = None, "stop" (eos token or stop string;
    neither is part of the text) or "length" (max_tokens reached).
    """

    def __init__(self, params: SamplingParams, *, prompt: Sequence[int], eos_ids: frozenset[int],
                 stop: Sequence[str], max_tokens: int, decoder: StreamDecoder,
                 ignore_eos: bool = False):
        self.sampler = Sampler(params)
        self.history = list(prompt)
        self.output: list[int] = []
        self.eos_ids = frozenset() if ignore_eos else eos_ids
        self.matcher = StopMatcher(stop)
        self.max_tokens = max_tokens
        self.decoder = decoder

    def accept(self, logits: np.ndarray) -> tuple[int, str, str | None]:
        token = self.sampler.sample(logits, self.history)
        self.history.append(token)
        self.output.append(token)
        if token in self.eos_ids:
            return token, self.finish(), "stop"
        text = self.matcher.feed(self.decoder.feed(token))
        if self.matcher.stopped:
            return token, text, "stop"
        if len(self.output) >= self.max_tokens:
            text += self.finish()
            return token, text, "stop" if self.matcher.stopped else "length"
        return token, text, None

    def finish(self) -> str:
        """Text still held back (incomplete UTF-8, a possible stop-string start) at the end."""
        return self.matcher.feed(self.decoder.flush()) + self.matcher.flush()
