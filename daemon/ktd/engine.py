"""The real engine: a native model + KV-cache context + the GGUF tokenizer (``ktd.engine_api.Engine``).

``load(config, progress)`` is the daemon's engine factory; ``Engine.open(path, ...)`` is the
lower-level constructor used by ``ktd run``, the tests and the benchmarks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ktd import _native
from ktd.engine_api import Progress
from ktd.errors import ContextOverflow
from ktd.tokenizer import Tokenizer


class Engine:
    """One loaded model with ``n_seq_max`` KV slots of ``n_ctx`` tokens each."""

    def __init__(self, model: "_native.Model", context: "_native.Context", tokenizer: Tokenizer, path: str):
        self.model = model
        self.context = context
        self.tokenizer = tokenizer
        self.path = path
        self.n_ctx = context.n_ctx
        self.n_seq_max = context.n_seq_max
        self.n_vocab = model.n_vocab
        # Routing statistics as last copied by the engine thread (info() runs on the event loop
        # and must not wait for the context lock a running forward holds).
        self._expert_snapshot: np.ndarray | None = None
        self._expert_snapshot_at = 0.0

    @classmethod
    def open(cls, path: str | os.PathLike, *, n_ctx: int = 4096, n_seq_max: int = 1, threads: int = 0,
             n_batch: int = 512, pin: bool = True, allow_repack: bool = True,
             progress: Progress | None = None) -> "Engine":
        """Load ``path``. ktd.GGUFError names the tensor/key on a bad or unsupported file."""
        path = os.fspath(path)
        if progress:
            progress("loading weights", None)
        model = _native.Model(path, n_threads=threads, pin=pin, allow_repack=allow_repack)
        if progress:
            progress("loading tokenizer", None)
        tokenizer = Tokenizer.from_gguf(path)
        context = _native.Context(model, n_ctx, n_seq_max, n_batch)
        return cls(model, context, tokenizer, path)

    def info(self) -> dict[str, Any]:
        m = self.model
        return {
            "path": self.path,
            "name": os.path.basename(self.path),
            "architecture": m.arch,
            "n_params": int(m.n_params),
            "n_vocab": int(m.n_vocab),
            "n_layer": int(m.n_layer),
            "n_embd": int(m.n_embd),
            "n_ctx": int(self.n_ctx),
            "n_seq_max": int(self.n_seq_max),
            "isa": m.isa,
            "threads": int(m.n_threads),
            "repacked_bytes": int(m.repacked_bytes),
            **({"experts": self._experts_summary()} if m.n_expert else {}),
        }

    EXPERT_SNAPSHOT_S = 1.0  # how often forward() refreshes the copy info() summarises
    TOP_EXPERTS = 4

    def expert_counts(self) -> np.ndarray:
        """uint64 [n_layer, n_expert]: tokens routed to each expert since load or the last reset
        (dense layers 0). Engine thread only: it waits for a running forward."""
        return self.context.expert_counts()

    def reset_expert_counts(self) -> None:
        self.context.reset_expert_counts()
        self._expert_snapshot = None

    def _experts_summary(self) -> dict[str, Any]:
        """Compact routing statistics for ``status``: per MoE layer the tokens routed and the most
        used experts [[expert, count], ...] (from the engine thread's last snapshot)."""
        m, counts = self.model, self._expert_snapshot
        layers = []
        if counts is not None:
            for il, row in enumerate(counts):
                if row.any():
                    top = np.argsort(-row.astype(np.int64), kind="stable")[: self.TOP_EXPERTS]
                    layers.append({"layer": il, "routed": int(row.sum()),
                                   "top": [[int(e), int(row[e])] for e in top if row[e]]})
        return {"n_expert": int(m.n_expert), "n_expert_used": int(m.n_expert_used), "layers": layers}

    def forward(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
                want_logits: np.ndarray) -> np.ndarray:
        """float32 [n_marked, n_vocab]; ContextOverflow if a position reaches n_ctx."""
        try:
            logits = self.context.forward(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                                          np.asarray(seq_ids, np.int32), np.asarray(want_logits, np.bool_))
        except _native.ContextOverflow as e:
            raise ContextOverflow(str(e)) from None
        if self.model.n_expert and time.monotonic() - self._expert_snapshot_at >= self.EXPERT_SNAPSHOT_S:
            self._expert_snapshot = self.context.expert_counts()
            self._expert_snapshot_at = time.monotonic()
        return logits

    def free_seq(self, seq_id: int) -> None:
        self.context.free_seq(seq_id)

    def copy_seq(self, src: int, dst: int, n_tokens: int) -> None:
        self.context.copy_seq(src, dst, n_tokens)

    def seq_len(self, seq_id: int) -> int:
        return self.context.seq_len(seq_id)


def load(config: Any, progress: Progress) -> Engine:
    """The daemon's factory: ``config.model`` gives path, n_ctx, n_seq_max and threads."""
    mc = config.model
    if not mc.path:
        raise ValueError("model.path is not set")
    return Engine.open(mc.path, n_ctx=mc.n_ctx, n_seq_max=mc.n_seq_max, threads=mc.threads, progress=progress)
