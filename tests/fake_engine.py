"""A deterministic fake engine for daemon tests (never shipped, never a default).

Vocabulary: ids 0..255 are bytes, then BOS, EOS, <|im_start|>, <|im_end|> (n_vocab = 260).
Logits of a row depend only on (the sequence's token history up to and including this row,
position): a hash seeds a numpy generator, so the same history gives the same logits whether a
sequence runs alone or inside a mixed batch — tests compare daemon output with
``reference_greedy``. Printable ASCII is favoured so streamed text is readable. The engine keeps
each slot's history and raises if the scheduler feeds a position out of order (catches batching
bugs), records every forward call, and can sleep per call to simulate compute.
"""

from __future__ import annotations

import codecs
import json
import collections
import hashlib
import threading
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktd.errors import ContextOverflow

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
N_VOCAB = 260
SPECIALS = {"<s>": BOS, "</s>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
ROLES = ("system", "user", "assistant", "tool")
# FakeEngine(fim=True): fill-in-the-middle tokens by role (Tokenizer.fim_ids). The vocabulary has
# no room for more specials, so three of its control tokens stand in, all different from BOS.
FIM_IDS = {"pre": IM_START, "suf": IM_END, "mid": EOS}


class ByteStreamDecoder:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id < 256:
            return self._dec.decode(bytes([token_id]))
        return self._dec.decode(b"", final=True) + SPECIAL_TEXT[token_id]

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    n_vocab = N_VOCAB
    bos_id = BOS
    eos_ids = frozenset({EOS, IM_END})
    add_bos = True
    fim_ids: dict[str, int] = {}  # no fill-in-the-middle tokens (the gateway refuses `suffix`)
    # what render_chat writes; tools in the Hermes style (<tool_call>), as Qwen's template
    chat_template = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                     "</tools> answer with <tool_call><|im_end|>\n{% endif %}"
                     "{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>\n{% endfor %}")

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ids = [BOS] if add_special and self.add_bos else []
        if not parse_special:
            return ids + list(text.encode("utf-8"))
        i = 0
        while i < len(text):
            for name, tid in SPECIALS.items():
                if text.startswith(name, i):
                    ids.append(tid)
                    i += len(name)
                    break
            else:
                ids.extend(text[i].encode("utf-8"))
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        dec = ByteStreamDecoder()
        return "".join(dec.feed(t) for t in ids) + dec.flush()

    def decode_stream(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()

    def token_bytes(self, id: int, *, special: bool = False) -> bytes:
        if id < 256:
            return bytes([id])
        return SPECIAL_TEXT[id].encode() if special else b""

    def is_control(self, id: int) -> bool:
        return id >= 256

    @staticmethod
    def _turns(messages: list[dict], tools: list[dict] | None) -> list[tuple[str, str]]:
        """(role, content) of each turn: the tools as a system turn first; an assistant's tool
        calls written as <tool_call> blocks."""
        turns = []
        if tools:
            turns.append(("system", "<tools>" + "".join(json.dumps(t) for t in tools) + "</tools>"))
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"chat template: unsupported role {m['role']!r} (expected one of {ROLES})")
            content = m.get("content") or ""
            for c in m.get("tool_calls") or ():
                f = c["function"]
                content += "<tool_call>" + json.dumps({"name": f["name"], "arguments": f["arguments"]}) + \
                    "</tool_call>"
            turns.append((m["role"], content))
        return turns

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        out = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in self._turns(messages, tools)]
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def encode_chat(self, messages: list[dict], *, add_special: bool = True,
                    add_generation_prompt: bool = True, limits: Any = None,
                    tools: list[dict] | None = None) -> list[int]:
        """render_chat's text, its markup as control tokens and the content as bytes."""
        ids = [BOS] if add_special and self.add_bos else []
        for role, content in self._turns(messages, tools):
            ids += [IM_START, *f"{role}\n".encode(), *content.encode(), IM_END, *b"\n"]
        if add_generation_prompt:
            ids += [IM_START, *b"assistant\n"]
        return ids


def _stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, N_VOCAB), np.float32)


def _greedy_code(row: np.ndarray) -> int:
    """The sampler's temperature-0 token of a logits row, or the engine's code for a row it rejects
    (ktd._native.sampling.greedy_error)."""
    from ktd import _native

    try:
        return int(_native.sampling.sample(np.ascontiguousarray(row, np.float32), np.zeros(0, np.int64),
                                           0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0))
    except ValueError as e:
        codes = {_native.sampling.greedy_error(c): c for c in (-1, -2, -3)}
        return codes[str(e)]


def row_logits(history: Sequence[int], eos_bias: float) -> np.ndarray:
    """float32 [N_VOCAB] logits after ``history`` (the last entry is the token at this row)."""
    h = hashlib.blake2b(np.asarray(history, dtype=np.int32).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(h, "little") ^ len(history))
    x = rng.standard_normal(N_VOCAB).astype(np.float32) * 2.0
    x[:32] -= 6.0
    x[127:256] -= 6.0
    x[BOS] -= 20.0
    x[IM_START] -= 20.0
    x[EOS] += eos_bias
    x[IM_END] += eos_bias
    return x


def reference_greedy(prompt: Sequence[int], max_tokens: int, eos_bias: float = -4.0,
                     stop_at_eos: bool = True) -> list[int]:
    """Greedy tokens for one sequence alone: the oracle for batched daemon output."""
    history, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(np.argmax(row_logits(history, eos_bias)))
        out.append(t)
        history.append(t)
        if stop_at_eos and t in ByteTokenizer.eos_ids:
            break
    return out


@dataclass
class ForwardCall:
    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    want_logits: np.ndarray


class EngineDied(BaseException):
    """Not an Exception: the scheduler's per-step handler does not catch it, the engine thread
    ends (a fault scenario)."""


class FakeEngine:
    def __init__(self, *, n_ctx: int = 256, n_seq_max: int = 4, step_delay_s: float = 0.0,
                 eos_bias: float = -4.0, wedge_after_steps: int | None = None,
                 die_after_steps: int | None = None, cache_slots: int = 0, fim: bool = False):
        self.tokenizer = ByteTokenizer()
        if fim:
            self.tokenizer.fim_ids = dict(FIM_IDS)
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_kv_slots = n_seq_max + cache_slots   # the prefix cache's slots follow the running ones
        self.kv_bytes_per_token = 100
        self.step_delay_s = step_delay_s
        self.eos_bias = eos_bias
        self.wedge_after_steps = wedge_after_steps
        self.die_after_steps = die_after_steps
        self.kv: list[list[int]] = [[] for _ in range(self.n_kv_slots)]
        self.calls: collections.deque[ForwardCall] = collections.deque(maxlen=10000)
        # each call's greedy argument: a bool, or a tuple of the per-row flags of a mixed step
        self.greedy_calls: collections.deque[bool | tuple[bool, ...]] = collections.deque(maxlen=10000)
        self.n_forward = 0
        self.freed: list[int] = []
        self.copies: list[tuple[int, int, int]] = []
        self._wedge = threading.Event()

    def unwedge(self) -> None:
        """Let the wedged forward (wedge_after_steps) and every later one return: the end of a test,
        so that its scheduler stops at once."""
        self._wedge.set()

    def info(self) -> dict[str, Any]:
        return {"name": "fake", "path": "/dev/null", "architecture": "fake-bytes", "n_params": 0,
                "quant": "F32", "isa": "none", "threads": 1, "n_vocab": N_VOCAB,
                "memory": {"hugepages": "off", "weights_bytes": 0}}

    # As the real engine: forward(..., greedy=True) gives each marked row's greedy token (the
    # sampler's temperature-0 choice on the same logits), so the scheduler's fast path runs here;
    # greedy=<bool [n]> gives those and the logits of the other marked rows.
    supports_greedy = True

    def forward(self, tokens, positions, seq_ids, want_logits, greedy: bool | np.ndarray = False) -> Any:
        for a, dt in ((tokens, np.int32), (positions, np.int32), (seq_ids, np.int32), (want_logits, np.bool_)):
            if a.dtype != dt or a.ndim != 1 or a.shape[0] != tokens.shape[0]:
                raise ValueError("forward: bad array dtype or shape")
        self.calls.append(ForwardCall(tokens.copy(), positions.copy(), seq_ids.copy(), want_logits.copy()))
        self.n_forward += 1
        if self.wedge_after_steps is not None and self.n_forward > self.wedge_after_steps:
            self._wedge.wait()  # simulates a hung native forward (until unwedge)
        if self.die_after_steps is not None and self.n_forward > self.die_after_steps:
            raise EngineDied("the fake engine's thread ends here")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for t, p, s, w in zip(tokens.tolist(), positions.tolist(), seq_ids.tolist(), want_logits.tolist()):
            if not 0 <= s < self.n_kv_slots:
                raise ValueError(f"forward: seq id {s} out of range")
            if p >= self.n_ctx:
                raise ContextOverflow(f"position {p} >= n_ctx {self.n_ctx}")
            if p != len(self.kv[s]):
                raise ValueError(f"forward: seq {s} position {p}, but {len(self.kv[s])} tokens cached")
            if not 0 <= t < N_VOCAB:
                raise ValueError(f"forward: token {t} outside the vocabulary")
            self.kv[s].append(t)
            if w:
                out.append(row_logits(self.kv[s], self.eos_bias))
        if not isinstance(greedy, bool):
            rows = np.asarray(greedy, np.bool_)[want_logits]
            self.greedy_calls.append(tuple(rows.tolist()))
            ids = np.array([_greedy_code(r) for r in out], np.int32)
            return ids, _stack([r for r, g in zip(out, rows) if not g])
        self.greedy_calls.append(greedy)
        if greedy:
            return np.array([_greedy_code(r) for r in out], np.int32)
        return _stack(out)

    forward_cpu = -1  # never pinned

    def pin_forward_thread(self) -> bool:
        return False  # nothing to place: the fake runs on whatever CPU the thread gets

    def free_seq(self, seq_id: int) -> None:
        self.kv[seq_id] = []
        self.freed.append(seq_id)

    def copy_seq(self, src: int, dst: int, n_tokens: int) -> None:
        if not 0 <= n_tokens <= len(self.kv[src]):
            raise ValueError(f"copy_seq: {n_tokens} tokens, seq {src} holds {len(self.kv[src])}")
        self.kv[dst] = list(self.kv[src][:n_tokens])
        self.copies.append((src, dst, n_tokens))


class FakeWeights:
    """The weights switch (ktd.server.engine_api.WeightsSwitch) of a FakeEngine: a test calls
    offer_switch() (as the real manager's builder thread does); switch empties every slot, as the
    real switch's new KV cache is empty."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self._wake = None
        self.switch_offered = False
        self.switches: list[int] = []  # the engine's n_forward at each switch

    def offer_switch(self) -> None:
        self.switch_offered = True
        if self._wake is not None:
            self._wake()

    def on_ready(self, wake) -> None:
        self._wake = wake
        if self.switch_offered:
            wake()

    def switch(self) -> bool:
        if not self.switch_offered:
            return False
        self.switch_offered = False
        self.switches.append(self.engine.n_forward)
        self.engine.kv = [[] for _ in range(self.engine.n_kv_slots)]
        return True

    def status(self) -> dict[str, Any]:
        return {"state": "ready" if self.switch_offered else "none"}

    def close(self) -> None:
        pass


def factory(**options):
    """An engine factory (config, progress) -> FakeEngine that reports loading progress."""

    def make(config, progress):
        n_steps = options.pop("load_steps", 3) if "load_steps" in options else 3
        load_delay = options.pop("load_delay_s", 0.0) if "load_delay_s" in options else 0.0
        # load_gate: a path; after reporting step i the load waits until "<load_gate>.<i>" exists
        # (a test steps the load deterministically, no timing assumption)
        gate = options.pop("load_gate", None) if "load_gate" in options else None
        for i in range(n_steps):
            progress(f"loading fake weights {i + 1}/{n_steps}", (i + 1) / n_steps, phase="preparing",
                     done_bytes=(i + 1) * 1000, total_bytes=n_steps * 1000)
            time.sleep(load_delay / max(n_steps, 1))
            while gate and not os.path.exists(f"{gate}.{i}"):
                time.sleep(0.01)
        return FakeEngine(n_ctx=config.model.n_ctx, n_seq_max=config.model.n_seq_max,
                          cache_slots=config.prefix_cache.slots, **options)

    return make
