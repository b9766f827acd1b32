"""A step whose marked rows are partly plain greedy, with the real engine on tiny models: the
greedy rows take the token the output head picks as it writes the logits, and logits come back
for the other rows only, which the native sampler samples (Scheduler._forward,
Engine.forward(greedy=<bool [n]>)).

The oracle is the same rows run as all-greedy steps (forward(greedy=True)) and as all-sampled
steps (every row's logits; a greedy request then asks for log-probabilities, which keeps it off
the greedy path with the same temperature-0 choice). A row's bits do not depend on the other rows'
tokens when the batch's shape (rows, positions, sequences) is the same, and the runs below keep it
the same: the same prompts, all admitted in the first step, max_tokens, no stop."""

from __future__ import annotations

import numpy as np
import pytest

from ktd import _native
from ktd.server.engine import Engine
from ktd.server.scheduler import Job, Scheduler
from ktd.text.sampling import SamplingParams
from models import synthetic_moe
from models.tiny_dense import make_model, model_filename
from scheduler_helpers import Collector, RecordingTokenizer

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 10


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    return {"llama": make_model("llama", root / model_filename("llama", "Q8_0"), wtype="Q8_0"),
            "deepseek2": synthetic_moe.make_model("deepseek2", root / "ds2.gguf", preset="tiny")}


def _batch(n_vocab: int):
    """Two sequences' prefills (one row of each marked) and a third sequence's marked rows."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, n_vocab, 11).astype(np.int32)
    positions = np.array([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3], np.int32)
    seq_ids = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2], np.int32)
    want = np.array([0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1], bool)
    return tokens, positions, seq_ids, want


@pytest.mark.parametrize("arch", ["llama", "deepseek2"])
@pytest.mark.parametrize("n_batch", [512, 4])
def test_a_mixed_forward_gives_the_greedy_ids_and_only_the_sampled_rows_logits(tiny, arch, n_batch):
    """Bitwise: the ids are greedy=True's, the logits the plain forward's rows of the rows not
    greedy; n_batch 4 cuts the batch into chunks."""
    model = _native.Model(str(tiny[arch]), n_threads=2, pin=False)
    batch = _batch(model.n_vocab)
    want = batch[3]
    greedy = np.array([0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0], bool)  # marked rows 1, 6, 9 of 7 marked

    def run(**kw):
        ctx = _native.Context(model, 32, 3, n_batch)
        return ctx.forward(*batch, **kw)

    logits, ids = run(), run(greedy=True)
    got_ids, got_logits = run(greedy=greedy)
    sampled = ~greedy[want]
    assert got_ids.shape == (int(want.sum()),) and got_logits.shape == (int(sampled.sum()), model.n_vocab)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_logits.view(np.uint32), logits[sampled].view(np.uint32))
    # every marked row greedy: no logits; none: every marked row's
    got_ids, got_logits = run(greedy=want)
    assert got_logits.shape == (0, model.n_vocab)
    np.testing.assert_array_equal(got_ids, ids)
    got_ids, got_logits = run(greedy=np.zeros_like(want))
    np.testing.assert_array_equal(got_logits.view(np.uint32), logits.view(np.uint32))
    with pytest.raises(ValueError, match="same length"):
        run(greedy=greedy[:-1])


class _Calls:
    """Engine.forward wrapped: per call its greedy argument's kind and, for a mixed one, the rows
    of logits it returned against the marked rows not greedy."""

    def __init__(self, engine: Engine):
        self.kinds: list[str] = []
        self.mixed_rows: list[tuple[int, int]] = []
        inner = engine.forward

        def forward(tokens, positions, seq_ids, want, greedy=False):
            out = inner(tokens, positions, seq_ids, want, greedy=greedy)
            if isinstance(greedy, bool):
                self.kinds.append("greedy" if greedy else "logits")
            else:
                self.kinds.append("mixed")
                self.mixed_rows.append((out[1].shape[0], int(np.sum(want & ~greedy))))
            return out
        engine.forward = forward


def _serve(path, sampling: list[SamplingParams], top_logprobs: list[int | None]):
    """The prompts submitted at once (all admitted in the scheduler's first step); the generated
    ids of each request and the engine's forward calls."""
    engine = Engine.open(str(path), n_ctx=64, n_seq_max=len(sampling), threads=2, pin=False)
    rec = RecordingTokenizer(engine.tokenizer)
    engine.tokenizer = rec
    calls = _Calls(engine)
    s = Scheduler(engine, prefill_tokens_per_step=64, max_queue=8)
    prompts = [[1, 5 + i, 9, 12 + 3 * i, 7][: 3 + i] for i in range(len(sampling))]
    sinks = [Collector() for _ in sampling]
    s.start()
    try:
        with s._lock:  # the engine thread admits nothing before the last submit (the lock is reentrant)
            for p, sp, lp, c in zip(prompts, sampling, top_logprobs, sinks):
                s.submit(Job(client=1, prompt=p, sampling=sp, max_tokens=MAX_TOKENS, stop=(), ignore_eos=True,
                             sink=c, top_logprobs=lp))
        for c in sinks:
            assert c.wait(120)[0] == "done", c.payload
    finally:
        s.stop(timeout=30)
    return rec.outputs, calls


@pytest.mark.parametrize("arch", ["llama", "deepseek2"])
def test_a_mixed_step_samples_as_all_sampled_steps_and_picks_as_all_greedy_steps(tiny, arch):
    mixed = [GREEDY, _sampled(11), GREEDY, _sampled(12)]
    out, calls = _serve(tiny[arch], mixed, [None] * 4)
    assert set(calls.kinds) == {"mixed"}
    assert calls.mixed_rows and all(got == want for got, want in calls.mixed_rows)
    # the greedy requests as all-greedy steps give the same tokens
    greedy_out, greedy_calls = _serve(tiny[arch], [GREEDY] * 4, [None] * 4)
    assert set(greedy_calls.kinds) == {"greedy"}
    assert [greedy_out[0], greedy_out[2]] == [out[0], out[2]]
    # every request on the logits (the greedy ones asking for log-probabilities) gives the same tokens
    sampled_out, sampled_calls = _serve(tiny[arch], mixed, [1, None, 1, None])
    assert set(sampled_calls.kinds) == {"logits"}
    assert sampled_out == out
    assert all(len(o) == MAX_TOKENS for o in out)
    assert out[1] != out[0] or out[3] != out[2]  # the sampled requests really sample
