"""Log-probabilities from the native sampler (ktd._native.sampling.sample(..., logprobs=N)) and
through the scheduler's events. The oracle is numpy's log_softmax in float64 of the same logits."""

from __future__ import annotations


import numpy as np
import pytest

import fake_engine
from ktd import _native
from ktd.text import grammar
from ktd.text.sampling import Sampler, SamplingParams
from ktd.server.scheduler import Job, Scheduler
from scheduler_helpers import Collector

EMPTY = np.zeros(0, np.int64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def top_order(x: np.ndarray, n: int) -> np.ndarray:
    """The n largest, decreasing, equal values by increasing id (lexsort: last key first)."""
    return np.lexsort((np.arange(x.shape[0]), -x.astype(np.float64)))[:n]


SHAPES = {
    "normal3": lambda rng, n: rng.standard_normal(n) * 3,
    "peaked": lambda rng, n: -2.0 * np.log(rng.permutation(n) + 1) + rng.standard_normal(n) * 0.5 + 20,
    "ties": lambda rng, n: rng.integers(-3, 3, n).astype(np.float64),
    "wide": lambda rng, n: rng.standard_normal(n) * 40,  # most weights underflow e^-87
}


@pytest.mark.parametrize("isa", _native.sampling.kernel_isas())
@pytest.mark.parametrize("n", [1, 7, 33, 1000, 151936])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logprobs_match_numpy_log_softmax(isa, n, shape):
    if not _native.kernels.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} sampling kernels")
    rng = np.random.default_rng(n)
    x = SHAPES[shape](rng, n).astype(np.float32)
    ref = log_softmax(x)
    for n_top, params, u in [(0, (0.0, 0, 1.0, 0.0), 0.0), (5, (0.8, 40, 0.95, 0.05), 0.3),
                             (20, (1.0, 0, 1.0, 0.0), 0.9), (1, (2.0, 0, 0.5, 0.1), 0.5)]:
        token, lp, ids, top = _native.sampling.sample(x, EMPTY, *params, 1.0, 0.0, 0.0, u, isa=isa,
                                                      logprobs=n_top)
        assert abs(lp - ref[token]) < 1e-5
        k = min(n_top, n)
        assert ids.shape == (k,) and top.shape == (k,)
        np.testing.assert_array_equal(ids, top_order(x, k))
        np.testing.assert_allclose(top, ref[ids], atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 1000, 151936])
def test_temperature_0_top_1_is_the_generated_token(n):
    rng = np.random.default_rng(5)
    for _ in range(20):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        token, lp, ids, top = _native.sampling.sample(x, EMPTY, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, logprobs=3)
        assert ids[0] == token and top[0] == lp
        assert lp == pytest.approx(log_softmax(x).max(), abs=1e-5)


def test_logprobs_are_of_the_logits_before_penalties_mask_and_temperature():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(500) * 2).astype(np.float32)
    ref = log_softmax(x)
    window = rng.integers(0, 500, 40).astype(np.int64)
    allowed = np.zeros(500, bool)
    allowed[::7] = True
    words = np.packbits(allowed, bitorder="little").view(np.uint8)
    words = np.concatenate([words, np.zeros((-len(words)) % 4, np.uint8)]).view(np.uint32)
    for temp in (0.0, 0.5, 1.7):
        token, lp, ids, top = _native.sampling.sample(x, window, temp, 10, 0.9, 0.0, 1.5, 0.4, 0.3, 0.42,
                                                      mask=words, logprobs=4)
        assert allowed[token]
        assert abs(lp - ref[token]) < 1e-5
        np.testing.assert_array_equal(ids, top_order(x, 4))  # not limited to the allowed tokens
        np.testing.assert_allclose(top, ref[ids], atol=1e-5, rtol=0)


def test_the_token_drawn_does_not_depend_on_logprobs():
    rng = np.random.default_rng(3)
    for i in range(50):
        x = (rng.standard_normal(3000) * 3).astype(np.float32)
        window = rng.integers(0, 3000, 20).astype(np.int64)
        args = (x, window, 0.9, 40 if i % 2 else 0, 0.9, 0.02, 1.1, 0.1, 0.1, float(rng.random()))
        assert _native.sampling.sample(*args) == _native.sampling.sample(*args, logprobs=7)[0]


def test_bad_top_logprobs_is_a_value_error():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="top logprobs"):
        _native.sampling.sample(x, EMPTY, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, logprobs=21)
    with pytest.raises(ValueError, match="NaN"):
        _native.sampling.sample(np.full(10, np.nan, np.float32), EMPTY, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0,
                                logprobs=2)


def test_sampler_sample_logprobs_uses_the_seeded_stream_as_sample():
    rng = np.random.default_rng(4)
    xs = [(rng.standard_normal(300) * 2).astype(np.float32) for _ in range(30)]
    a, b = Sampler(SamplingParams(seed=7)), Sampler(SamplingParams(seed=7))
    assert [a.sample(x, []) for x in xs] == [b.sample_logprobs(x, [], 2)[0] for x in xs]


# --- through the scheduler -----------------------------------------------------------------------

@pytest.mark.parametrize("constrained", [False, True])
def test_scheduler_events_carry_one_entry_per_token_in_order(constrained):
    eng = fake_engine.FakeEngine(n_ctx=256, n_seq_max=2)
    s = Scheduler(eng, prefill_tokens_per_step=16, max_queue=4)
    s.start()
    try:
        sinks = []
        for i, temp in enumerate((0.0, 0.9)):
            ev = Collector()
            c = (grammar.compile_grammar(grammar.parse_spec({"regex": "[a-z ]{5,30}\\."}), eng.tokenizer)
                 if constrained else None)
            s.submit(Job(client=1, prompt=[fake_engine.BOS, 72, 105], sampling=SamplingParams(temperature=temp, seed=i),
                         max_tokens=24, stop=() if constrained else ("q",), ignore_eos=False, sink=ev, constraint=c, top_logprobs=3))
            sinks.append((ev, temp))
        for ev, _ in sinks:
            assert ev.end.wait(30)
    finally:
        s.stop(timeout=10)
    for ev, temp in sinks:
        assert ev.kind == "done"
        entries = [e for _, extra in ev.chunks for e in extra["logprobs"]] + ev.payload["logprobs"]
        assert len(entries) == ev.payload["usage"]["completion_tokens"]
        history = [fake_engine.BOS, 72, 105]
        for e in entries:  # the fake engine's logits are a function of the history: recompute them
            ref = log_softmax(fake_engine.row_logits(history, eng.eos_bias))
            assert abs(e["logprob"] - ref[e["id"]]) < 1e-5
            assert [t["id"] for t in e["top_logprobs"]] == top_order(ref.astype(np.float32), 3).tolist()
            if temp == 0.0 and not constrained:
                assert e["top_logprobs"][0]["id"] == e["id"]
            assert e["token"] == eng.tokenizer.token_bytes(e["id"], special=True).decode("utf-8", "replace")
            history.append(e["id"])
        text = "".join(t for t, _ in ev.chunks)
        assert all(t for t, _ in ev.chunks)  # a chunk is sent with text, the entries ride along
        if constrained:
            assert text.endswith(".") or ev.payload["finish_reason"] == "length"
