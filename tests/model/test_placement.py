"""The hybrid CPU + GPU placement plan (ktd.model.placement, `ktd inspect --vram`), checked against sums
taken independently with gguf-py's reader and llama.cpp's tensor naming."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gguf import GGUFReader

from ktd.model.inspect import inspect_model
from ktd.model.placement import hybrid_plan, parse_size

GiB = 1 << 30


@pytest.mark.parametrize("text, n", [("24G", 24 * GiB), ("24GiB", 24 * GiB), ("16000M", 16000 << 20),
                                     ("1.5G", int(1.5 * GiB)), ("123456", 123456), ("80 GB", 80 * GiB)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "G", "24X", "-1G", "lots"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


@pytest.fixture(scope="module")
def ds2(tiny_model):
    return tiny_model("deepseek2", variant="v2")


def _independent_split(path):
    r = GGUFReader(str(path))
    exps = {t.name: int(t.n_bytes) for t in r.tensors if "_exps" in t.name}
    rest = sum(int(t.n_bytes) for t in r.tensors if "_exps" not in t.name)
    n_expert = int(r.fields["deepseek2.expert_count"].parts[-1][0])
    layers = {name.split(".")[1] for name in exps}
    one_expert_all_layers = sum(b // n_expert for b in exps.values())
    return rest, sum(exps.values()), n_expert, len(layers), one_expert_all_layers


def test_plan_matches_gguf_py(ds2):
    rest, exps, n_expert, n_moe, one = _independent_split(ds2)
    rep = inspect_model(str(ds2), n_ctx=64, n_seq=2, vram=GiB)
    plan, kv = rep["hybrid_plan"], rep["memory_plan"]["kv_cache"]
    assert plan["device"]["weights"] == rest
    assert plan["host"]["routed_experts"] == exps
    assert plan["device"]["total"] == rest + kv + plan["device"]["reserve"]
    assert plan["moe_layers"] == n_moe and plan["fits"]
    assert set(plan["device"]["by_class"]) >= {"embedding", "output", "dense", "router"}


def test_hot_experts_fill_the_budget_and_fixed_counts(ds2):
    rest, exps, n_expert, n_moe, one = _independent_split(ds2)
    rep = inspect_model(str(ds2), n_ctx=64, n_seq=2)
    kv = rep["memory_plan"]["kv_cache"]
    reserve = 1 << 20
    needed = rest + kv + reserve
    budget = needed + 3 * one + one // 2            # room for 3 more experts per layer, not 4
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import placement_classes
    f = GGUFFile(str(ds2))
    classes = placement_classes(f)
    hot = hybrid_plan(f.tensors, classes, n_expert, kv, budget, "hot", reserve_bytes=reserve)
    assert hot["experts_per_layer_on_gpu"] == 3 and hot["fits"]
    assert hot["device"]["routed_experts"] == 3 * one and hot["host"]["routed_experts"] == exps - 3 * one
    four = hybrid_plan(f.tensors, classes, n_expert, kv, budget, 4, reserve_bytes=reserve)
    assert not four["fits"] and "more than the" in four["reason"] and "fewer experts on the GPU" in four["reason"]
    allx = hybrid_plan(f.tensors, classes, n_expert, kv, 1 << 50, "hot", reserve_bytes=reserve)
    assert allx["experts_per_layer_on_gpu"] == n_expert and allx["host"]["routed_experts"] == 0
    with pytest.raises(ValueError, match="experts per layer"):
        hybrid_plan(f.tensors, classes, n_expert, kv, budget, n_expert + 1)


def test_inspect_cli_prints_the_plan_and_refuses_bad_sizes(ds2):
    run = lambda *a: subprocess.run([sys.executable, "-m", "ktd", "inspect", str(ds2), *a],
                                    capture_output=True, text=True)
    ok = run("--vram", "24G", "--gpu-experts", "hot")
    assert ok.returncode == 0 and "hybrid plan (VRAM budget 24.00 GiB): fits" in ok.stdout
    small = run("--vram", "1M", "--n-ctx", "64", "--n-seq", "1")
    assert small.returncode == 0 and "does not fit" in small.stdout and "more than the" in small.stdout
    bad = run("--vram", "2X")
    assert bad.returncode != 0 and "not a size: '2X'" in bad.stderr
