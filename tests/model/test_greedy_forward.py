"""Context.forward(greedy=True): the greedy token of every marked row, taken by the output head as it
writes the logits (native/src/sampling/greedy.h), against the sampler's own temperature-0 choice on
the logits of a plain forward: the same token, or the same rejection, for every architecture, batch
shape and thread count; and the piecewise reduction itself against the sampler on rows built to
have ties, NaN and infinities."""

from __future__ import annotations

import numpy as np
import pytest

from ktd import _native
from ktd.server.engine import Engine
from models import synthetic_moe
from models.tiny_dense import ARCHS, VARIANTS, make_model

S = _native.sampling
NO_WINDOW = np.zeros(0, np.int64)


def sampler_greedy(row: np.ndarray) -> int | str:
    """The sampler at temperature 0 (no penalties, no mask): the token, or its error message."""
    try:
        return int(S.sample(np.ascontiguousarray(row, np.float32), NO_WINDOW, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0))
    except ValueError as e:
        return str(e)


def code_as_sampler(code: int) -> int | str:
    return int(code) if code >= 0 else S.greedy_error(int(code))


# --- the piecewise reduction -----------------------------------------------------------------------

def _rows(rng):
    n = 1000
    base = rng.standard_normal(n).astype(np.float32)
    tie = base.copy()
    tie[[17, 400, 999]] = 9.0                      # the first of three equal maxima
    zeros = np.full(n, -1.0, np.float32)
    zeros[[5, 6]] = [-0.0, 0.0]                    # -0 and +0 are equal: the first wins
    nan = base.copy()
    nan[321] = np.nan
    pinf = base.copy()
    pinf[77] = np.inf
    ninf = np.full(n, -np.inf, np.float32)
    mostly_ninf = ninf.copy()
    mostly_ninf[640] = -3e38
    last = base.copy()
    last[-1] = 50.0
    all_nan = np.full(n, np.nan, np.float32)
    return {"random": base, "tie": tie, "zeros": zeros, "nan": nan, "+inf": pinf, "-inf": ninf,
            "one finite": mostly_ninf, "last": last, "all nan": all_nan}


@pytest.mark.parametrize("name", list(_rows(np.random.default_rng(0))))
def test_pieces_in_any_order_on_any_worker_give_the_samplers_choice(name):
    rng = np.random.default_rng(1)
    row = _rows(np.random.default_rng(0))[name]
    want = sampler_greedy(row)
    for trial in range(40):
        k = int(rng.integers(0, 30))
        cuts = sorted(set(rng.integers(1, len(row), size=k).tolist()))
        order = rng.permutation(len(cuts) + 1).tolist()
        worker = rng.integers(0, 4, size=len(cuts) + 1).tolist()
        assert code_as_sampler(S.greedy_pieces(row, cuts, order, worker)) == want, (name, cuts, order, worker)


def test_greedy_pieces_rejects_bad_cuts():
    row = np.zeros(10, np.float32)
    for cuts, order, worker in [([0], [0, 1], [0, 0]), ([5, 5], [0, 1, 2], [0, 0, 0]), ([10], [0, 1], [0, 0]),
                                ([5], [0, 0], [0, 0]), ([5], [0], [0]), ([5], [0, 1], [0, -1])]:
        with pytest.raises(ValueError):
            S.greedy_pieces(row, cuts, order, worker)
    assert S.greedy_error(0) is None and S.greedy_error(12345) is None


# --- the forward -------------------------------------------------------------------------------------

def _models(tmp_path):
    out = [(f"{a}-{v}", make_model(a, tmp_path / f"{a}-{v}.gguf", variant=v, wtype="Q8_0" if a != "bitnet" else "F32"))
           for a in ARCHS for v in VARIANTS[a][:2]]
    out.append(("qwen3moe", synthetic_moe.make_model("qwen3moe", tmp_path / "qwen3moe.gguf")))
    out.append(("deepseek2", synthetic_moe.make_model("deepseek2", tmp_path / "ds2.gguf", variant="v2")))
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_greedy_forward_equals_the_sampler_on_the_logits(tmp_path, threads):
    """Prompt batches with several marked rows (two sequences), then decode steps: each greedy id is
    the sampler's choice on the plain forward's logits of the same rows, and the logits are the same
    bits either way (the hook only reads them; gemma3's softcap is applied once, in the hook)."""
    for name, path in _models(tmp_path):
        plain = Engine.open(path, n_ctx=64, n_seq_max=2, threads=threads, pin=False)
        greedy = Engine.open(path, n_ctx=64, n_seq_max=2, threads=threads, pin=False)
        rng = np.random.default_rng(3)
        n_vocab = plain.n_vocab
        toks = rng.integers(3, n_vocab, size=12).astype(np.int32)
        pos = np.r_[np.arange(7), np.arange(5)].astype(np.int32)
        seq = np.r_[np.zeros(7), np.ones(5)].astype(np.int32)
        want = np.zeros(12, np.bool_)
        want[[2, 6, 9, 11]] = True
        for step in range(4):
            logits = plain.context.forward(toks, pos, seq, want)
            ids = greedy.context.forward(toks, pos, seq, want, greedy=True)
            assert ids.dtype == np.int32 and ids.shape == (int(want.sum()),)
            assert [code_as_sampler(c) for c in ids] == [sampler_greedy(r) for r in logits], (name, step)
            # next: one decode row per sequence, fed the greedy tokens of each sequence's last row
            last = ids[-2:] if step == 0 else ids
            toks = np.asarray(last, np.int32)
            pos = np.array([pos[seq == 0].max() + 1, pos[seq == 1].max() + 1], np.int32)
            seq = np.array([0, 1], np.int32)
            want = np.ones(2, np.bool_)


def _with_tensor(src, dst, name, fill):
    """A copy of the GGUF `src` with F32 tensor `name` set to `fill` in place."""
    import shutil

    import gguf

    shutil.copy(src, dst)
    (t,) = [t for t in gguf.GGUFReader(str(dst)).tensors if t.name == name]
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    mm = np.memmap(dst, dtype=np.uint8, mode="r+")
    mm[t.data_offset:t.data_offset + t.n_bytes] = np.full(t.n_elements, fill, np.float32).view(np.uint8)
    mm.flush()
    return dst


def test_greedy_forward_reports_bad_logits_per_row(tmp_path):
    """Equal logits everywhere (an output head of zeros) give token 0 for every row, as the sampler's
    first-of-equals; NaN in the final norm poisons every logit: the NaN code, the sampler's message."""
    path = make_model("llama", tmp_path / "m.gguf", wtype="F32")
    e = Engine.open(_with_tensor(path, tmp_path / "zeros.gguf", "output.weight", 0.0), n_ctx=16, threads=2, pin=False)
    ids = e.context.forward(np.array([5, 6], np.int32), np.array([0, 1], np.int32), np.zeros(2, np.int32),
                            np.ones(2, np.bool_), greedy=True)
    assert ids.tolist() == [0, 0]
    e = Engine.open(_with_tensor(path, tmp_path / "nan.gguf", "output_norm.weight", np.nan), n_ctx=16, threads=2,
                    pin=False)
    ids = e.context.forward(np.array([5], np.int32), np.array([0], np.int32), np.zeros(1, np.int32),
                            np.ones(1, np.bool_), greedy=True)
    assert S.greedy_error(int(ids[0])) == "sampling: the logits contain NaN"
    logits = e.context.forward(np.array([6], np.int32), np.array([1], np.int32), np.zeros(1, np.int32),
                               np.ones(1, np.bool_))
    assert sampler_greedy(logits[0]) == "sampling: the logits contain NaN"


def test_greedy_forward_finds_a_maximum_at_either_end_of_the_vocabulary(tmp_path):
    """Logits made linear in the token id (output norm keeps one channel, output row i = (i + 1) on
    it): the maximum is the last id when that channel is positive, the first when negative, so the
    hook's pieces are read to their last element and from their first."""
    import shutil

    import gguf

    path = make_model("llama", tmp_path / "m.gguf", wtype="F32")
    dst = tmp_path / "linear.gguf"
    shutil.copy(path, dst)
    mm = np.memmap(dst, dtype=np.uint8, mode="r+")
    for t in gguf.GGUFReader(str(dst)).tensors:
        if t.name == "output_norm.weight":
            g = np.zeros(t.n_elements, np.float32)
            g[0] = 1.0
            mm[t.data_offset:t.data_offset + t.n_bytes] = g.view(np.uint8)
        elif t.name == "output.weight":
            n_vocab, n_embd = int(t.shape[1]), int(t.shape[0])
            w = np.zeros((n_vocab, n_embd), np.float32)
            w[:, 0] = np.arange(1, n_vocab + 1)
            mm[t.data_offset:t.data_offset + t.n_bytes] = w.reshape(-1).view(np.uint8)
    mm.flush()
    seen = set()
    for threads in (1, 2, 3):
        plain = Engine.open(dst, n_ctx=64, threads=threads, pin=False)
        greedy = Engine.open(dst, n_ctx=64, threads=threads, pin=False)
        toks = np.arange(3, 43, dtype=np.int32)
        logits = plain.context.forward(toks, np.arange(40, dtype=np.int32), np.zeros(40, np.int32), np.ones(40, np.bool_))
        ids = greedy.context.forward(toks, np.arange(40, dtype=np.int32), np.zeros(40, np.int32), np.ones(40, np.bool_),
                                     greedy=True)
        assert [code_as_sampler(c) for c in ids] == [sampler_greedy(r) for r in logits]
        seen |= set(ids.tolist())
    assert seen == {0, n_vocab - 1}  # both ends were the answer for some rows
