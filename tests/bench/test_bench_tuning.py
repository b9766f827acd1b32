"""The benchmarks' untimed decode steps (ktd.bench.finish_decode_prefetch_tuning and
finish_tuning_greedy): they run one-row forwards until the x86 decode prefetch tuning
(native/src/kernels/kernels.h) is over, so that no benchmark times it. On aarch64 nothing tunes:
one step, then they stop (this file is in the arm64 CI lists, tools/arm64/test-arm64.sh)."""

from __future__ import annotations

import platform

import numpy as np

from ktd import _native

K = _native.kernels


def test_benchmarks_finish_the_tuning_before_timing(tmp_path, restore_decode_prefetch):
    """ktd.bench.finish_decode_prefetch_tuning (the benchmarks run it before their timed steps, most
    through finish_tuning_greedy): on x86 it runs one-row forwards until the tuning has taken all its steps (27) and the
    mode is tuned, then none; with the mode fixed, none; where nothing tunes (aarch64), one step and
    it stops."""
    from models import tiny_dense
    from ktd.bench import finish_decode_prefetch_tuning
    from ktd.server.engine import Engine

    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    eng = Engine.open(str(path), n_ctx=64, n_seq_max=1, threads=1)
    pos = [0]

    def step() -> None:
        eng.forward(np.array([40 + pos[0] % 8]), np.array([pos[0]]), np.zeros(1), np.ones(1, bool))
        pos[0] += 1

    K.set_decode_prefetch(-1)
    x86 = platform.machine() in ("x86_64", "AMD64")
    assert K.DECODE_PREFETCH_TUNE_STEPS == 3 * 9
    assert finish_decode_prefetch_tuning(step) == (K.DECODE_PREFETCH_TUNE_STEPS if x86 else 1)
    assert K.decode_prefetch_state()["source"] == ("tuned" if x86 else "default")
    assert finish_decode_prefetch_tuning(step) == (0 if x86 else 1)
    K.set_decode_prefetch(1)
    assert finish_decode_prefetch_tuning(step) == 0
    assert pos[0] == (K.DECODE_PREFETCH_TUNE_STEPS if x86 else 2)


def test_greedy_tuning_steps_continue_the_sequence(tmp_path, restore_decode_prefetch):
    """ktd.bench.finish_tuning_greedy (bench.decode, bench.e2e and bench.daemon finish the tuning
    with it): its steps are greedy one-row forwards of the sequence from the token and position
    given, and it returns how many ran and where the sequence goes on — the same tokens as a plain
    greedy loop over the same positions with the setting fixed (the sums do not depend on it)."""
    from models import tiny_dense
    from ktd.bench import finish_tuning_greedy
    from ktd.server.engine import Engine

    path = tiny_dense.make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    eng = Engine.open(str(path), n_ctx=64, n_seq_max=1, threads=1)
    K.set_decode_prefetch(-1)
    x86 = platform.machine() in ("x86_64", "AMD64")
    ran, token, pos = finish_tuning_greedy(eng, 41, 0)
    assert ran == (K.DECODE_PREFETCH_TUNE_STEPS if x86 else 1) and pos == ran

    eng.free_seq(0)
    K.set_decode_prefetch(0)
    t, seen = 41, []
    for p in range(ran):
        logits = eng.forward(np.array([t]), np.array([p]), np.zeros(1), np.ones(1, bool))
        t = int(np.argmax(logits[0]))
        seen.append(t)
    assert token == t
    assert len(set(seen)) > 1 or ran == 1  # the tiny model's greedy tokens change: not a constant fed back
    assert finish_tuning_greedy(eng, token, pos)[0] == 0  # fixed: nothing to finish
