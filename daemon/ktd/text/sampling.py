"""Token sampling and the per-sequence stop logic (eos, stop strings, max tokens).

Shapes: ``logits`` is float32 ``[n_vocab]`` (one row of an engine forward). The filter order is
fixed and documented (docs/PROTOCOL.md, generate):

    penalties (window of the last ``penalty_last_n`` tokens of prompt + output)
    → temperature (0 = greedy: argmax of the penalised logits, the lowest id of equals)
    → top-k → softmax → top-p (nucleus) → min-p → seeded draw

Definitions (ktd._native.sampling implements them, native/src/sampling/sampler.h): the order of
every filter is decreasing logit (weight), equal ones by increasing id. Top-k keeps the first k
of that order of the penalised logits. The weights are w = e^(x·(1/T) − max) in float32 over
the whole vocabulary (e^x to ~2 ulp, 0 below e^-87.3), or over the top-k tokens float32 of
e^(x/T − max) computed in float64; the best token has w = 1. Top-p keeps the shortest prefix of
the order whose float64 running sum reaches top_p of the total; min-p keeps w >= float32(min_p).
The draw takes the kept tokens in increasing id order and the first whose cumulative weight
exceeds u · (their total), for one ``rng.random()`` u per token. So the same seed gives the same
tokens, on any ISA (the native passes are bit-identical across ISAs).

A grammar (ktd.text.grammar) adds a bitmask of the allowed tokens: the native sampler sets the others
to -inf after the penalties and before the temperature, so no filter setting can draw them.
Log-probabilities, on request, are of the logits as given (log_softmax before penalties, mask and
temperature), from the same vector passes.

Cost matters: at n_vocab = 152k a decode step is ~20 ms and sampling must stay under 2 % of it.
The native sampler makes a few vector passes over the vocabulary and sorts nothing in the common
cases; ``python -m ktd.bench.sampling`` measures every mode as a share of a real decode step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ktd import _native

_EMPTY_WINDOW = np.zeros(0, np.int64)


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
            # from 0.01: a positive logit is divided by it, and 100x stays finite in float32
            ("repeat_penalty", 0.01 <= self.repeat_penalty <= 100.0, "in [0.01, 100]"),
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


def _args(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.presence_penalty,
            p.frequency_penalty)


def _window(history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """The penalty window as int64 (ids outside the vocabulary are ignored by the sampler)."""
    if p.penalty_last_n == 0 or not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                                                and p.frequency_penalty == 0.0):
        return _EMPTY_WINDOW
    return np.asarray(history[-p.penalty_last_n:], dtype=np.int64)


def candidates(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw may return (weight > 0) and their weights (probabilities up to a common
    factor): ``(ids int32 ascending, w float32)``; temperature > 0. ``history``: prompt + output
    so far (the penalties look at its last ``penalty_last_n`` tokens)."""
    ids, w, _ = _native.sampling.candidates(logits, _window(history, p), *_args(p))
    return ids, w


def draw(w: np.ndarray, u: float) -> int:
    """Position j drawn with probability w[j] / sum(w) (w >= 0 float32), for u uniform in [0, 1):
    the first j whose cumulative weight exceeds u * sum(w) (inverse CDF in the given order)."""
    return _native.sampling.draw(w, u)


class Sampler:
    """Draws tokens for one sequence; owns its seeded random generator."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int], mask: np.ndarray | None = None) -> int:
        """One token id from float32 ``logits [n_vocab]``; ``history`` = prompt + output so far;
        ``mask``: the grammar's bitmask (uint32/int32 words, bit i % 32 of word i // 32 = token i
        allowed; None: all). ValueError if the logits hold NaN or +inf, or no finite value."""
        p = self.params
        u = self._rng.random() if p.temperature > 0.0 else 0.0
        return _native.sampling.sample(logits, _window(history, p), *_args(p), u, mask=mask)

    def sample_logprobs(self, logits: np.ndarray, history: Sequence[int], n_top: int,
                        mask: np.ndarray | None = None) -> tuple[int, float, np.ndarray, np.ndarray]:
        """As ``sample``, and the log-probabilities of the model's distribution at this step
        (log_softmax of ``logits`` as given: before penalties, mask and temperature):
        ``(token, its logprob, the n_top most likely ids, their logprobs)``, n_top in [0, 20]."""
        p = self.params
        u = self._rng.random() if p.temperature > 0.0 else 0.0
        return _native.sampling.sample(logits, _window(history, p), *_args(p), u, mask=mask, logprobs=n_top)


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


class Constraint(Protocol):
    """A grammar's state for one sequence (ktd.text.grammar.Constraint)."""

    def fill(self, words: np.ndarray) -> None: ...
    def mask(self) -> np.ndarray: ...
    def advance(self, token: int) -> None: ...
    @property
    def done(self) -> bool: ...


class Generation:
    """Everything that decides the next token and when a sequence ends, for one request.

    ``accept(logits)`` samples a token, appends it, and returns ``(token, text, finish)``:
    the text that may be streamed now and ``finish`` = None, "stop" (eos token, stop string or a
    complete grammar; eos and stop string are not part of the text) or "length" (max_tokens
    reached).

    ``constraint``: the grammar (ktd.text.grammar); ``accept`` takes its bitmask for this step (computed
    by the caller, possibly while the forward ran) or computes it. ``top_logprobs`` (None: off):
    each token's log-probability and that many alternatives are appended to ``logprobs`` as
    ``(token, logprob, top ids, top logprobs)``; the caller takes them (``take_logprobs``).
    """

    def __init__(self, params: SamplingParams, *, prompt: Sequence[int], eos_ids: frozenset[int],
                 stop: Sequence[str], max_tokens: int, decoder: StreamDecoder,
                 ignore_eos: bool = False, constraint: Constraint | None = None,
                 top_logprobs: int | None = None):
        self.sampler = Sampler(params)
        self.history = list(prompt)
        self.output: list[int] = []
        self.eos_ids = frozenset() if ignore_eos else eos_ids
        self.matcher = StopMatcher(stop)
        self.max_tokens = max_tokens
        self.decoder = decoder
        self.constraint = constraint
        self.top_logprobs = top_logprobs
        self.logprobs: list[tuple[int, float, np.ndarray, np.ndarray]] = []

    def take_logprobs(self) -> list[tuple[int, float, np.ndarray, np.ndarray]]:
        out, self.logprobs = self.logprobs, []
        return out

    @property
    def plain_greedy(self) -> bool:
        """The next token is the plain argmax of the logits: temperature 0, no penalty in effect,
        no grammar, no log-probabilities. Then an engine may choose it itself while it computes the
        logits (``Engine.forward(..., greedy=True)``) and the caller passes it to ``accept_token``:
        the same token as ``accept`` on those logits (the seeded stream draws nothing at
        temperature 0, so it is not skipped over either)."""
        p = self.sampler.params
        penalised = p.penalty_last_n != 0 and (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0
                                               or p.frequency_penalty != 0.0)
        return p.temperature == 0.0 and not penalised and self.constraint is None and self.top_logprobs is None

    def accept_token(self, token: int) -> tuple[int, str, str | None]:
        """As ``accept``, for the token an engine chose greedily (``plain_greedy``); a negative
        value is the engine's code for logits the sampler rejects: ValueError with its message."""
        if token < 0:
            raise ValueError(_native.sampling.greedy_error(int(token)) or f"bad greedy token code {token}")
        return self._take(int(token))

    def accept(self, logits: np.ndarray, mask: np.ndarray | None = None) -> tuple[int, str, str | None]:
        if self.constraint is not None and mask is None:
            mask = self.constraint.mask()
        if self.top_logprobs is None:
            token = self.sampler.sample(logits, self.history, mask)
        else:
            token, lp, top_ids, top = self.sampler.sample_logprobs(logits, self.history, self.top_logprobs, mask)
            self.logprobs.append((token, lp, top_ids, top))
        return self._take(token)

    def _take(self, token: int) -> tuple[int, str, str | None]:
        self.history.append(token)
        self.output.append(token)
        if token in self.eos_ids:
            return token, self.finish(), "stop"
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.matcher.feed(self.decoder.feed(token))
        if self.matcher.stopped:
            return token, text, "stop"
        if self.constraint is not None and self.constraint.done:
            return token, text + self.finish(), "stop"
        if len(self.output) >= self.max_tokens:
            text += self.finish()
            return token, text, "stop" if self.matcher.stopped else "length"
        return token, text, None

    def finish(self) -> str:
        """Text still held back (incomplete UTF-8, a possible stop-string start) at the end."""
        return self.matcher.feed(self.decoder.flush()) + self.matcher.flush()
