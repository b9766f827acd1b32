"""``ktd inspect``: its figures recomputed independently from gguf-py's reader, on synthetic dense
and MoE files and on the real models; corrupt and missing files give one clean error line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_samples import QT, VT, build, kv, tensor_info, gstr, write_sample
from ktd.model.inspect import inspect_model, render

REAL_MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]


def expected_from_reader(path: Path, r: gguf.GGUFReader | None = None) -> dict:
    """The inspect figures, computed from gguf-py's reader with the rule stated in the issue:
    every tensor once per token, routed experts (``*_exps*``) scaled by n_expert_used/n_expert,
    lookup tables (token/position/type embeddings) not at all — except that the token embedding
    is the output head when there is no output.weight. r: gguf-py's reader of path, if at hand."""
    r = r or gguf.GGUFReader(path)

    def value(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    arch = value("general.architecture")
    names = {t.name for t in r.tensors}
    n_expert, n_expert_used = value(f"{arch}.expert_count"), value(f"{arch}.expert_used_count")
    per_token = 0
    for t in r.tensors:
        if "_exps" in t.name:
            per_token += t.n_bytes * n_expert_used // n_expert
        elif t.name == "token_embd.weight":
            per_token += 0 if "output.weight" in names else t.n_bytes
        elif t.name not in ("position_embd.weight", "token_types.weight"):
            per_token += t.n_bytes
    by_type: dict[str, dict[str, int]] = {}
    for t in r.tensors:
        e = by_type.setdefault(t.tensor_type.name, {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += t.n_bytes
    hparams = {}
    for key, f in r.fields.items():
        if key.startswith(arch + "."):
            hparams[key[len(arch) + 1:]] = f.contents()
    tokens = value("tokenizer.ggml.tokens")
    return {
        "file_size": path.stat().st_size,
        "architecture": arch,
        "hyperparameters": hparams,
        "tokenizer": {"model": value("tokenizer.ggml.model"),
                      "vocab_size": None if tokens is None else len(tokens),
                      "chat_template": "tokenizer.chat_template" in r.fields},
        "tensor_count": len(r.tensors),
        "by_type": by_type,
        "bytes_per_token": per_token,
    }


def assert_report_matches(report: dict, expected: dict) -> None:
    assert report["file_size"] == expected["file_size"]
    assert report["architecture"] == expected["architecture"]
    assert report["hyperparameters"] == expected["hyperparameters"]
    assert report["tokenizer"] == expected["tokenizer"]
    assert report["tensors"]["count"] == expected["tensor_count"]
    assert report["tensors"]["by_type"] == expected["by_type"]
    assert report["tensors"]["bytes"] == sum(e["bytes"] for e in expected["by_type"].values())
    assert report["bytes_per_token"]["total"] == expected["bytes_per_token"]


def run_ktd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktd", *args], capture_output=True, text=True, timeout=300)


def write_moe(path: Path, *, tied: bool = False, expert_keys: bool = True) -> Path:
    """A tiny Qwen2-MoE-shaped model: 2 layers, 8 experts of which 2 are used, a shared expert."""
    n_embd, n_ff, n_expert, n_vocab = 32, 64, 8, 50
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), arch="qwen2moe")
    w.add_block_count(2)
    w.add_embedding_length(n_embd)
    w.add_context_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if expert_keys:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_chat_template("{{ messages }}")

    def f32(*shape):  # numpy shape: the reverse of GGML's
        return rng.standard_normal(shape).astype(np.float32)

    w.add_tensor("token_embd.weight", f32(n_vocab, n_embd))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", f32(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", f32(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", f32(n_expert, n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", f32(n_expert, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", f32(n_expert, n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", f32(n_expert, n_embd, n_ff))
        w.add_tensor(f"blk.{i}.ffn_up_shexp.weight", f32(n_ff, n_embd))
    if not tied:
        w.add_tensor("output.weight", f32(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- synthetic files --------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_moe_bytes_per_token(tmp_path, tied):
    path = write_moe(tmp_path / "moe.gguf", tied=tied)
    report = inspect_model(str(path))
    assert_report_matches(report, expected_from_reader(path))
    b = report["bytes_per_token"]
    assert (b["n_expert"], b["n_expert_used"]) == (8, 2)
    expert_bytes = 2 * 3 * 8 * 32 * 64 * 4  # layers × matrices × experts × n_embd × n_ff × 4 B
    assert b["routed_experts_all"] == expert_bytes and b["routed_experts"] == expert_bytes // 4
    assert b["output_head_tensor"] == ("token_embd.weight" if tied else "output.weight")
    assert b["output_head"] == 50 * 32 * 4
    assert report["tokenizer"] == {"model": "gpt2", "vocab_size": 50, "chat_template": True}
    assert report["hyperparameters"]["expert_count"] == 8


def test_dense_sample(tmp_path):
    path = write_sample(tmp_path / "s.gguf")
    report = inspect_model(str(path))
    assert_report_matches(report, expected_from_reader(path))
    assert report["tokenizer"] == {"model": None, "vocab_size": None, "chat_template": False}
    json.dumps(report)  # plain data


def test_cli_json_and_text(tmp_path):
    from ktd import _native

    path = write_moe(tmp_path / "moe.gguf")
    # The machine section holds the process's decode prefetch state, which this process's earlier
    # decode steps may have tuned: back to the CPU default a fresh process starts with.
    _native.kernels.set_decode_prefetch(-1)
    r = run_ktd("inspect", "--json", str(path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(inspect_model(str(path))))
    r = run_ktd("inspect", str(path))
    assert r.returncode == 0, r.stderr
    report = inspect_model(str(path))
    assert r.stdout.strip() == render(report)
    assert f"{report['bytes_per_token']['total']:,} B" in r.stdout
    assert "2 of 8 experts" in r.stdout


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    good = write_sample(tmp_path / "good.gguf").read_bytes()
    files = {
        "not_gguf": b"hello, this is not a model\n",
        "empty": b"",
        "truncated": good[: len(good) // 3],
        "tensor_past_end": good[: len(good) - 200],
        "bad_version": good[:4] + struct.pack("<I", 99) + good[8:],
        "arch_not_string": build([kv("general.architecture", VT.UINT32, struct.pack("<I", 1))], []),
        "dim_zero": build([], [tensor_info("blk.0.attn_q.weight", [4, 0], QT.F32, 0)], b"\0" * 64),
        "tokens_not_strings": build([kv("tokenizer.ggml.tokens", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 1) + b"\0")], []),
        "arch_bad_count": build([kv("general.architecture", VT.STRING, gstr("qwen2moe")),
                                 kv("qwen2moe.expert_count", VT.STRING, gstr("eight")),
                                 kv("qwen2moe.expert_used_count", VT.UINT32, struct.pack("<I", 2))],
                                [tensor_info("blk.0.ffn_up_exps.weight", [32, 8], QT.F32, 0)], b"\0" * 1024),
    }
    out = {}
    for name, blob in files.items():
        out[name] = tmp_path / f"{name}.gguf"
        out[name].write_bytes(blob)
    out["moe_without_expert_count"] = write_moe(tmp_path / "moe_nokeys.gguf", expert_keys=False)
    out["missing"] = tmp_path / "does-not-exist.gguf"
    out["directory"] = tmp_path
    return out


def test_cli_bad_files_give_one_clean_line(tmp_path):
    for name, path in _bad_files(tmp_path).items():
        r = run_ktd("inspect", str(path))
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert r.stdout == "", name
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ktd: error: "), (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert str(path) in lines[0], (name, lines[0])  # names the file


# --- the real models --------------------------------------------------------------------------


@pytest.mark.slow  # gguf-py's reader takes tens of seconds on a 150k-token vocabulary
@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_figures_agree_with_gguf_py(real_model, real_model_reader, name):
    path = real_model(name)
    expected = expected_from_reader(path, real_model_reader(name))
    r = run_ktd("inspect", "--json", str(path))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert_report_matches(report, expected)
    text = run_ktd("inspect", str(path)).stdout
    assert f"{expected['bytes_per_token']:,} B" in text and f"{expected['file_size']:,} B" in text
    if name == "gemma-3-270m":  # tied embeddings: the embedding table is the output head
        assert report["bytes_per_token"]["output_head_tensor"] == "token_embd.weight"
    else:
        assert report["bytes_per_token"]["output_head_tensor"] == "output.weight"


def test_machine_section_is_this_machine(tmp_path):
    from ktd.ops import machine
    report = inspect_model(str(write_sample(tmp_path / "s.gguf")))
    # Independent facts: the CPUs this process may run on, and the THP mode from sysfs.
    assert report["machine"]["topology"]["usable_cpus"] == sorted(os.sched_getaffinity(0))
    text = render(report)
    for line in machine.summary_lines(report["machine"]):
        assert line in text


def _write_plan_model(path: Path, *, mla: bool) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if mla:
        w.add_uint32("llama.attention.kv_lora_rank", 32)
        w.add_uint32("llama.rope.dimension_count", 8)
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("mla", [False, True])
def test_memory_plan(tmp_path, mla):
    path = _write_plan_model(tmp_path / "plan.gguf", mla=mla)
    plan = inspect_model(str(path), n_ctx=100, n_seq=2)["memory_plan"]
    # 3 layers x 2 KV heads x (K 16 + V 16) x 2 B (F16); MLA: 3 layers x (latent 32 + rope 8) x 2 B.
    per_token = 3 * (32 + 8) * 2 if mla else 3 * 2 * (16 + 16) * 2
    assert plan["kv_bytes_per_token"] == per_token
    assert plan["kv_cache"] == per_token * 100 * 2
    # Q8_0 has a row-interleaved layout: its 16 x 64 matrix (16 rows x 2 blocks x 34 B) goes to the arena.
    assert plan["arena_repacked_weights"] == 16 * 2 * 34
    assert plan["arena_copied_weights"] == 0  # no other matrix, no token_embd
    assert plan["arena_hugepages_2M"] == 1
    assert plan["mapped_file"] == path.stat().st_size
    assert plan["unsupported_types"] == []


def test_placement_classes_from_the_table_and_from_names(tmp_path):
    """A file the engine runs gets its classes from the architecture's table, a file it cannot run
    (here: a partial qwen2moe without feed_forward_length) from the names; both agree with
    llama.cpp's naming, and the report's per-class bytes add up to the file's."""
    from ktd import _native
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import class_from_name, placement_classes
    from models.synthetic_moe import make_model

    full = make_model("qwen2moe", tmp_path / "full.gguf", preset="tiny", wtype="F32")
    partial = write_moe(tmp_path / "partial.gguf")
    assert _native.Model.tensor_classes(str(full))  # the table path is taken
    with pytest.raises(_native.GGUFError):
        _native.Model.tensor_classes(str(partial))  # the naming path is taken
    for path in (full, partial):
        r = gguf.GGUFReader(str(path))
        classes = placement_classes(GGUFFile(str(path), willneed=False))
        assert classes == {t.name: class_from_name(t.name) for t in r.tensors}
        assert {"routed_expert", "router", "shared_expert", "embedding"} <= set(classes.values())
        report = inspect_model(str(path))
        by_class = report["tensors"]["by_class"]
        assert sum(e["bytes"] for e in by_class.values()) == sum(int(t.n_bytes) for t in r.tensors)
        assert by_class["routed_expert"]["bytes"] == report["bytes_per_token"]["routed_experts_all"]


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("variant", [None, "tied"])
def test_memory_plan_arena_bytes_match_the_load(tmp_path, wtype, variant):
    """The plan's arena bytes are what the native load prepares (Model.copied_bytes/repacked_bytes),
    tied heads included: a tied head is a prepared copy of token_embd besides its lookup rows,
    repacked where the type repacks, copied plain where it has no repacked layout (F32, F16)."""
    from ktd import _native
    from models.tiny_dense import make_model
    path = make_model("qwen2", tmp_path / f"q2-{wtype}-{variant}.gguf", wtype=wtype, variant=variant)
    plan = inspect_model(str(path))["memory_plan"]
    model = _native.Model(str(path), n_threads=1, allow_repack=True)
    assert (plan["arena_copied_weights"], plan["arena_repacked_weights"]) == (model.copied_bytes, model.repacked_bytes)


@pytest.mark.parametrize("wtype,variant", [("Q8_0", None), ("F16", "tied"), ("Q4_0", None)])
def test_memory_plan_weights_map_gguf_matches_the_load(tmp_path, wtype, variant):
    """model.weights_map: gguf: the plan's bytes served from the file and copied are what the native
    load serves (memory file_bytes) and copies, and nothing is repacked; the text says so."""
    from ktd import _native
    from models.tiny_dense import make_model
    path = make_model("qwen2", tmp_path / f"q2-{wtype}-{variant}.gguf", wtype=wtype, variant=variant)
    report = inspect_model(str(path), weights_map="gguf")
    plan = report["memory_plan"]
    model = _native.Model(str(path), n_threads=1, weights_map="gguf")
    assert plan["weights_map"] == "gguf" and model.memory["weights_map"] == "gguf"
    assert (plan["file_served_weights"], plan["arena_copied_weights"], plan["arena_repacked_weights"]) == \
        (model.memory["file_bytes"], model.copied_bytes, model.repacked_bytes)
    assert plan["file_served_weights"] > 0
    text = render(report)
    assert "model.weights_map: gguf" in text and "served from file" in text and "weights arena" not in text
    arena = inspect_model(str(path), weights_map="arena")
    assert arena["memory_plan"]["file_served_weights"] == 0 and "weights arena" in render(arena)


def test_inspect_cli_takes_weights_map_from_config(tmp_path):
    from models.tiny_dense import make_model
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    cfg = tmp_path / "ktd.yaml"
    cfg.write_text("model:\n  weights_map: gguf\n")
    out = run_ktd("inspect", str(path), "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory_plan"]["weights_map"] == "gguf"
