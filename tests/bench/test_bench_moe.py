"""ktd.bench.moe on tiny synthetic models: the bytes a decode call must read come from the file's
tensor sizes, and the next-layer prediction's router (numpy, from the file) reproduces the native
routing when applied to a layer's own recorded input."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from ktd.bench import moe as B


@pytest.fixture(scope="module")
def files(tiny_model):
    out = {arch: tiny_model(arch, "Q8_0") for arch in ("qwen2moe", "qwen3moe")}
    # A leading dense layer, shared experts, MLA.
    out["deepseek2"] = tiny_model("deepseek2", "Q8_0", variant="v2")
    return out


def test_expert_bytes_sum_to_the_expert_tensors(files):
    for path in files.values():
        sizes = B.expert_bytes(str(path))
        r = GGUFReader(str(path))
        total = sum(int(t.n_bytes) for t in r.tensors if "_exps." in t.name)
        assert sizes and total == sum(d["expert"] * d["n_expert"] for d in sizes.values())
        shared = sum(int(t.n_bytes) for t in r.tensors if "_shexp." in t.name and "gate_inp" not in t.name)
        assert shared == sum(d["shared"] for d in sizes.values())


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "deepseek2"])
def test_prediction_pipeline_reproduces_own_layer_routing(files, arch):
    r = B.predict(str(files[arch]), threads=2, n_tokens=12)
    # Q8_0 activations may flip a near-tie; 12 tokens x 2 layers x k slots leave room for one.
    assert r["same_layer"] >= 0.95
    for key in ("before_ffn", "after_ffn", "previous_token"):
        assert 0.0 <= r[key] <= 1.0
    assert r["layer_pairs"] >= 1 and np.isclose(r["random"], r["n_expert_used"] / r["n_expert"])
