"""The architecture tables (native/src/model/arch.h): every tensor a generated file holds is a row of
its model's table with the file's shape (read with gguf-py, independently of the native reader),
and every row's placement class agrees with the GGUF naming convention llama.cpp uses."""
from __future__ import annotations

import re

import gguf
import pytest

from models.synthetic_moe import make_model as make_moe
from models.tiny_dense import ARCHS as DENSE_ARCHS
from models.tiny_dense import make_model as make_dense

_native = pytest.importorskip("ktd._native", reason="the native module is not built (make build)")

MOE = [("qwen2moe", None), ("qwen3moe", None), ("llama", None), ("deepseek2", "v2"), ("deepseek2", "v2-lite"),
       ("deepseek2", "v3")]


def _expected_class(name: str) -> str:
    """The placement class from the name alone (llama.cpp's tensor naming)."""
    if name == "token_embd.weight":
        return "embedding"
    if name.startswith("output"):
        return "output"
    if re.search(r"_exps\.", name):
        return "routed_expert"
    if re.search(r"_shexp\.", name):
        return "shared_expert"
    if ".ffn_gate_inp." in name or ".exp_probs_b." in name:
        return "router"
    return "dense"


def _check(path) -> None:
    model = _native.Model(str(path), n_threads=1, pin=False)
    rows = {r["name"]: r for r in model.tensor_table}
    for r in rows.values():
        assert r["class"] == _expected_class(r["name"].replace("%d", "0")), r
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        key = re.sub(r"^blk\.\d+\.", "blk.%d.", t.name)
        assert key in rows, f"{t.name} is not in the {model.arch} table"
        want = tuple(int(d) for d in t.shape) + (1,) * (3 - len(t.shape))
        assert rows[key]["shape"] == want, (t.name, rows[key]["shape"], want)
        assert rows[key]["per_layer"] == (key != t.name)


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_dense_table_covers_file(arch, tmp_path):
    _check(make_dense(arch, tmp_path / f"{arch}.gguf"))


@pytest.mark.parametrize("arch,variant", MOE)
def test_moe_table_covers_file(arch, variant, tmp_path):
    _check(make_moe(arch, tmp_path / f"{arch}.gguf", preset="tiny", wtype="F32", variant=variant))


def test_supported_archs_are_the_registered_ones():
    listed = _native.Model.supported_archs().split(", ")
    assert listed == sorted(listed)
    assert set(listed) == {"bitnet", "deepseek2", "gemma3", "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe"}
