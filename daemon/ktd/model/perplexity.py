"""Perplexity of a model on a text, by llama.cpp's ``llama-perplexity`` method (its default mode), so
that the number can be compared with the ones people quote for GGUF files:

- the whole text is tokenized once, with the model's BOS when its tokenizer adds one (special
  tokens in the text are plain text);
- it is cut into ``n_chunk = len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (the rest is not
  used; at least 2 chunks' worth of tokens are required, as llama-perplexity requires);
- each chunk is evaluated from an empty KV cache, its first token replaced by BOS when the
  tokenizer adds one;
- only the second half of each chunk is scored: for positions j in [n_ctx/2, n_ctx - 1), the
  negative log-likelihood of token j + 1 under the logits of row j, so every scored token has at
  least n_ctx/2 tokens of context;
- PPL = exp(mean NLL) over all scored tokens; the uncertainty is llama-perplexity's,
  PPL · sqrt((mean(NLL²) - mean(NLL)²) / (count - 1)).

The log-softmax is computed natively (``Engine.score``): Python receives one float per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


class PerplexityError(ValueError):
    """The text or the options cannot give a perplexity (too few tokens, bad n_ctx)."""


@dataclass
class Result:
    ppl: float
    ppl_err: float                   # llama-perplexity's "+/-"
    n_ctx: int
    n_chunks: int
    n_tokens: int                    # tokens of the whole text
    n_scored: int
    seconds: float                   # evaluation only (not loading, not tokenizing)
    chunk_ppl: list[float] = field(default_factory=list)  # running PPL after each chunk

    @property
    def tokens_per_s(self) -> float:
        return self.n_chunks * self.n_ctx / self.seconds if self.seconds > 0 else 0.0


def chunks(tokens: Sequence[int], n_ctx: int, bos_id: int | None, n_chunks: int | None = None) -> list[np.ndarray]:
    """The evaluated token arrays: consecutive n_ctx-token windows, the first token of each replaced
    by ``bos_id`` when given (None: the model adds no BOS)."""
    if n_ctx < 4:
        raise PerplexityError(f"the context must be at least 4 tokens, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise PerplexityError(f"{len(tokens)} tokens in the text; at least {2 * n_ctx} are needed for a "
                              f"context of {n_ctx} (two chunks; llama-perplexity's rule): give a longer text "
                              f"or a smaller --ctx")
    n = len(tokens) // n_ctx
    if n_chunks is not None:
        if n_chunks < 1:
            raise PerplexityError(f"--chunks must be at least 1, got {n_chunks}")
        n = min(n, n_chunks)
    t = np.asarray(tokens, dtype=np.int32)
    out = []
    for i in range(n):
        c = t[i * n_ctx:(i + 1) * n_ctx].copy()
        if bos_id is not None:
            c[0] = bos_id
        out.append(c)
    return out


def targets(chunk: np.ndarray, original: np.ndarray) -> np.ndarray:
    """int32 [n_ctx]: row j scores original token j + 1 for j in [n_ctx/2, n_ctx - 1), else -1."""
    n_ctx = len(chunk)
    first = n_ctx // 2
    tg = np.full(n_ctx, -1, dtype=np.int32)
    tg[first:n_ctx - 1] = original[first + 1:n_ctx]
    return tg


def summarize(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its uncertainty) from the scored tokens' NLLs, as llama-perplexity reports them."""
    nll = np.asarray(nll, dtype=np.float64)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    var = float((nll * nll).mean()) - mean * mean
    err = ppl * math.sqrt(var / (len(nll) - 1)) if var > 0 and len(nll) > 1 else float("nan")
    return ppl, err


Progress = Callable[[int, int, float, float], None]   # (chunks done, chunks, running PPL, seconds)


def evaluate(engine, tokens: Sequence[int], n_ctx: int, *, n_chunks: int | None = None,
             progress: Progress | None = None) -> Result:
    """The perplexity of ``engine`` (``ktd.server.engine.Engine`` with n_ctx >= ``n_ctx``, slot 0 used) on
    the tokenized text ``tokens``."""
    if n_ctx > engine.n_ctx:
        raise PerplexityError(f"--ctx {n_ctx} exceeds the engine's context {engine.n_ctx}")
    tok = engine.tokenizer
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    windows = chunks(tokens, n_ctx, bos, n_chunks)
    t_all = np.asarray(tokens, dtype=np.int32)
    positions = np.arange(n_ctx, dtype=np.int32)
    seq = np.zeros(n_ctx, dtype=np.int32)
    nlls: list[np.ndarray] = []
    running = []
    t0 = time.monotonic()
    for i, w in enumerate(windows):
        nll = engine.score(w, positions, seq, targets(w, t_all[i * n_ctx:(i + 1) * n_ctx]))
        if not np.isfinite(nll).all():
            raise PerplexityError(f"chunk {i + 1}: the model's logits are not finite (NaN or inf)")
        nlls.append(nll)
        running.append(math.exp(float(np.concatenate(nlls).mean())))
        if progress:
            progress(i + 1, len(windows), running[-1], time.monotonic() - t0)
    seconds = time.monotonic() - t0
    allnll = np.concatenate(nlls)
    ppl, err = summarize(allnll)
    return Result(ppl=ppl, ppl_err=err, n_ctx=n_ctx, n_chunks=len(windows), n_tokens=len(tokens),
                  n_scored=len(allnll), seconds=seconds, chunk_ppl=running)
