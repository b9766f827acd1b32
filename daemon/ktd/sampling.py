"""Token sampling and the per-sequence stop logic (eos, stop strings, max tokens).

Pure numpy, no engine dependency. Shapes: ``logits`` is float32 ``[n_vocab]`` (one row of an
engine forward). The filter order is fixed and documented (docs/PROTOCOL.md, generate):

    penalties (window of the last ``penalty_last_n`` tokens of prompt + output)
    → temperature (0 = greedy: argmax of the penalised logits)
    → top-k → softmax → top-p (nucleus) → min-p → seeded draw

Cost matters: at n_vocab = 152k a decode step is tens of milliseconds and sampling must stay
under 2 % of it, so nothing sorts the whole vocabulary in the common cases: top-k uses
``argpartition``; top-p first tries the ``_NUCLEUS_PROBE`` most likely tokens and sorts the
plausible tokens only when their mass is below top_p (a very flat distribution).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_NUCLEUS_PROBE = 1024  # candidates examined before falling back to a full sort for top-p
_CUT = 40.0  # logit/T distance below the maximum beyond which a token cannot be drawn (see candidates)


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


def apply_penalties(logits: np.ndarray, window: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Return penalised logits (a copy when anything changes). ``window``: recent token ids."""
    if not window or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                      and p.frequency_penalty == 0.0):
        return logits
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ok], counts[ok]
    out = logits.copy()
    v = out[ids]
    if p.repeat_penalty != 1.0:
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
    v = v - counts * p.frequency_penalty - p.presence_penalty
    out[ids] = v
    return out


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that may be drawn and their probabilities (float64, summing to 1).

    ``logits`` are already penalised; temperature > 0. The probabilities are the softmax over
    the top-k set (or the whole vocabulary), then cut by top-p and min-p and renormalised.

    Tokens whose logit/T is more than ``_CUT`` below the maximum are dropped first: each has a
    probability below e^-_CUT relative to the most likely token, together less than
    n_vocab * e^-_CUT (< 1e-12 at 152k), far below float32 resolution of the softmax. This one
    vectorised comparison keeps the rest of the work proportional to the plausible tokens. With
    top-k the k largest logits are found by ``argpartition`` (no sort of the vocabulary).
    """
    x = logits.astype(np.float32, copy=False) / np.float32(p.temperature)
    n = x.shape[0]
    if 0 < p.top_k < n:
        idx = np.argpartition(x, n - p.top_k)[n - p.top_k:]
        xs = x[idx].astype(np.float64)
        probs = np.exp(xs - xs.max())
    else:
        m = x.max()
        idx = np.flatnonzero(x >= m - np.float32(_CUT))
        # float32 exp over what may be the whole vocabulary; float64 from here on
        probs = np.exp(x[idx] - m).astype(np.float64)
    probs /= probs.sum()
    if p.top_p < 1.0:
        k = min(_NUCLEUS_PROBE, idx.shape[0])
        if k < idx.shape[0]:
            top = np.argpartition(probs, probs.shape[0] - k)[probs.shape[0] - k:]
            if probs[top].sum() >= p.top_p:  # the nucleus lies within the probe: sort only it
                idx, probs = idx[top], probs[top]
        order = np.argsort(-probs, kind="stable")
        idx, probs = idx[order], probs[order]
        cum = np.cumsum(probs)
        # the smallest prefix (in decreasing probability) whose mass reaches top_p
        keep = min(int(np.searchsorted(cum, p.top_p, side="left")) + 1, idx.shape[0])
        idx, probs = idx[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep_mask = probs >= p.min_p * probs.max()
        idx, probs = idx[keep_mask], probs[keep_mask]
    return idx, probs / probs.sum()


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
        x = apply_penalties(logits, window, p)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        idx, probs = candidates(x, p)
        u = self._rng.random()
        j = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(idx[min(j, idx.shape[0] - 1)])


class StopMatcher:
    """Finds stop strings in streamed text, also across token boundaries.

    ``feed(text)`` returns the text that can be emitted now: it holds back the longest tail that
    could still be the start of a stop string, so a client never sees part of a stop string.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self.stopped = True
            self._held = ""
            return buf[:first]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation (not by a stop string): the held-back text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


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
            return token, text + self.finish(), "length"
        return token, text, None

    def finish(self) -> str:
        """Text still held back (incomplete UTF-8, a possible stop-string start) at the end."""
        return self.matcher.flush() + self.matcher.feed(self.decoder.flush()) + self.matcher.flush()
