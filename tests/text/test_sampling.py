"""ktd.text.sampling (the native sampler, ktd._native.sampling) against independent, straightforward
implementations of the same definitions: plain Python, full sorts in float64, float64 e^x."""

from __future__ import annotations

import codecs

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ktd import _native
from ktd.text.sampling import Generation, Sampler, SamplingParams, StopMatcher, candidates, draw


def as_dist(idx, w) -> dict[int, float]:
    """candidates() output as {token: probability}."""
    total = float(np.sum(w, dtype=np.float64))
    return {int(t): float(v) / total for t, v in zip(idx, w)}


def apply_penalties(logits: np.ndarray, window, p: SamplingParams) -> np.ndarray:
    """The penalties in numpy (llama.cpp semantics), rounded as documented: the repeat penalty in
    float32, the presence/frequency terms in float64, the result in float32."""
    out = logits.copy()
    if not len(window):
        return out
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ok], counts[ok]
    v = logits[ids]
    if p.repeat_penalty != 1.0:
        rp = np.float32(p.repeat_penalty)
        v = np.where(v > 0, v / rp, v * rp).astype(np.float32)
    out[ids] = (v.astype(np.float64) - counts * p.frequency_penalty - p.presence_penalty).astype(np.float32)
    return out


def native_args(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.presence_penalty, p.frequency_penalty)


def native_candidates(logits, p: SamplingParams, isa: str | None = None):
    """(ids, weights, top_p_path) of the native sampler, no penalties."""
    return _native.sampling.candidates(logits, np.zeros(0, np.int64), *native_args(p), isa=isa)


def native_weights(logits, p: SamplingParams):
    """The native weights before top-p/min-p (ids ascending, w > 0): what the filters cut from."""
    ids, w, _ = native_candidates(logits, SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=1.0,
                                                         min_p=0.0))
    return ids, w


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The native top-k (ids ascending) through candidates(); a huge temperature keeps every weight > 0."""
    return candidates(x, [], SamplingParams(temperature=100.0, top_k=k, top_p=1.0, min_p=0.0))[0]


def reference_distribution(logits, history, p: SamplingParams) -> dict[int, float]:
    """Explicit per-token probabilities, written from the documented order, in plain Python."""
    x = [float(v) for v in logits]
    window = list(history)[-p.penalty_last_n:] if p.penalty_last_n > 0 else []
    for t in set(window):
        c = window.count(t)
        v = x[t]
        if p.repeat_penalty != 1.0:
            v = v / p.repeat_penalty if v > 0 else v * p.repeat_penalty
        x[t] = v - c * p.frequency_penalty - p.presence_penalty
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda i: x[i])
        return {best: 1.0}
    x = [v / p.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if p.top_k > 0:
        order = order[:p.top_k]
    m = max(x[i] for i in order)
    w = {i: np.exp(x[i] - m) for i in order}
    z = sum(w.values())
    probs = {i: w[i] / z for i in order}
    if p.top_p < 1.0:
        kept, mass = {}, 0.0
        for i in order:
            kept[i] = probs[i]
            mass += probs[i]
            if mass >= p.top_p:
                break
        probs = kept
    if p.min_p > 0:
        pmax = max(probs.values())
        probs = {i: v for i, v in probs.items() if v >= p.min_p * pmax}
    z = sum(probs.values())
    return {i: v / z for i, v in probs.items()}


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=10, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.25, penalty_last_n=8),
]


@pytest.mark.parametrize("n_vocab", [7, 64, 3000, 40000])
@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_candidates_match_reference(p, n_vocab):
    rng = np.random.default_rng(n_vocab)
    logits = (rng.standard_normal(n_vocab) * 3).astype(np.float32)
    history = [int(t) for t in rng.integers(0, n_vocab, 20)]
    ref = reference_distribution(logits, history, p)
    if p.temperature == 0:
        assert Sampler(p).sample(logits, history) == next(iter(ref))
        return
    got = as_dist(*candidates(logits, history, p))
    assert set(got) == set(ref)
    for t, v in ref.items():
        assert got[t] == pytest.approx(v, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("k", [1, 40, 200, 1000])
def test_top_k_indices_exact(k):
    rng = np.random.default_rng(k)
    for x in (rng.standard_normal(151936).astype(np.float32),
              np.sort(rng.standard_normal(151936)).astype(np.float32),   # adversarial order
              np.repeat(rng.standard_normal(4748), 32).astype(np.float32)):  # many ties
        got = top_k_indices(x, k)
        assert len(set(got.tolist())) == k
        kth = np.sort(x)[-k]
        assert (x[got] >= kth).all() and (x > kth).sum() <= k


def test_large_vocab_probe_path_matches_reference():
    # n_vocab above the top-p probe size, peaked so the nucleus lies in the probe, and flat so
    # the full-sort fallback is taken
    rng = np.random.default_rng(5)
    for scale in (8.0, 0.3):
        logits = (rng.standard_normal(5000) * scale).astype(np.float32)
        p = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
        ref = reference_distribution(logits, [], p)
        got = as_dist(*candidates(logits, [], p))
        assert set(got) == set(ref)
        assert max(abs(got[t] - ref[t]) for t in ref) < 1e-6


def test_draws_follow_the_reference_distribution():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(30) * 1.5).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02, seed=123)
    ref = reference_distribution(logits, [], p)
    s = Sampler(p)
    n = 40000
    counts = np.bincount([s.sample(logits, []) for _ in range(n)], minlength=30) / n
    assert set(np.flatnonzero(counts)) <= set(ref)
    tv = 0.5 * sum(abs(counts[t] - ref.get(t, 0.0)) for t in range(30))
    assert tv < 0.02  # ~ sqrt(k/n) sampling noise is ~0.01 here


@pytest.mark.parametrize("n", [1, 5, 4096, 4097, 10000])
def test_two_level_draw_matches_inverse_cdf(n):
    rng = np.random.default_rng(n)
    w = rng.random(n).astype(np.float32)
    w[rng.random(n) < 0.3] = 0.0  # zero weights are never drawn
    if not w.any():
        w[0] = 1.0
    cum = np.cumsum(w.astype(np.float64))
    for u in [0.0, 0.999999999, *rng.random(200)]:
        want = int(np.searchsorted(cum, u * cum[-1], side="right"))
        got = draw(w, u)
        assert w[got] > 0
        # equal, up to rounding exactly at a boundary between two tokens
        assert got == want or abs(cum[min(got, want)] - u * cum[-1]) < 1e-6 * cum[-1]


def test_seed_reproducible_and_seeds_differ():
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((50, 100)) * 2).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(p).sample(r, []) for r in rows]
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1.sample(r, []) for r in rows] == [s2.sample(r, []) for r in rows]
    s3 = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8))
    assert [s3.sample(r, []) for r in rows] != [s1.sample(r, []) for r in rows] or a


def test_greedy_respects_penalties():
    logits = np.array([1.0, 5.0, 4.9, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(logits, [1]) == 1
    p = SamplingParams(temperature=0, repeat_penalty=1.1)
    assert Sampler(p).sample(logits, [1]) == 2   # 5/1.1 < 4.9
    p = SamplingParams(temperature=0, presence_penalty=0.2, penalty_last_n=1)
    assert Sampler(p).sample(logits, [2, 1]) == 2
    assert Sampler(p).sample(logits, [1, 2]) == 1  # window of 1: only the last token


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(repeat_penalty=0), dict(seed=-1),
                                 dict(temperature=float("nan"))])
def test_invalid_params_name_the_parameter(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and text.find(s) >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="abcé\n", max_size=40), st.lists(st.text(alphabet="abcé\n", min_size=1, max_size=4),
                                                     max_size=3), st.data())
def test_stop_matcher_across_arbitrary_boundaries(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    m = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += m.feed(piece)
        if m.stopped:
            break
    if not m.stopped:
        out += m.flush()
    assert (out, m.stopped) == reference_stop(text, stops)


class ByteDecoder:
    def __init__(self):
        self.d = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, t):
        return self.d.decode(bytes([t])) if t < 256 else self.d.decode(b"", final=True) + f"<{t}>"

    def flush(self):
        return self.d.decode(b"", final=True)


def forced(token: int, n_vocab: int = 300) -> np.ndarray:
    x = np.zeros(n_vocab, np.float32)
    x[token] = 10.0
    return x


def run_generation(tokens, **kw):
    g = Generation(SamplingParams(temperature=0), prompt=[1, 2], eos_ids=frozenset({299}),
                   decoder=ByteDecoder(), **kw)
    text, finish = "", None
    for t in tokens:
        _, piece, finish = g.accept(forced(t))
        text += piece
        if finish:
            break
    return text, finish, g


def test_generation_eos_stop_length_and_utf8():
    snow = list("é☃".encode())  # 2 + 3 bytes: text appears only when a character is complete
    text, finish, g = run_generation([*snow, 299, 65], stop=(), max_tokens=10)
    assert (text, finish, len(g.output)) == ("é☃", "stop", 6)
    text, finish, _ = run_generation(list(b"hello END world"), stop=("END",), max_tokens=50)
    assert (text, finish) == ("hello ", "stop")
    text, finish, _ = run_generation(list(b"hello EN"), stop=("END",), max_tokens=8)
    assert (text, finish) == ("hello EN", "length")  # held-back text is released at the end
    text, finish, _ = run_generation([0xE2, 0x98], stop=(), max_tokens=2)
    assert (text, finish) == ("\ufffd", "length")  # incomplete UTF-8 at the end
    text, finish, _ = run_generation([65, 299, 66], stop=(), max_tokens=3, ignore_eos=True)
    assert (text, finish) == ("A<299>B", "length")


def reference_step(row, history, p: SamplingParams, u: float | None) -> tuple[int, float]:
    """The documented sampling of one token, written with full sorts in float64: penalties,
    then (for temperature > 0) the order by decreasing penalised logit, equal logits by
    increasing id; top-k = its first k; softmax(logit / temperature); top-p = the shortest
    prefix whose mass reaches top_p; min-p; then the kept ids in increasing order and the
    inverse CDF at ``u``. Returns (token, distance of u from the nearest other draw boundary,
    as a fraction of the mass)."""
    x = row.astype(np.float64)
    n = x.shape[0]
    window = list(history)[-p.penalty_last_n:] if p.penalty_last_n > 0 else []
    for t, c in zip(*np.unique(np.array(window, dtype=np.int64), return_counts=True)):
        v = x[t]
        if p.repeat_penalty != 1.0:
            v = v / p.repeat_penalty if v > 0 else v * p.repeat_penalty
        x[t] = v - c * p.frequency_penalty - p.presence_penalty
    if p.temperature == 0.0:
        return int(np.flatnonzero(x == x.max())[0]), 1.0
    order = np.lexsort((np.arange(n), -x))
    if 0 < p.top_k < n:
        order = order[:p.top_k]
    z = x[order] / p.temperature
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    if p.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(prob), p.top_p, side="left")) + 1
        order, prob = order[:cut], prob[:cut]
    if p.min_p > 0.0:
        keep = prob >= p.min_p * prob.max()
        order, prob = order[keep], prob[keep]
    by_id = np.argsort(order)
    ids, cum = order[by_id], np.cumsum(prob[by_id])
    target = u * cum[-1]
    j = min(int(np.searchsorted(cum, target, side="right")), ids.shape[0] - 1)
    edges = np.concatenate(([0.0], cum))
    return int(ids[j]), float(min(abs(target - edges[j]), abs(edges[j + 1] - target)) / cum[-1])


def _logit_rows(kind: str, n: int, steps: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(steps):
        if kind == "flat":
            x = rng.standard_normal(n) * 3
        elif kind == "peaked":  # a few likely tokens (the top-p probe path)
            x = -2.0 * np.log(rng.permutation(n) + 1.0) + rng.standard_normal(n) * 0.5
        elif kind == "ties":  # many equal logits: tie-breaking by id decides top-k and top-p
            x = np.repeat(np.round(rng.standard_normal(n // 16 + 1) * 2, 1), 16)[:n]
        else:  # "stride": the likely tokens sit on the sample stride, most mass elsewhere
            x = np.full(n, 0.0)
            x[::37] = 4.0
            x += rng.standard_normal(n) * 0.01
        rows.append(x.astype(np.float32))
    return rows


SEQ_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(seed=7),  # the defaults: T=0.8 top-k 40 top-p 0.95 min-p 0.05
    SamplingParams(seed=8, top_k=0, min_p=0.0),  # top-p only
    SamplingParams(seed=9, top_k=0, top_p=0.5, min_p=0.0),
    SamplingParams(seed=10, top_k=0, top_p=1.0, min_p=0.0),  # temperature only
    SamplingParams(seed=11, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(seed=12, top_k=3000, top_p=0.9, min_p=0.0, temperature=1.3),
    SamplingParams(seed=14, top_k=40, top_p=1.0, min_p=0.0, temperature=1.0),  # top-k only
    SamplingParams(seed=13, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                   penalty_last_n=16, top_k=0, min_p=0.0),
]


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "stride"])
@pytest.mark.parametrize("p", SEQ_PARAMS, ids=range(len(SEQ_PARAMS)))
@pytest.mark.parametrize("n_vocab", [1000, 151936])
def test_sampled_tokens_identical_to_reference(kind, p, n_vocab):
    rows = _logit_rows(kind, n_vocab, 12, seed=n_vocab + len(kind))
    s = Sampler(p)
    rng = np.random.default_rng(p.seed)  # the sampler draws one u per token from this stream
    history = [3, 5, 5, 8]
    rounding = 0
    for row in rows:
        got = s.sample(row, history)
        want, margin = reference_step(row, history, p, None if p.temperature == 0 else rng.random())
        if got != want:
            # float32 weights vs this float64 reference: only a draw that falls within rounding
            # distance of the boundary between two adjacent kept tokens may differ
            assert margin < 1e-5, (got, want, margin)
            rounding += 1
        history.append(got)
    assert rounding <= 1


def test_penalties_leave_the_callers_logits_unchanged():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(50000) * 3).astype(np.float32)
    before = logits.copy()
    history = [int(t) for t in rng.integers(0, 50000, 64)]
    p = SamplingParams(seed=1, repeat_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    in_place = Sampler(p).sample(logits, history)
    assert np.array_equal(logits, before)
    read_only = before.copy()
    read_only.flags.writeable = False
    assert Sampler(p).sample(read_only, history) == in_place  # the copying path agrees


def sorted_prefix_candidates(logits, p: SamplingParams):
    """candidates() by the definition, on the native weights: one stable sort of (weight desc, id
    asc) pairs, the float64 running sum in that order, the first position where it reaches top_p of
    the total, then min-p; ids ascending. The running sum is the same sequence of additions as in
    any exact implementation, so the result must be identical, not merely close. (The weights
    themselves are checked against float64 e^x in test_weights_are_exp_to_a_few_ulp.)"""
    idx, w = native_weights(logits, p)
    if p.top_p < 1.0:
        total = float(w.sum(dtype=np.float64))
        order = np.lexsort((idx, -w.astype(np.float64)))
        cum = np.cumsum(w[order], dtype=np.float64)
        keep = min(int(np.searchsorted(cum, p.top_p * total, side="left")) + 1, w.shape[0])
        chosen = np.sort(order[:keep])
        idx, w = idx[chosen], w[chosen]
    if p.min_p > 0.0:
        m = w >= np.float32(p.min_p * float(w.max()))
        idx, w = idx[m], w[m]
    return idx, w


def _many_distributions(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for sigma in (0.05, 0.3, 0.7, 1.0, 1.5, 2.0, 3.0):
        x = rng.standard_normal(n) * sigma
        yield f"normal{sigma}", x
        yield f"normal{sigma}-sorted", np.sort(x)  # the likely tokens all at high ids
    yield "peaked", -2.0 * np.log(rng.permutation(n) + 1.0) + rng.standard_normal(n) * 0.5
    yield "ties", np.repeat(np.round(rng.standard_normal(n // 16 + 1) * 0.5, 1), 16)[:n]
    yield "coarse", np.round(rng.standard_normal(n), 2)  # a few hundred distinct values
    yield "uniform", np.zeros(n)
    yield "two-level", np.where(rng.random(n) < 0.5, 1.0, 0.0)


@pytest.mark.parametrize("n_vocab", [151936, 40000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.99, 0.999])
def test_top_p_identical_to_the_sorted_prefix(n_vocab, top_p):
    """Exact equality (ids and float32 weights) with the full sort on flat, peaked, tied and
    structured distributions; both searches (among the heavy weights and in the tail) must
    actually be taken, not only the full-sort fallback."""
    paths = []
    for name, x in _many_distributions(n_vocab, seed=int(top_p * 1000) + n_vocab):
        logits = x.astype(np.float32)
        for p in (SamplingParams(temperature=0.8, top_k=0, top_p=top_p, min_p=0.0),
                  SamplingParams(temperature=1.7, top_k=0, top_p=top_p, min_p=0.02),
                  SamplingParams(temperature=1.0, top_k=5000, top_p=top_p, min_p=0.0)):
            idx, w, path = native_candidates(logits, p)
            paths.append(path)
            ref_idx, ref_w = sorted_prefix_candidates(logits, p)
            assert np.array_equal(idx, ref_idx), (name, p)
            assert np.array_equal(w, ref_w), (name, p)
    assert "heavy" in paths
    if top_p >= 0.9:
        assert "middle" in paths
    assert paths.count("sort") <= 6  # only exact boundary hits (the uniform and two-level rows)


def test_top_p_search_reaches_into_the_tail():
    # one likely token and a long tail of weights below 2^-16 of it (e^-12 each) that together
    # carry about half the mass: the nucleus reaches past the first pass's two lists
    rng = np.random.default_rng(12)
    x = (-12.0 + rng.standard_normal(151936) * 0.5).astype(np.float32)
    x[rng.integers(151936)] = 0.0
    for top_p in (0.6, 0.95):
        p = SamplingParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
        idx, w, path = native_candidates(x, p)
        assert path == "tail"
        ref_idx, ref_w = sorted_prefix_candidates(x, p)
        assert np.array_equal(idx, ref_idx) and np.array_equal(w, ref_w)


def test_top_p_falls_back_to_the_sort_when_the_target_sits_on_a_boundary():
    # 150000 equal weights, top_p 0.5: the running sum hits the target exactly at token 74999,
    # within rounding of a boundary, so the search must decline and the exact sort decide;
    # ties go to the lower ids
    idx, w, path = native_candidates(np.zeros(150000, np.float32),
                                     SamplingParams(top_k=0, top_p=0.5, min_p=0.0))
    assert path == "sort"
    assert np.array_equal(idx, np.arange(75000)) and np.all(w == 1.0)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_sampled_tokens_identical_to_the_sorted_prefix_sampler(sigma):
    """Seeded token streams: the sampler against sorted_prefix_candidates + the same draw, fed
    the same random stream, token for token (penalties included)."""
    rng = np.random.default_rng(int(sigma * 10))
    for p in (SamplingParams(seed=21, top_k=0, min_p=0.0),
              SamplingParams(seed=22, top_k=0, top_p=0.7, min_p=0.01, temperature=1.2),
              SamplingParams(seed=23, top_k=0, min_p=0.0, repeat_penalty=1.2, presence_penalty=0.3,
                             frequency_penalty=0.1, penalty_last_n=32)):
        s = Sampler(p)
        u = np.random.default_rng(p.seed)
        history = [1, 2, 3]
        for _ in range(6):
            row = (rng.standard_normal(151936) * sigma).astype(np.float32)
            got = s.sample(row, history)
            idx, w = sorted_prefix_candidates(apply_penalties(row, history[-p.penalty_last_n:], p), p)
            assert got == int(idx[draw(w, u.random())])
            history.append(got)


def test_sampling_bench_runs_every_mode_and_shape(capsys):
    # the bench's plumbing only (no model, two calls per mode); no timing is asserted
    from ktd.bench import sampling as bench
    rows = bench.run(None, threads=1, reps=2)
    assert {(r["mode"], r["shape"]) for r in rows} == {(m, s) for m in bench.MODES for s in bench.SHAPES}
    assert all(r["ms"] >= 0 and r["share_of_step"] is None for r in rows)
    assert "top-p 0.95" in capsys.readouterr().out


def test_weights_are_exp_to_a_few_ulp():
    # the documented weights: w = e^d with d = float32(float32(x · float32(1/T)) − max), to a few
    # ulp of float64 e^d (the Cephes polynomial); exactly 0 below e^-87.34; the best token's is 1
    rng = np.random.default_rng(11)
    for scale, t in ((3.0, 0.8), (30.0, 0.37), (0.5, 1.9)):
        x = (rng.standard_normal(151936) * scale).astype(np.float32)
        ids, w = native_weights(x, SamplingParams(temperature=t, top_k=0))
        y = x * np.float32(1.0 / t)
        d = (y - y.max()).astype(np.float32)
        want = np.where(d < np.float32(-87.33654), 0.0, np.exp(d.astype(np.float64)))
        assert np.array_equal(ids, np.flatnonzero(want > 0))
        assert np.max(np.abs(w / want[ids] - 1.0)) < 4 * 2.0 ** -23
        assert w.max() == 1.0 and w[np.argmax(y[ids])] == 1.0
    # over the top-k tokens: float32 of the float64 e^(x/T − max)
    x = (rng.standard_normal(151936) * 3).astype(np.float32)
    ids, w = native_weights(x, SamplingParams(temperature=0.7, top_k=500))
    xs = x[ids].astype(np.float64) / 0.7
    assert np.array_equal(ids, np.sort(np.argsort(-x, kind="stable")[:500]))
    assert np.allclose(w, np.exp(xs - xs.max()).astype(np.float32), rtol=2.0 ** -23, atol=0)


def _supported_sampling_isas() -> list[str]:
    K = _native.kernels
    return [i for i in _native.sampling.kernel_isas() if K.isa_supported(i)]


@pytest.mark.parametrize("n_vocab", [7, 1001, 151935])
def test_every_isa_gives_the_same_bits(n_vocab):
    """Seeded token streams do not depend on the machine: the reference and every SIMD ISA give
    the same candidates (ids, float32 weights, and the same search path) and the same draws."""
    isas = _supported_sampling_isas()
    if len(isas) < 2:
        pytest.skip(f"only {isas} sampling kernels run on this CPU: nothing to compare")
    rng = np.random.default_rng(n_vocab)
    rows = [(rng.standard_normal(n_vocab) * s).astype(np.float32) for s in (0.3, 1.0, 3.0)]
    rows.append((-2.0 * np.log(rng.permutation(n_vocab) + 1.0)).astype(np.float32))
    rows.append(np.repeat(np.round(rng.standard_normal(n_vocab // 8 + 1), 1), 8)[:n_vocab].astype(np.float32))
    window = np.asarray(rng.integers(0, n_vocab, 32), np.int64)
    params = [SamplingParams(top_k=0, top_p=1.0, min_p=0.0), SamplingParams(top_k=0, min_p=0.0),
              SamplingParams(top_k=0, top_p=0.5, min_p=0.05, temperature=1.3), SamplingParams(),
              SamplingParams(top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.2, presence_penalty=0.3)]
    us = rng.random(16)
    for x in rows:
        for p in params:
            results = []
            for isa in isas:
                c = _native.sampling.candidates(x, window, *native_args(p), isa=isa)
                tokens = [_native.sampling.sample(x, window, *native_args(p), float(u), isa=isa) for u in us]
                results.append((c[0].tobytes(), c[1].tobytes(), c[2], tokens))
            assert all(r == results[0] for r in results[1:]), (isas, p)
    w = rng.random(n_vocab).astype(np.float32)
    assert len({tuple(_native.sampling.draw(w, float(u), isa=i) for u in us) for i in isas}) == 1


@pytest.mark.parametrize("isa", [None, "ref"])
def test_logits_without_a_distribution_are_a_clear_error(isa):
    if isa and isa not in _supported_sampling_isas():
        pytest.skip(f"no {isa} sampling kernels")
    s = _native.sampling
    x = np.zeros(100, np.float32)
    none = np.zeros(0, np.int64)
    for bad, msg in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        y = x.copy()
        y[37] = bad
        for t in (0.0, 1.0):
            with pytest.raises(ValueError, match=msg):
                s.sample(y, none, t, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, isa=isa)
    with pytest.raises(ValueError, match="no logit is finite"):
        s.sample(np.full(100, -np.inf, np.float32), none, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, isa=isa)
    # -inf logits (masked tokens) are fine and never drawn
    y = np.full(100, -np.inf, np.float32)
    y[[3, 50, 99]] = [1.0, 2.0, 1.5]
    drawn = {s.sample(y, none, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, float(u), isa=isa) for u in np.linspace(0, 0.999, 50)}
    assert drawn == {3, 50, 99}


def test_native_arguments_are_checked():
    s = _native.sampling
    x = np.zeros(10, np.float32)
    none = np.zeros(0, np.int64)
    for args, msg in (((1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0), "u must be"),
                      ((1.0, 0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5), "top_p"),
                      ((1.0, -1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5), "top_k"),
                      ((-1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5), "temperature"),
                      ((1.0, 0, 1.0, 1.5, 1.0, 0.0, 0.0, 0.5), "min_p"),
                      ((1.0, 0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5), "repeat_penalty")):
        with pytest.raises(ValueError, match=msg):
            s.sample(x, none, *args)
    with pytest.raises(ValueError, match="1-D"):
        s.sample(np.zeros((2, 5), np.float32), none, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="n_vocab"):
        s.sample(np.zeros(0, np.float32), none, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="all weights are 0"):
        s.draw(np.zeros(5, np.float32), 0.5)
    with pytest.raises(ValueError, match="finite and >= 0"):
        s.draw(np.array([1.0, -1.0], np.float32), 0.5)


def test_tiny_temperature_is_the_greedy_limit():
    # 1/T overflows float32: the argmax (first of equals), the limit of the distribution
    p = SamplingParams(temperature=1e-40, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    s = Sampler(p)
    assert {s.sample(np.array([0.5, 3.0, -1.0, 3.0], np.float32), []) for _ in range(5)} == {1}
    # over the top-k tokens the weights are computed in float64, where x/T is still finite
    p = SamplingParams(temperature=1e-40, top_k=2, top_p=1.0, min_p=0.0, seed=1)
    s = Sampler(p)
    assert {s.sample(np.array([0.5, 3.0, -1.0, 2.9], np.float32), []) for _ in range(5)} == {1}


def test_window_ids_outside_the_vocabulary_are_ignored():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(5000) * 2).astype(np.float32)
    p = SamplingParams(top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.5, presence_penalty=1.0,
                       frequency_penalty=0.5)
    window = [-1, 5000, 10 ** 12, 7, 7, 9]
    ids, w = candidates(x, window, p)
    ref = reference_distribution(x, [7, 7, 9], SamplingParams(**{**p.__dict__, "penalty_last_n": 3}))
    got = as_dist(ids, w)
    assert set(got) == set(ref)
    assert max(abs(got[t] - ref[t]) for t in ref) < 1e-6
