"""The hybrid CPU + accelerator forward with the accelerator played by the CPU ("loopback",
native/src/model/hybrid_backend.h): per MoE layer the normed hidden state goes to the host, the
routed experts run on the CPU pool while the device's stream computes the shared expert, and the
routed sum comes back and is added. Checked against the plain CPU forward on tiny models of every
MoE architecture (and a dense one): the split changes no bit — the shared expert's output is
computed by the same kernels and added last in both, and float addition of two terms commutes —
and only activations cross: n_embd floats per token each way per MoE layer."""

from __future__ import annotations

import numpy as np
import pytest

from ktd.server.engine import Engine
from ktd.model.gguf import GGUFFile
from models import synthetic_moe, tiny_dense

CASES = [("qwen2moe", None), ("qwen3moe", None), ("llama", None), ("deepseek2", "v2"), ("deepseek2", "v3")]


def _forward_all(eng: Engine) -> np.ndarray:
    outs = [eng.forward(np.arange(7) + 40, np.arange(7), np.zeros(7), np.ones(7, bool))]   # prefill
    token = int(np.argmax(outs[0][-1]))
    for i in range(4):                                                                        # decode
        outs.append(eng.forward(np.array([token]), np.array([7 + i]), np.zeros(1), np.ones(1, bool)))
        token = int(np.argmax(outs[-1][0]))
    return np.concatenate([o.ravel() for o in outs])


def _moe_layers(path) -> tuple[int, int]:
    f = GGUFFile(str(path))
    arch = f.metadata["general.architecture"]
    arch = arch.decode() if isinstance(arch, bytes) else arch
    n_layer = int(f.metadata[f"{arch}.block_count"])
    moe = sum(1 for il in range(n_layer) if f"blk.{il}.ffn_gate_exps.weight" in f.tensors)
    return moe, int(f.metadata[f"{arch}.embedding_length"])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch, variant", CASES)
def test_loopback_hybrid_matches_the_cpu_forward(arch, variant, threads, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    synthetic_moe.make_model(arch, path, variant=variant)
    cpu = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=threads)
    want = _forward_all(cpu)
    hyb = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=threads)
    hyb.context.set_backend("loopback")
    assert hyb.context.backend == "loopback"
    got = _forward_all(hyb)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # The routing statistics are the host's, counted as on the CPU path.
    np.testing.assert_array_equal(hyb.context.expert_counts(), cpu.context.expert_counts())
    n_moe, E = _moe_layers(path)
    tokens = 7 + 4
    st = hyb.context.hybrid_stats()
    assert n_moe > 0
    assert st["moe_calls"] == n_moe * 5                      # 5 forwards
    assert st["bytes_to_host"] == st["bytes_to_device"] == n_moe * tokens * E * 4
    # the time breakdown is recorded: the routed experts ran on the host in every MoE call
    assert st["host_experts_ns"] > 0 and st["to_host_ns"] > 0 and st["from_host_ns"] > 0
    assert st["sync_wait_ns"] >= 0


def test_dense_model_on_the_loopback_backend_is_the_cpu_forward(tmp_path):
    path = tmp_path / "llama.gguf"
    tiny_dense.make_model("llama", path)
    cpu = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    hyb = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    hyb.context.set_backend("loopback")
    np.testing.assert_array_equal(_forward_all(hyb), _forward_all(cpu))
    assert hyb.context.hybrid_stats() == {"bytes_to_host": 0, "bytes_to_device": 0, "moe_calls": 0, "to_host_ns": 0,
                                          "host_experts_ns": 0, "sync_wait_ns": 0, "from_host_ns": 0,
                                          "device_layers": 2, "routed_pairs": 0, "device_pairs": 0,
                                          "early_launches": 0}


def _n_layer(path) -> int:
    f = GGUFFile(str(path))
    arch = f.metadata["general.architecture"]
    arch = arch.decode() if isinstance(arch, bytes) else arch
    return int(f.metadata[f"{arch}.block_count"])


# gpu.layers: the first `layers` layers through the hybrid data flow, the rest on the CPU backend.
@pytest.mark.parametrize("arch, variant", CASES + [("gemma3", None), ("bitnet", None)])
def test_a_layer_split_matches_the_cpu_forward(arch, variant, tmp_path):
    """Every split point of every architecture (MoE ones, deepseek2 with a leading dense layer,
    gemma3's sliding-window layers, bitnet) gives the CPU forward's logits bit for bit; the MoE
    layers before the split cross as activations, the residual crosses once per chunk at the
    split, and the layers after it run the CPU's MoE (no copies)."""
    path = tmp_path / f"{arch}.gguf"
    if arch in ("gemma3", "bitnet"):
        tiny_dense.make_model(arch, path)
    else:
        synthetic_moe.make_model(arch, path, variant=variant)
    n_layer = _n_layer(path)
    want = _forward_all(Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2))
    f = GGUFFile(str(path))
    moe_at = [f"blk.{il}.ffn_gate_exps.weight" in f.tensors for il in range(n_layer)]
    E = _moe_layers(path)[1]
    for layers in range(1, n_layer):
        hyb = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
        hyb.context.set_backend("loopback", layers=layers)
        hyb.context.set_profiling(layers == 1)  # timing the blocks changes no bit, across the layer switch too
        got = _forward_all(hyb)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        st = hyb.context.hybrid_stats()
        n_moe = sum(moe_at[:layers])
        tokens = 7 + 4
        assert st["device_layers"] == layers
        assert st["moe_calls"] == n_moe * 5                   # 5 forwards
        assert st["bytes_to_device"] == n_moe * tokens * E * 4
        assert st["bytes_to_host"] == (n_moe + 1) * tokens * E * 4


def test_layers_out_of_range_are_refused(tmp_path):
    path = tmp_path / "q.gguf"
    synthetic_moe.make_model("qwen3moe", path)
    n_layer = _n_layer(path)
    eng = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    for bad in (-1, n_layer + 1):
        with pytest.raises(ValueError, match=f"device layers {bad} outside \\[0, {n_layer}\\]"):
            eng.context.set_backend("loopback", layers=bad)
        assert eng.context.backend == "cpu"
    # n_layer is every layer, as 0 is
    eng.context.set_backend("loopback", layers=n_layer)
    _forward_all(eng)
    assert eng.context.hybrid_stats()["device_layers"] == n_layer


def _held_cases(path) -> tuple[list[int], int, list[dict[int, list[int]]]]:
    f = GGUFFile(str(path))
    arch = f.metadata["general.architecture"]
    arch = arch.decode() if isinstance(arch, bytes) else arch
    n_expert = int(f.metadata[f"{arch}.expert_count"])
    moe = [il for il in range(_n_layer(path)) if f"blk.{il}.ffn_gate_exps.weight" in f.tensors]
    # three experts of every MoE layer (different ones per layer), then every expert of the first
    return moe, n_expert, [{il: [(il + j) % n_expert for j in (0, 2, 5)] for il in moe},
                           {moe[0]: list(range(n_expert))}]


# gpu.experts: the device holds some routed experts and computes the pairs routed to them.
@pytest.mark.parametrize("arch, variant", CASES)
def test_hot_experts_held_by_the_device_match_the_cpu_forward(arch, variant, tmp_path):
    """The host routes every token and computes the experts the device does not hold; the device
    adds the held ones after the shared expert. Not bit-identical (the sum's order changes), within
    float rounding: measured up to 1e-5 of the largest logit; the routing is the CPU's (the expert
    statistics are identical) and device_pairs are exactly the pairs those statistics give the held
    experts."""
    path = tmp_path / f"{arch}.gguf"
    synthetic_moe.make_model(arch, path, variant=variant)
    cpu = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    want = _forward_all(cpu)
    counts = np.asarray(cpu.context.expert_counts()).reshape(_n_layer(path), -1)
    moe, n_expert, cases = _held_cases(path)
    for held in cases:
        hyb = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
        hyb.context.set_backend("loopback", experts=held)
        got = _forward_all(hyb)
        assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
        np.testing.assert_array_equal(hyb.context.expert_counts(), cpu.context.expert_counts())
        st = hyb.context.hybrid_stats()
        assert st["routed_pairs"] == int(counts.sum())
        assert st["device_pairs"] == sum(int(counts[il, es].sum()) for il, es in held.items())
        # the pairs went to the device from inside the host's MoE call, once routed: in every call
        # that had any (all of them when one layer's every expert is held)
        assert 0 < st["early_launches"] <= st["moe_calls"]
        if len(held) == 1:
            assert st["early_launches"] == st["moe_calls"] // len(moe)


def test_held_experts_out_of_place_are_refused(tmp_path):
    path = tmp_path / "ds.gguf"
    synthetic_moe.make_model("deepseek2", path, variant="v3")   # layer 0 dense
    moe, n_expert, _ = _held_cases(path)
    eng = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    for held, layers, why in [({0: [1]}, 0, "hot experts of layer 0: not a MoE layer"),
                              ({moe[0]: [n_expert]}, 0, f"expert {n_expert} outside \\[0, {n_expert}\\)"),
                              ({moe[-1]: [0]}, moe[-1], f"layer {moe[-1]}: the layer is not on the device"),
                              ({99: [0]}, 0, "layer 99 out of range")]:
        with pytest.raises(ValueError, match=why):
            eng.context.set_backend("loopback", layers=layers, experts=held)
        assert eng.context.backend == "cpu"


def test_backend_switch_and_bad_name(tmp_path):
    path = tmp_path / "q.gguf"
    synthetic_moe.make_model("qwen2moe", path)
    eng = Engine.open(str(path), n_ctx=32, n_seq_max=1, threads=2)
    assert eng.context.backend == "cpu"
    with pytest.raises(ValueError, match="unknown backend 'cuda9'"):
        eng.context.set_backend("cuda9")
    assert eng.context.backend == "cpu"
    eng.context.set_backend("loopback")
    eng.context.set_profiling(True)        # the blocks are timed whichever backend is current
    _forward_all(eng)
    assert eng.context.profile()["moe_ffn"][1] > 0
    eng.context.set_backend("cpu")
    assert eng.context.hybrid_stats()["moe_calls"] == 0
