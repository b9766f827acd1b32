"""Scheduler with the fake engine in-process: continuous batching, fairness, cancel, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import fake_engine
from ktd.errors import Cancelled, ContextOverflow, Internal
from ktd.text.sampling import SamplingParams
from ktd.server.scheduler import Job, Scheduler
from scheduler_helpers import Collector

GREEDY = SamplingParams(temperature=0.0)


def job(prompt: list[int], sink, *, client=1, max_tokens=16, ignore_eos=True, deadline=None):
    return Job(client=client, prompt=prompt, sampling=GREEDY, max_tokens=max_tokens, stop=(),
               ignore_eos=ignore_eos, sink=sink, deadline=deadline)


@pytest.fixture
def make():
    made = []

    def factory(prefill=8, max_queue=16, **engine):
        eng = fake_engine.FakeEngine(**engine)
        s = Scheduler(eng, prefill_tokens_per_step=prefill, max_queue=max_queue,
                      weights=fake_engine.FakeWeights(eng))
        s.start()
        made.append(s)
        return eng, s

    yield factory
    for s in made:
        s.stop(timeout=10)


def test_steps_mix_decode_tokens_of_several_sequences_with_a_prefill_chunk(make):
    eng, s = make(prefill=8, n_seq_max=4, step_delay_s=0.005)
    short = [Collector() for _ in range(2)]
    for i, c in enumerate(short):
        s.submit(job([fake_engine.BOS, 65 + i], c, max_tokens=40))
    time.sleep(0.05)  # both are decoding now
    late = Collector()
    long_prompt = [fake_engine.BOS] + [97] * 30
    s.submit(job(long_prompt, late, max_tokens=5))
    for c in (*short, late):
        assert c.wait()[0] == "done"
    mixed = [call for call in eng.calls
             if call.want_logits.sum() >= 2 and (~call.want_logits).any()]
    assert mixed, "no step combined decode tokens of several sequences with a prefill chunk"
    call = mixed[0]
    assert len(set(call.seq_ids[call.want_logits].tolist())) >= 2
    n_prefill = int((~call.want_logits).sum())
    assert n_prefill <= 8  # the prefill budget per step
    # every sequence's text equals running it alone (no cross-talk through the batch)
    tok = fake_engine.ByteTokenizer()
    for c, prompt, n in ((short[0], [fake_engine.BOS, 65], 40), (short[1], [fake_engine.BOS, 66], 40),
                         (late, long_prompt, 5)):
        ref = fake_engine.reference_greedy(prompt, n, stop_at_eos=False)
        assert "".join(c.chunks) == tok.decode(ref)
        assert c.payload["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                           "cached_tokens": 0}


def test_new_request_joins_without_waiting(make):
    eng, s = make(n_seq_max=2, step_delay_s=0.01)
    long = Collector()
    s.submit(job([fake_engine.BOS, 70], long, max_tokens=200))
    time.sleep(0.05)
    quick = Collector()
    s.submit(job([fake_engine.BOS, 71], quick, max_tokens=3))
    assert quick.wait()[0] == "done"
    assert not long.end.is_set()  # the quick one finished while the long one still runs
    s.cancel(next(iter(s._running)), "test")
    assert long.wait()[0] == "error"


def test_fair_admission_across_clients(make):
    eng, s = make(n_seq_max=1, step_delay_s=0.005)
    order = []

    def sink_for(name):
        c = Collector()

        def sink(kind, payload):
            if kind != "chunk":
                order.append(name)
            c(kind, payload)
        return c, sink

    blocker_c, blocker = sink_for("blocker")
    s.submit(job([fake_engine.BOS], blocker, client=1, max_tokens=60))
    time.sleep(0.03)
    # client 1 queues three more, then client 2 queues one: client 2 must not wait for all of them
    waits = []
    for i in range(3):
        c, sink = sink_for(f"c1-{i}")
        waits.append(c)
        s.submit(job([fake_engine.BOS], sink, client=1, max_tokens=3))
    c2, sink = sink_for("c2")
    s.submit(job([fake_engine.BOS], sink, client=2, max_tokens=3))
    for c in (*waits, c2, blocker_c):
        c.wait()
    # round robin: client 1 was served last (the blocker), so client 2 goes next
    assert order == ["blocker", "c2", "c1-0", "c1-1", "c1-2"]


def test_cancel_and_deadline_take_effect_within_a_step_and_free_the_slot(make):
    eng, s = make(n_seq_max=1, step_delay_s=0.02)
    c = Collector()
    rid = s.submit(job([fake_engine.BOS], c, max_tokens=1000))
    time.sleep(0.1)
    n_before = eng.n_forward
    s.cancel(rid, "bye")
    kind, err = c.wait()
    assert kind == "error" and isinstance(err, Cancelled) and err.message == "bye"
    assert eng.n_forward <= n_before + 2
    assert eng.freed == [0] and eng.kv[0] == []
    d = Collector()
    s.submit(job([fake_engine.BOS], d, max_tokens=1000, deadline=time.monotonic() + 0.1))
    kind, err = d.wait()
    assert isinstance(err, Cancelled) and "deadline" in err.message
    assert err.data["usage"]["completion_tokens"] > 0
    assert s.stats()["slots_in_use"] == 0


def test_engine_errors_fail_only_that_step(make):
    eng, s = make(n_seq_max=2, n_ctx=8)
    # bypass the server's n_ctx check: the engine raises ContextOverflow inside forward
    c = Collector()
    s.submit(job([fake_engine.BOS] * 5, c, max_tokens=20))
    kind, err = c.wait()
    assert kind == "error" and isinstance(err, ContextOverflow)
    ok = Collector()
    s.submit(job([fake_engine.BOS], ok, max_tokens=3))
    assert ok.wait()[0] == "done"

    def broken(*a, **k):
        raise RuntimeError("boom")

    eng.forward = broken
    bad = Collector()
    s.submit(job([fake_engine.BOS], bad, max_tokens=3))
    kind, err = bad.wait()
    assert isinstance(err, Internal) and "boom" in err.message
    assert s.alive and s.stats()["slots_in_use"] == 0


def test_watchdog_health_reflects_a_wedged_engine(make):
    eng, s = make(n_seq_max=1, wedge_after_steps=2)
    assert s.healthy(max_stall_s=0.2)  # idle
    c = Collector()
    s.submit(job([fake_engine.BOS], c, max_tokens=50))
    time.sleep(0.5)
    assert not s.healthy(max_stall_s=0.2)  # work pending, no progress
    eng.unwedge()  # the scheduler can stop (the fixture's teardown)


def test_each_step_hands_its_events_over_at_once_and_a_failing_sink_harms_nobody():
    eng = fake_engine.FakeEngine(n_seq_max=4, step_delay_s=0.002)
    batches: list[list] = []
    lock = threading.Lock()

    def deliver(events):
        with lock:
            batches.append([(sink, kind) for sink, kind, _ in events])
        from ktd.server.scheduler import deliver_here
        deliver_here(events)

    s = Scheduler(eng, prefill_tokens_per_step=64, max_queue=8, deliver=deliver)
    s.start()
    try:
        def broken(kind, payload):
            raise RuntimeError("a sink that fails")

        # 30 tokens each: the four sequences surely decode side by side for a while
        collectors = [Collector() for _ in range(3)]
        for i, c in enumerate(collectors):
            s.submit(job([fake_engine.BOS, 65 + i], c, max_tokens=30))
        s.submit(job([fake_engine.BOS], broken, max_tokens=30))
        for c in collectors:
            kind, payload = c.wait()
            assert kind == "done" and payload["usage"]["completion_tokens"] == 30 and c.chunks
        assert wait_for_idle(s)
    finally:
        s.stop(timeout=10)
    # one hand-off per step at most (plus one per cancellation phase): never one per token
    assert len(batches) <= s.steps + 1
    sinks_per_batch = [len({id(sink) for sink, kind in b if kind == "chunk"}) for b in batches]
    assert max(sinks_per_batch) == 4  # a decode step carries the pieces of all four sequences


def wait_for_idle(s, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.pending() == 0:
            return True
        time.sleep(0.01)
    return False


def test_engine_thread_stays_unpinned_on_a_one_node_pool(tmp_path):
    # the real engine: the thread that runs every forward is the pool's tid 0. The scheduler pins it
    # only on a pool that spans several NUMA nodes (for locality); on one node it stays free to move
    # (ThreadPool.pin_caller itself is tested in test_thread_pool.py)
    import os

    from ktd.server.engine import Engine
    from models.tiny_dense import make_model

    eng = Engine.open(make_model("llama", tmp_path / "tiny.gguf", wtype="Q8_0"), n_ctx=64, n_seq_max=1, threads=1)
    before = os.sched_getaffinity(0)
    s = Scheduler(eng, prefill_tokens_per_step=8, max_queue=4)
    s.start()
    try:
        c = Collector()
        s.submit(job([1, 2, 3], c, max_tokens=2))
        assert c.wait()[0] == "done"
        assert eng.model.forward_cpu == -1
        assert os.sched_getaffinity(s._thread.native_id) == before
    finally:
        s.stop(timeout=10)
    assert eng.pin_forward_thread() is False


def test_a_failing_pin_only_warns(make, caplog):
    eng, s = make(n_seq_max=1)
    s.stop(timeout=10)

    def refuse():
        raise OSError(22, "sched_setaffinity(cpu 3): Invalid argument")

    eng.pin_forward_thread = refuse
    s2 = Scheduler(eng, prefill_tokens_per_step=8, max_queue=4)
    s2.start()
    try:
        c = Collector()
        s2.submit(job([1, 2, 3], c, max_tokens=2))
        assert c.wait()[0] == "done"
    finally:
        s2.stop(timeout=10)
    assert any("could not pin the engine thread" in r.getMessage() for r in caplog.records)


def protocol_members(proto) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)


def test_the_engines_implement_every_member_of_the_engine_protocol():
    # the scheduler calls these directly (no getattr probing): a fake missing one is a test bug
    from ktd.server import engine, engine_api
    members = protocol_members(engine_api.Engine)
    assert {"forward", "free_seq", "pin_forward_thread", "forward_cpu", "tokenizer"} <= members
    fake = fake_engine.FakeEngine()
    assert not [m for m in members if not hasattr(fake, m)]
    assert not [m for m in members - set(engine_api.Engine.__annotations__) if not hasattr(engine.Engine, m)]
    assert not [m for m in protocol_members(engine_api.Tokenizer) if not hasattr(fake.tokenizer, m)]
    assert fake.pin_forward_thread() is False and fake.forward_cpu == -1


# --- prefix cache (ktd.server.prefix_cache): the fake engine checks every position against its slot's
# history, so a sequence started from the wrong KV (or a stale tail) fails the forward, and its
# logits hash the whole history, so reused KV of another prompt would change the text.

def _text(tokens):
    return fake_engine.ByteTokenizer().decode(tokens)


def _run(s, prompt, max_tokens=12, **kw):
    c = Collector()
    s.submit(Job(client=kw.pop("client", 1), prompt=prompt, sampling=GREEDY, max_tokens=max_tokens, stop=(),
                 ignore_eos=True, sink=c, **kw))
    kind, payload = c.wait()
    assert kind == "done", payload
    return "".join(c.chunks), payload["usage"]


def _chat_turns(n_turns, seed=0):
    """Prompts of a multi-turn chat: each the previous prompt + its greedy reply + a new message."""
    rng = np.random.default_rng(seed)
    prompt = [fake_engine.BOS] + rng.integers(97, 123, 20).tolist()
    turns = []
    for _ in range(n_turns):
        turns.append(list(prompt))
        reply = fake_engine.reference_greedy(prompt, 12, stop_at_eos=False)
        prompt = prompt + reply + rng.integers(97, 123, 15).tolist()
    return turns


def test_prefix_cache_multi_turn_chat_prefills_only_the_new_turn(make):
    eng, s = make(prefill=16, n_seq_max=2, cache_slots=2)
    prev = 0
    for i, prompt in enumerate(_chat_turns(4)):
        text, usage = _run(s, prompt)
        assert text == _text(fake_engine.reference_greedy(prompt, 12, stop_at_eos=False))
        # the previous turn's KV: its prompt and all but the last generated token
        assert usage["cached_tokens"] == (0 if i == 0 else prev + 11)
        prev = len(prompt)
    st = s.stats()["prefix_cache"]
    assert st["hits"] == 3 and st["misses"] == 1 and st["entries"] == 1
    assert st["bytes_held"] == st["tokens_held"] * eng.kv_bytes_per_token
    assert st["tokens_held"] == len(prompt) + 11
    assert eng.copies == []  # each turn took the previous turn's slot: nothing copied
    # the prompt tokens computed: the first prompt, then per turn only what the cache lacked
    turns = _chat_turns(4)
    computed = sum(int((~c.want_logits).sum()) + int(c.want_logits.sum()) for c in eng.calls)
    assert computed == len(turns[0]) + sum(len(t) - (len(p) + 11) for p, t in zip(turns, turns[1:])) + 4 * 11  # + decode rows


def test_prefix_cache_greedy_output_identical_with_and_without(make):
    prompts = _chat_turns(3, seed=1) + _chat_turns(2, seed=2) + _chat_turns(3, seed=1)[1:]
    outs = {}
    for slots in (0, 3):
        eng, s = make(prefill=7, n_seq_max=2, cache_slots=slots)
        outs[slots] = [_run(s, p) for p in prompts]
        if slots:
            assert sum(u["cached_tokens"] > 0 for _, u in outs[slots]) >= 4
        else:
            assert all(u["cached_tokens"] == 0 for _, u in outs[slots])
    assert [t for t, _ in outs[0]] == [t for t, _ in outs[3]]


def test_prefix_cache_interleaved_unrelated_prompts_never_share_kv(make):
    eng, s = make(prefill=8, n_seq_max=1, cache_slots=2)
    rng = np.random.default_rng(5)
    bases = [[fake_engine.BOS] + rng.integers(97, 123, 24).tolist() for _ in range(3)]
    for rnd in range(3):
        for b, base in enumerate(bases):
            prompt = base + [65 + rnd, 66 + b]
            text, usage = _run(s, prompt, max_tokens=6)
            assert text == _text(fake_engine.reference_greedy(prompt, 6, stop_at_eos=False))
            # only this base's own earlier KV can match beyond BOS; never more than the base
            assert usage["cached_tokens"] in (0, 1, len(base), len(base) + 1)
    # an entry of one base never served a prompt of another for more than BOS
    for src, dst, n in eng.copies:
        assert n <= len(bases[0]) + 1


def test_prefix_cache_shared_system_prompt_copies_and_keeps_the_entry(make):
    eng, s = make(prefill=64, n_seq_max=3, cache_slots=2, step_delay_s=0.002)
    system = [fake_engine.BOS] + list(b"You are a terse assistant. Answer in one line.")
    _run(s, system + list(b"first"))
    # three concurrent requests sharing the system prompt with the cached one
    cs = [Collector() for _ in range(3)]
    prompts = [system + list(f"question {i}".encode()) for i in range(3)]
    for p, c in zip(prompts, cs):
        s.submit(job(p, c, max_tokens=10))
    for p, c in zip(prompts, cs):
        kind, payload = c.wait()
        assert kind == "done"
        assert "".join(c.chunks) == _text(fake_engine.reference_greedy(p, 10, stop_at_eos=False))
        assert payload["usage"]["cached_tokens"] == len(system)
    assert len(eng.copies) == 3 and all(n == len(system) for _, _, n in eng.copies)
    assert s.stats()["prefix_cache"]["hits"] == 3


def test_prefix_cache_evicts_lru_under_a_tiny_byte_budget(make):
    eng, s = make(prefill=64, n_seq_max=1, cache_slots=3)
    s.prefix.max_bytes = 50 * eng.kv_bytes_per_token  # room for 50 tokens of KV
    rng = np.random.default_rng(9)
    a, b, c = ([fake_engine.BOS] + rng.integers(97, 123, 20).tolist() for _ in range(3))
    _run(s, a, max_tokens=4)                 # 24 tokens kept
    _run(s, b, max_tokens=4)                 # 48 kept
    assert s.stats()["prefix_cache"]["entries"] == 2
    _run(s, c, max_tokens=4)                 # 72 > 50: a (least recently used) evicted
    st = s.stats()["prefix_cache"]
    assert st["evictions"] == 1 and st["entries"] == 2 and st["bytes_held"] <= s.prefix.max_bytes
    _, usage = _run(s, b + [120], max_tokens=2)
    assert usage["cached_tokens"] == len(b)        # b survived (copied from: the entry stays)
    _, usage = _run(s, a + [120], max_tokens=2)
    assert usage["cached_tokens"] <= 1             # a is gone: only BOS could match
    # an entry larger than the whole budget is not kept
    _run(s, [fake_engine.BOS] + rng.integers(97, 123, 60).tolist(), max_tokens=2)
    assert s.stats()["prefix_cache"]["bytes_held"] <= s.prefix.max_bytes


def test_prefix_cache_slot_limit_and_opt_out(make):
    eng, s = make(prefill=64, n_seq_max=1, cache_slots=1)
    rng = np.random.default_rng(3)
    a, b = ([fake_engine.BOS] + rng.integers(97, 123, 20).tolist() for _ in range(2))
    _run(s, a, max_tokens=3)
    _run(s, b, max_tokens=3)                 # one slot: a evicted
    assert s.stats()["prefix_cache"]["evictions"] == 1
    _, usage = _run(s, b + [100], max_tokens=3, cache_prompt=False)
    assert usage["cached_tokens"] == 0       # opted out: nothing reused ...
    reply = fake_engine.reference_greedy(b, 3, stop_at_eos=False)
    _, usage = _run(s, b + reply + [101], max_tokens=3)
    assert usage["cached_tokens"] == len(b) + 2   # ... nothing stored over b's entry (b + 2 of its reply)


def test_prefix_cache_off_uses_no_extra_slot(make):
    eng, s = make(n_seq_max=2)
    p = [fake_engine.BOS, 70, 71, 72]
    _run(s, p)
    _, usage = _run(s, p + [73])
    assert usage["cached_tokens"] == 0 and eng.copies == []
    assert s.stats()["prefix_cache"] == {"slots": 0, "entries": 0, "tokens_held": 0, "bytes_held": 0,
                                         "max_bytes": 0, "hits": 0, "misses": 0, "evictions": 0,
                                         "cached_tokens": 0}


def test_prefix_cache_cancelled_sequence_is_kept_engine_failure_is_not(make):
    eng, s = make(prefill=64, n_seq_max=1, cache_slots=2, step_delay_s=0.01)
    p = [fake_engine.BOS] + list(b"a prompt that is cancelled")
    c = Collector()
    rid = s.submit(job(p, c, max_tokens=1000))
    time.sleep(0.1)
    s.cancel(rid)
    assert c.wait()[0] == "error"
    text, usage = _run(s, p + [33], max_tokens=3)
    assert usage["cached_tokens"] == len(p)
    assert text == _text(fake_engine.reference_greedy(p + [33], 3, stop_at_eos=False))


# --- the weights switch (model.weights_map: auto): only with no sequence in flight -----------------

def test_weights_switch_waits_until_no_sequence_is_in_flight(make):
    """The engine announces other weights while two sequences decode (from the first chunk's
    delivery, on the engine thread): the switch comes only after both have ended, before the next
    job; the fake engine's new KV cache is empty, so a sequence continued across it would fail its
    position check, and a prefix-cache entry kept across it would too."""
    eng, s = make(prefill=8, n_seq_max=2, cache_slots=2)
    first = [Collector() for _ in range(2)]

    class Offer(Collector):
        def __call__(self, kind, payload):
            if kind == "chunk" and not self.chunks:
                s.weights.offer_switch()
            super().__call__(kind, payload)

    offer = Offer()
    s.submit(job([fake_engine.BOS, 65, 66, 67], offer, max_tokens=12))
    for c in first:
        s.submit(job([fake_engine.BOS, 65, 66, 67], c, max_tokens=12))
    for c in (offer, *first):
        assert c.wait()[0] == "done"
    after = Collector()
    s.submit(job([fake_engine.BOS, 65, 66, 67, 68], after, max_tokens=6))
    assert after.wait()[0] == "done"
    # Two slots: offer's job and first[0] ran together, the switch came when both had ended
    # (a switch under them would have failed their next forward), then first[1] was admitted and,
    # its prompt's prefix cache entry dropped with the old KV, prefilled from position 0.
    assert len(s.weights.switches) == 1
    n_before = s.weights.switches[0]
    assert eng.calls[n_before].positions.min() == 0 and 0 < n_before < len(eng.calls)
    tok = fake_engine.ByteTokenizer()
    ref = tok.decode(fake_engine.reference_greedy([fake_engine.BOS, 65, 66, 67], 12, stop_at_eos=False))
    assert ["".join(c.chunks) for c in (offer, *first)] == [ref] * 3
    ref = tok.decode(fake_engine.reference_greedy([fake_engine.BOS, 65, 66, 67, 68], 6, stop_at_eos=False))
    assert "".join(after.chunks) == ref


def test_weights_announced_while_idle_are_switched_to_at_once(make):
    eng, s = make()
    assert s.weights.switches == []
    s.weights.offer_switch()
    c = Collector()
    s.submit(job([fake_engine.BOS, 65], c, max_tokens=3))
    assert c.wait()[0] == "done"
    assert s.weights.switches == [0]  # before the job's first forward


def test_a_busy_scheduler_holds_new_sequences_back_for_a_pending_switch(make):
    """switch_hold_after_s (0 here) after the engine announced other weights with a sequence
    still running, a job submitted meanwhile waits in the queue (a free slot notwithstanding)
    until the running one ends; then the switch, then the job, from position 0."""
    eng, s = make(prefill=8, n_seq_max=2)
    s.switch_hold_after_s = 0.0
    later = Collector()

    class Offer(Collector):
        def __call__(self, kind, payload):
            if kind == "chunk" and not self.chunks:
                s.weights.offer_switch()
                s.submit(job([fake_engine.BOS, 70, 71], later, max_tokens=4))
            super().__call__(kind, payload)

    offer = Offer()
    s.submit(job([fake_engine.BOS, 65, 66, 67], offer, max_tokens=12))
    assert offer.wait()[0] == "done" and later.wait()[0] == "done"
    [n_before] = s.weights.switches
    assert all(len(set(c.seq_ids.tolist())) == 1 for c in eng.calls)  # never both in one step
    assert len(eng.calls) - n_before == 4 and eng.calls[n_before].positions.min() == 0
    tok = fake_engine.ByteTokenizer()
    assert "".join(offer.chunks) == tok.decode(fake_engine.reference_greedy([fake_engine.BOS, 65, 66, 67], 12,
                                                                             stop_at_eos=False))
    assert "".join(later.chunks) == tok.decode(fake_engine.reference_greedy([fake_engine.BOS, 70, 71], 4,
                                                                             stop_at_eos=False))


# --- the greedy fast path (Engine.forward(greedy=True)) --------------------------------------------

@pytest.mark.parametrize("params, plain", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0), True),
    (SamplingParams(temperature=0.0, repeat_penalty=1.3, penalty_last_n=0), True),  # window off: no penalty
    (SamplingParams(temperature=0.0, repeat_penalty=1.3), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), False),
    (SamplingParams(temperature=0.7), False),
])
def test_plain_greedy_is_temperature_0_without_penalties(params, plain):
    from ktd.text.sampling import Generation

    g = Generation(params, prompt=[fake_engine.BOS], eos_ids=frozenset(), stop=(), max_tokens=4, decoder=None)
    assert g.plain_greedy is plain
    if plain:
        g.top_logprobs = 2
        assert not g.plain_greedy  # log-probabilities need the logits


def test_greedy_code_is_the_samplers_error():
    from ktd.text.sampling import Generation

    g = Generation(GREEDY, prompt=[1], eos_ids=frozenset(), stop=(), max_tokens=4, decoder=None)
    for code, msg in [(-1, "NaN"), (-2, r"\+inf"), (-3, "no logit is finite")]:
        with pytest.raises(ValueError, match=msg):
            g.accept_token(code)
    assert g.output == []


def _run_jobs(s, prompts, **kw):
    sinks = []
    for p in prompts:
        c = Collector()
        s.submit(Job(client=1, prompt=p, max_tokens=kw.get("max_tokens", 12), stop=(), ignore_eos=True, sink=c,
                     sampling=kw.get("sampling", GREEDY), top_logprobs=kw.get("top_logprobs")))
        sinks.append(c)
    out = []
    for c in sinks:
        kind, payload = c.wait()
        assert kind == "done"
        out.append("".join(t if isinstance(t, str) else t[0] for t in c.chunks))
    return out


def test_plain_greedy_steps_take_the_engines_greedy_tokens_and_the_same_text(make):
    """Greedy requests run on forward(greedy=True) and give the text that the logits path gives
    (the same requests with log-probabilities, which need the logits); a step with any row that is
    not plain greedy (penalties) runs on the logits."""
    prompts = [[fake_engine.BOS, 72, 105], [fake_engine.BOS, 65, 66, 67], [fake_engine.BOS, 97]]
    eng, s = make(prefill=8, n_seq_max=4)
    fast = _run_jobs(s, prompts)
    assert any(eng.greedy_calls) and all(eng.greedy_calls)
    eng2, s2 = make(prefill=8, n_seq_max=4)
    slow = _run_jobs(s2, prompts, top_logprobs=1)
    assert not any(eng2.greedy_calls)
    assert fast == slow
    eng3, s3 = make(prefill=8, n_seq_max=4)
    _run_jobs(s3, prompts, sampling=SamplingParams(temperature=0.0, repeat_penalty=1.2))
    assert not any(eng3.greedy_calls)
