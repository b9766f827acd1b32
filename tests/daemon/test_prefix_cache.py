"""The prefix cache with the real engine: a chat re-sent turn after turn gives the same greedy
output with and without the cache, on a tiny model of every architecture (the latent KV cache of
deepseek2's MLA included) and on the real Qwen2.5-Coder-0.5B.

The oracle is the same scheduler with the cache off (prefix_cache.slots = 0), which computes every
prompt in full; ktd.server.prefix_cache and the fake-engine tests (tests/daemon/test_scheduler.py) cover the
bookkeeping. Both runs use the same chunking of the new tokens, so the only difference is where
the prefix's K/V came from (an earlier request's prefill and decode rows, or this request's
prefill): F32 summation order in the GEMM tiles, then the F16 store (test_forward's
ATOL_BATCHING). The models' greedy choices have margins far above that.
"""

from __future__ import annotations

import numpy as np
import pytest

from ktd.server.engine import Engine
from ktd.server.scheduler import Scheduler
from models import synthetic_moe
from models.tiny_dense import ARCHS as DENSE_ARCHS
from scheduler_helpers import RecordingTokenizer, run_greedy_job

MODELS = [("dense", a, None) for a in DENSE_ARCHS] + \
         [("moe", a, v) for a in synthetic_moe.ARCHS for v in synthetic_moe.VARIANTS[a]]


def _chat(engine: Engine, slots: int, turns: list[list[int]], max_tokens: int, prefill: int = 16,
          branch: list[int] = ()):
    """Each turn's prompt = everything before + the previous greedy reply + the turn's new tokens;
    then ``branch`` appended to the last turn's prompt less its last 5 tokens (a regenerated
    turn: it shares part of a cached entry, which is copied)."""
    rec = RecordingTokenizer(engine.tokenizer)
    engine.tokenizer = rec
    s = Scheduler(engine, prefill_tokens_per_step=prefill, max_queue=4)
    s.prefix.slots = list(range(engine.n_seq_max, engine.n_seq_max + slots))
    s.prefix._empty = list(s.prefix.slots)
    s.start()
    try:
        prompt, outs, usages = [], [], []
        for new in turns:
            prompt = prompt + (outs[-1] if outs else []) + new
            out, usage = run_greedy_job(s, rec, prompt, max_tokens)
            outs.append(out)
            usages.append(usage)
        if branch:
            out, usage = run_greedy_job(s, rec, prompt[:-5] + list(branch), max_tokens)
            outs.append(out)
            usages.append(usage)
        return outs, usages, s.prefix.stats()
    finally:
        s.stop(timeout=30)
        engine.tokenizer = rec._tok


@pytest.mark.parametrize("kind,arch,variant", MODELS, ids=lambda v: str(v))
def test_greedy_identical_with_and_without_the_cache(tiny_model, kind, arch, variant):
    path = tiny_model(arch, variant=variant, moe=kind == "moe")
    # one engine with two spare slots serves both runs (the uncached run leaves them unused)
    e = Engine.open(path, n_ctx=160, n_seq_max=1, cache_slots=2, threads=2, pin=False)
    rng = np.random.default_rng(7)
    turns = [[e.tokenizer.bos_id or 1] + rng.integers(3, e.n_vocab, 30).tolist()] + \
            [rng.integers(3, e.n_vocab, 12).tolist() for _ in range(3)]
    branch = rng.integers(3, e.n_vocab, 6).tolist()
    ref, ref_usage, _ = _chat(e, 0, turns, max_tokens=8, branch=branch)
    got, usage, st = _chat(e, 2, turns, max_tokens=8, branch=branch)
    assert got == ref
    assert [u["cached_tokens"] for u in ref_usage] == [0] * 5
    # each later turn reused the previous turn's KV (its prompt + all but the last reply token,
    # the slot taken over); the branch copied the last turn's prompt less 5 tokens
    lens = np.cumsum([len(t) for t in turns]) + np.arange(4) * 8
    assert [u["cached_tokens"] for u in usage] == [0] + [int(n) - 1 for n in lens[:-1] + 8] + [int(lens[-1]) - 5]
    assert st["hits"] == 4 and st["misses"] == 1


def test_kv_bytes_and_slots_of_the_real_engine(tiny_model):
    e = Engine.open(tiny_model("deepseek2", variant="v2"), n_ctx=64, n_seq_max=2, cache_slots=3,
                    threads=1, pin=False)
    assert (e.n_seq_max, e.n_kv_slots) == (2, 5)
    hp = synthetic_moe.config("deepseek2", "tiny", "v2")
    # MLA caches the latent and the shared rope key only, F16
    assert e.kv_bytes_per_token == hp.n_layer * (hp.kv_lora_rank + hp.qk_rope_head_dim) * 2
    assert e.info()["prefix_cache_slots"] == 3


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_chat_identical_with_and_without_the_cache(real_model):
    e = Engine.open(real_model("qwen2.5-coder-0.5b"), n_ctx=1024, n_seq_max=1, cache_slots=1, threads=2,
                    pin=False)
    questions = ["Write a Python function that reverses a string.",
                 "Now make it handle None by returning an empty string.",
                 "Add a docstring and type hints."]
    runs = []
    for slots in (0, 1):
        rec = RecordingTokenizer(e.tokenizer)
        e.tokenizer = rec
        s = Scheduler(e, prefill_tokens_per_step=64, max_queue=4)
        s.prefix.slots = list(range(1, 1 + slots))
        s.prefix._empty = list(s.prefix.slots)
        s.start()
        try:
            messages, outs = [], []
            for q in questions:
                messages.append({"role": "user", "content": q})
                prompt = rec.encode_chat(messages)
                out, usage = run_greedy_job(s, rec, prompt, 48)
                outs.append((out, usage["cached_tokens"], len(prompt)))
                messages.append({"role": "assistant", "content": rec.decode(out)})
        finally:
            s.stop(timeout=60)
            e.tokenizer = rec._tok
        runs.append(outs)
    assert [o for o, _, _ in runs[0]] == [o for o, _, _ in runs[1]]
    assert all(c == 0 for _, c, _ in runs[0])
    # turns 2 and 3 reused most of the previous turn (the template re-renders the reply the same)
    for (_, c, n), (_, _, n_prev) in zip(runs[1][1:], runs[1]):
        assert n_prev <= c < n
