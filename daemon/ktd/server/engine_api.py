"""The contract between the daemon and a model engine (what ``ktd.server.engine.load`` must return).

The daemon (scheduler, server) is written against these protocols only; the real engine (native
forward + GGUF tokenizer) and the tests' fake engine implement them. Shapes: ``[n]`` = one entry
per batch row; ``n_marked`` = rows whose ``want_logits`` is true, in row order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ktd.text.chat import RenderLimits


class StreamDecoder(Protocol):
    """Incremental detokenizer of one sequence."""

    def feed(self, token_id: int) -> str:
        """Text completed by this token (only complete UTF-8; may be empty)."""
        ...

    def flush(self) -> str:
        """Whatever is still buffered (incomplete UTF-8 becomes U+FFFD)."""
        ...


class Tokenizer(Protocol):
    """Called from the event loop's worker threads (several at once) and from the engine thread:
    ``encode``/``decode``/``render_chat`` must be thread-safe; a ``StreamDecoder`` is used by one
    thread only."""

    n_vocab: int
    bos_id: int | None
    eos_ids: frozenset[int]          # ids that end generation (eos, eot, im_end ...)
    add_bos: bool
    chat_template: str | None
    fim_ids: dict[str, int]          # fill-in-the-middle token ids by role (pre, suf, mid ...); {} if none

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid UTF-8 becomes U+FFFD."""
        ...

    def decode_stream(self) -> StreamDecoder: ...

    def token_bytes(self, id: int, *, special: bool = False) -> bytes:
        """The bytes token ``id`` adds to the text (control tokens: b"", or their text with
        special=True). The grammars' token table and the logprobs' token texts."""
        ...

    def is_control(self, id: int) -> bool:
        """A control token (never text a grammar can produce)."""
        ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Apply the chat template; raises ValueError with a clear message on a template error."""
        ...

    def encode_chat(self, messages: list[dict], *, add_special: bool = True,
                    add_generation_prompt: bool = True, limits: RenderLimits = RenderLimits(),
                    tools: list[dict] | None = None) -> list[int]:
        """The chat template applied (within ``limits``) and tokenized: its markup as control
        tokens, the messages' content as text (never control tokens); ``tools``: the template's
        ``tools`` variable (OpenAI tool definitions). ValueError as ``render_chat``."""
        ...


class Engine(Protocol):
    """One loaded model, owned by the engine thread (never called from the event loop except
    ``tokenizer``, ``info``, ``n_ctx`` and ``n_seq_max``). Everything the scheduler and the
    server use is declared here; they do not probe for optional members."""

    tokenizer: Tokenizer
    n_ctx: int                       # per-sequence context limit (tokens)
    n_seq_max: int                   # KV slots for running sequences (at most n_seq_max at once)
    n_kv_slots: int                  # KV slots in all, seq ids 0 .. n_kv_slots-1: n_seq_max + those
                                     # the prefix cache holds finished sequences in (ktd.server.prefix_cache)
    kv_bytes_per_token: int          # KV memory of one token of one sequence (prefix cache budget)

    @property
    def forward_cpu(self) -> int:
        """The CPU the forward thread is pinned to, -1 when it is not pinned (for logs)."""
        ...

    def pin_forward_thread(self) -> bool:
        """Called once on the thread that will run every ``forward`` (the scheduler's engine
        thread), before the first one. Pins it where the engine wants it (the real engine: the
        pool's first CPU on a pool that spans several NUMA nodes) and returns whether it pinned;
        an engine with nothing to pin returns False. OSError: the CPU cannot be taken (the
        caller keeps running unpinned)."""
        ...

    def info(self) -> dict[str, Any]:
        """Model name/path, architecture, n_params, quant, isa, threads, memory (huge pages kind
        ...): whatever ``status`` shows. Plain msgpack-able values."""
        ...

    def forward(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
                want_logits: np.ndarray, greedy: bool | np.ndarray = False) -> Any:
        """One batch step. tokens/positions/seq_ids: int32 [n]; want_logits: bool [n].
        Returns float32 [n_marked, n_vocab]. May take long; releases the GIL. Raises
        ``ktd.errors.ContextOverflow`` if a position reaches n_ctx. Only where the engine has
        ``supports_greedy = True`` (the scheduler checks): ``greedy=True`` returns int32
        [n_marked] instead, each marked row's temperature-0 token as the sampler would choose it
        from those logits (no penalties, no mask), or a negative code where the sampler would
        reject them (``ktd._native.sampling.greedy_error``). ``greedy`` a bool [n] array (a step
        whose marked rows are partly plain greedy): ``(ids, logits)``, ids int32 [n_marked] as
        greedy=True gives them for every marked row, logits float32 [n_sampled, n_vocab] of the
        marked rows whose ``greedy`` is False only, in row order."""
        ...

    def free_seq(self, seq_id: int) -> None: ...

    def copy_seq(self, src: int, dst: int, n_tokens: int) -> None:
        """Prefix reuse: the first n_tokens of src's KV become dst's (the prefix cache)."""
        ...


class WeightsSwitch(Protocol):
    """Other weights for the engine, switched to on the engine thread when no sequence is in
    flight (the real one: ``ktd.server.weights.WeightsManager``, model.weights_map: auto after a
    cache miss). The scheduler is written against this; the server composes it."""

    def on_ready(self, wake: Callable[[], None]) -> None:
        """Registers ``wake`` (thread-safe and quick; the scheduler's), called from any thread
        when there are other weights to switch to, at once if there already are."""
        ...

    def switch(self) -> bool:
        """Engine thread, only when no sequence is in flight: switch the engine to the weights
        announced by ``wake``, if any. Returns whether every KV slot is empty afterwards (the
        prefix cache's entries must then be dropped)."""
        ...

    def status(self) -> dict[str, Any]:
        """``model.memory.weights_map_switch`` in ``status`` (plain msgpack-able values)."""
        ...

    def close(self) -> None:
        """Ends what it started (the background build); called once the engine thread has stopped."""
        ...


def model_info(engine: Engine, weights: WeightsSwitch | None) -> dict[str, Any]:
    """``model`` in hello and status: the engine's info, with the switch's state in its ``memory``
    (``weights_map_switch``) where there is a switch."""
    info = engine.info()
    if weights is not None:
        info["memory"] = {**info.get("memory", {}), "weights_map_switch": weights.status()}
    return info


# progress(what, fraction or None, **detail): reported by a factory while loading (STATUS= lines,
# ``status`` while loading); detail (optional, the real engine's): phase, done_bytes, total_bytes.
Progress = Callable[..., None]
# factory(config, progress) -> Engine. The default is ``ktd.server.engine.load``.
EngineFactory = Callable[[Any, Progress], Engine]
# factory(engine) -> WeightsSwitch, called once the engine is loaded. The default (with the default
# engine factory) is ``ktd.server.weights.WeightsManager.start``; none: the engine's weights stay.
WeightsFactory = Callable[[Engine], WeightsSwitch]
