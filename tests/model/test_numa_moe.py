"""NUMA placement of a MoE model on fake 2- and 4-node machines (sysfs_root pointing at a generated
tree, unpinned workers): routed experts sharded by row slices, dense weights interleaved.

What is checked, and against what:
- logits are bitwise identical to the one-node run of the same file (qwen2moe, qwen3moe, Mixtral =
  llama with experts, deepseek2; F32 weights, which are copied into the node arenas, and Q8_0,
  which are repacked there): the partition must not change a single output element;
- each expert matrix is cut into contiguous row slices on multiples of 16 rows, as equal as that
  allows, with no row stored twice (bytes per node add up to the tensors' bytes read by gguf-py);
- each slice's pages are on its node wherever the kernel has that node (move_pages), and where it
  has not (the fake nodes of this machine) the binding is skipped with a stated reason;
- one node keeps today's layout: no slices, no expert copies.

Memory binding to a fake node is impossible (the kernel has no such node): the compute partition
follows the fake topology all the same, which is what makes the identity test meaningful.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from ktd import _native
from ktd.server.engine import Engine
from host_memory import thp_mode
from tiny_models import k_quant_widths

N_TOKENS = 20
ROW_ALIGN = 16  # kNumaRowAlign: a multiple of every repacked row group
PAGE = 4096


def _real_nodes() -> set[int]:
    """Memory nodes the kernel has (mbind accepts only these)."""
    online = Path("/sys/devices/system/node/online")
    return set(_native.parse_cpulist(online.read_text())) if online.exists() else {0}


def _logits(path, threads: int, **placement) -> np.ndarray:
    """Prefill N_TOKENS, then three decode steps: every logit row."""
    e = Engine.open(path, n_ctx=64, threads=threads, pin=False, **placement)
    n_vocab = e.n_vocab
    toks = np.random.default_rng(1).integers(0, n_vocab, N_TOKENS + 3)
    n = N_TOKENS
    out = [e.forward(toks[:n], np.arange(n), np.zeros(n), np.ones(n, bool))]
    for i in range(n, n + 3):
        out.append(e.forward(toks[i:i + 1], np.array([i]), np.zeros(1), np.ones(1, bool)))
    return np.concatenate(out)


@pytest.mark.parametrize("dense", ["interleave", "replicate"])
@pytest.mark.parametrize("n_nodes", [2, 4])
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "llama", "deepseek2"])
def test_logits_identical_to_one_node(tiny_model, fake_numa_machine, arch, wtype, n_nodes, dense):
    path = str(tiny_model(arch, wtype, moe=True))
    one = _logits(path, threads=n_nodes)
    sharded = _logits(path, threads=n_nodes, numa_dense=dense, **fake_numa_machine(n_nodes))
    assert sharded.shape == one.shape
    np.testing.assert_array_equal(sharded, one)


def _dense_matrix_bytes(path) -> int:
    """Bytes of the matrices that are not routed experts (token_embd only when it is the output),
    as prepared: a repacked type's rows padded to whole row groups of the active kernels (a Q8_0
    group is R rows of the same bytes; the AVX-512 layout has R = 16, AVX2 R = 8)."""
    tensors = GGUFReader(path).tensors
    has_output = any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        if len(t.shape) < 2 or t.name.endswith("_exps.weight") or (has_output and t.name == "token_embd.weight"):
            continue
        rows = int(np.prod(t.shape[1:]))
        r = _native.kernels.repack_rows(t.tensor_type.name) if t.tensor_type.name == "Q8_0" else 0
        total += int(t.n_bytes) if r == 0 else -(-rows // r) * r * (int(t.n_bytes) // rows)
    return total


@pytest.mark.parametrize("arch, wtype", [("qwen2moe", "F32"), ("deepseek2", "Q8_0")])
def test_replicate_gives_every_node_a_full_copy(tiny_model, fake_numa_machine, arch, wtype):
    path = str(tiny_model(arch, wtype, moe=True))
    m = _native.Model(path, n_threads=2, pin=False, numa_dense="replicate", **fake_numa_machine(2))
    mem = m.memory
    assert mem["dense_policy"] == "replicate"
    # Q8_0 repacks to the same bytes per row and F32 is copied: each copy is exactly the dense matrices.
    assert [n["dense_copy_bytes"] for n in mem["nodes"]] == [_dense_matrix_bytes(path)] * 2
    if 1 not in _real_nodes():
        assert "copy on node 1: NUMA placement not applied" in mem["dense_note"]
    # Interleave keeps one copy.
    m1 = _native.Model(path, n_threads=2, pin=False, **fake_numa_machine(2))
    assert all(n["dense_copy_bytes"] == 0 for n in m1.memory["nodes"])


@pytest.mark.parametrize("n_nodes", [2, 4])
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "llama"])
def test_k_quant_logits_identical_to_one_node(tiny_model, fake_numa_machine, arch, n_nodes):
    path = str(tiny_model(arch, "Q4_K_M", moe=True, **k_quant_widths(arch)))
    one = _logits(path, threads=n_nodes)
    sharded = _logits(path, threads=n_nodes, **fake_numa_machine(n_nodes))
    np.testing.assert_array_equal(sharded, one)
    m = _native.Model(path, n_threads=n_nodes, pin=False, **fake_numa_machine(n_nodes))
    # 256 rows = 16 blocks of 16: every node holds an equal, non-empty share of every expert.
    nodes = m.memory["nodes"]
    assert len({n["expert_bytes"] for n in nodes}) == 1 and nodes[0]["expert_bytes"] > 0


def test_experts_off_is_identical_too(tiny_model, fake_numa_machine):
    path = str(tiny_model("qwen2moe", "Q8_0"))
    one = _logits(path, threads=2)
    m = _native.Model(path, n_threads=2, pin=False, numa_experts="off", **fake_numa_machine(2))
    assert not m.memory["experts_sharded"]
    assert all(n["expert_bytes"] == 0 for n in m.memory["nodes"])
    off = _logits(path, threads=2, numa_experts="off", **fake_numa_machine(2))
    np.testing.assert_array_equal(off, one)


def _expert_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.endswith("_exps.weight"))


@pytest.mark.parametrize("n_nodes", [2, 4])
@pytest.mark.parametrize("arch, wtype", [("qwen3moe", "F32"), ("deepseek2", "F32"), ("qwen2moe", "Q8_0")])
def test_slices_are_contiguous_aligned_balanced_and_placed(tiny_model, fake_numa_machine, arch, wtype, n_nodes):
    path = str(tiny_model(arch, wtype, moe=True))
    m = _native.Model(path, n_threads=n_nodes, pin=False, **fake_numa_machine(n_nodes))
    mem = m.memory
    assert [n["node"] for n in mem["nodes"]] == list(range(n_nodes))
    assert [n["threads"] for n in mem["nodes"]] == [1] * n_nodes
    assert mem["experts_sharded"] and mem["dense_policy"] == "interleave"
    # F32 does not repack: each slice is a copy of its rows, so the bytes per node add up to the
    # expert tensors' bytes in the file, exactly once (Q8_0 repacked: the same bytes, interleaved).
    assert sum(n["expert_bytes"] for n in mem["nodes"]) == _expert_tensor_bytes(path)

    real = _real_nodes()
    per_node_bytes = [0] * n_nodes
    reader = GGUFReader(path)
    for il in range(m.n_layer):
        for which in ("gate", "up", "down"):
            try:
                stacks = m._expert_slice_ranges(il, which)
            except ValueError:  # a dense leading layer (deepseek2)
                continue
            name = f"blk.{il}.ffn_{which}_exps.weight"
            rows = int(next(t for t in reader.tensors if t.name == name).shape[1])
            blocks = -(-rows // ROW_ALIGN)
            for parts in stacks:
                assert len(parts) == n_nodes
                starts = [p[2] for p in parts]
                counts = [p[3] for p in parts]
                # Contiguous, covering every row once, boundaries on 16-row blocks, as even as
                # whole blocks allow.
                assert starts[0] == 0 and sum(counts) == rows
                assert all(starts[i] + counts[i] == starts[i + 1] for i in range(n_nodes - 1))
                assert all(s % ROW_ALIGN == 0 for s in starts)
                full = [-(-c // ROW_ALIGN) for c in counts]
                assert sum(full) == blocks and max(full) - min(full) <= 1
                for node, (addr, nbytes, _, _) in enumerate(parts):
                    per_node_bytes[node] += nbytes
                    if nbytes == 0:
                        continue
                    on = _native.page_nodes(addr, nbytes, PAGE)
                    if mem["nodes"][node]["bound"]:
                        assert set(on) == {node}, (name, node)
    assert per_node_bytes == [n["expert_bytes"] for n in mem["nodes"]]
    # Binding happens exactly where the kernel has the node; elsewhere it is skipped, with a reason.
    for n in mem["nodes"]:
        assert n["bound"] == (n["node"] in real)
        if not n["bound"]:
            assert "mbind" in n["note"] and "fake topology" in n["note"]
        else:
            assert n["note"] == ""
    # Dense weights (repacked, or copied as they are, into the arena) and token_embd: interleaved
    # over the nodes the kernel has; the others named.
    missing = [i for i in range(n_nodes) if i not in real]
    if missing and mem["dense_bytes"]:
        assert f"no memory on node(s) {','.join(map(str, missing))}" in mem["dense_note"]
    else:
        assert mem["dense_note"] == ""


def _gguf_tensor(path, name):
    from ktd.model.gguf import GGUFFile
    return GGUFFile(str(path), willneed=False).tensors[name]


def test_one_node_keeps_one_arena_and_no_slices(tiny_model):
    path = str(tiny_model("qwen3moe", "Q8_0"))
    m = _native.Model(path, n_threads=2, pin=False)
    mem = m.memory
    assert len(mem["nodes"]) == 1 and not mem["experts_sharded"]
    assert mem["nodes"][0]["expert_bytes"] == 0 and mem["dense_policy"] == "local"
    assert mem["dense_note"] == "" and mem["nodes"][0]["note"] == ""
    # Experts stay one part per matrix, repacked with everything else in the one arena.
    parts = m._expert_slice_ranges(0, "gate")
    assert all(len(p) == 1 and p[0][2] == 0 for p in parts)
    # The one arena is sized for everything it holds, repacked or copied as it is (each matrix
    # rounded up to 64 bytes): here every matrix repacks, and token_embd's lookup rows are copied.
    assert m.copied_bytes == _gguf_tensor(path, "token_embd.weight").nbytes
    assert mem["embd_bytes"] == (m.copied_bytes + 63) // 64 * 64
    assert m.repacked_bytes <= mem["dense_bytes"] < m.repacked_bytes + 64 * 3 * m.n_layer * (m.n_expert + 8)


def test_status_and_log_show_the_layout(tiny_model, fake_numa_machine, caplog):
    path = str(tiny_model("qwen2moe", "Q8_0"))
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(path, n_ctx=32, threads=2, pin=False, **fake_numa_machine(2))
    info = e.info()["numa"]
    assert info["experts"] == "shard" and info["dense"] == "interleave"
    assert [n["node"] for n in info["nodes"]] == [0, 1]
    assert sum(n["expert_bytes"] for n in info["nodes"]) == sum(
        n["expert_bytes"] for n in e.model.memory["nodes"]) > 0
    text = caplog.text
    assert "NUMA: 2 nodes" in text and "sharded by row slices" in text
    if 1 not in _real_nodes():
        assert "NUMA node 1 expert slice: NUMA placement not applied" in text


def test_bad_placement_options_are_named(tiny_model, fake_numa_machine):
    path = str(tiny_model("qwen3moe"))
    with pytest.raises(ValueError, match="numa_experts must be 'shard' or 'off'"):
        _native.Model(path, n_threads=1, pin=False, numa_experts="mirror")
    with pytest.raises(ValueError, match="numa_dense must be 'interleave' or 'replicate'"):
        _native.Model(path, n_threads=1, pin=False, numa_dense="scatter")
    with pytest.raises(ValueError, match="node 5"):
        _native.Model(path, n_threads=2, pin=False, nodes=[5], **fake_numa_machine(2))
    with pytest.raises(ValueError, match="hugepages must be one of"):
        _native.Model(path, n_threads=1, pin=False, hugepages="huge")


def test_node_selection_restricts_the_slices(tiny_model, fake_numa_machine):
    path = str(tiny_model("qwen3moe", "Q8_0"))
    m = _native.Model(path, n_threads=2, pin=False, nodes=[1, 3], **fake_numa_machine(4))
    assert [n["node"] for n in m.memory["nodes"]] == [1, 3]
    assert all(n["expert_bytes"] > 0 for n in m.memory["nodes"])


# ---- the configured huge-page mode reaches the weights arena -------------------------------------

def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def test_hugepages_off_gives_small_pages_and_says_so(tiny_model, caplog):
    path = str(tiny_model("qwen3moe", "Q8_0"))
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(path, n_ctx=32, threads=1, pin=False, hugepages="off")
    mem = e.model.memory
    assert mem["page_kind"] == "normal" and mem["page_size"] == PAGE and mem["page_reason"] == ""
    assert "weights memory (hugepages: off): 4 KiB pages" in caplog.text
    assert e.info()["memory"]["hugepages"]["kind"] == "normal"


def test_hugepages_auto_logs_the_fallback_reason(tiny_model, caplog):
    if _meminfo("HugePages_Free") > 0:
        pytest.skip("this machine has reserved huge pages: auto takes them, there is no fallback to log")
    path = str(tiny_model("qwen3moe", "Q8_0"))
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(path, n_ctx=32, threads=1, pin=False, hugepages="auto")
    mem = e.model.memory
    expected = "thp" if thp_mode() in ("madvise", "always") else "normal"
    assert mem["page_kind"] == expected
    assert "the pool has 0 available" in mem["page_reason"]
    assert "not better because: hugetlb 2 MiB pages" in caplog.text


def test_hugepages_hugetlb_demanded_without_a_pool_fails_with_the_fix(tiny_model):
    if _meminfo("HugePages_Free") > 0:
        pytest.skip("this machine has reserved huge pages: hugetlb succeeds")
    with pytest.raises(_native.ResourceError, match="Reserve at least"):
        _native.Model(str(tiny_model("qwen3moe", "Q8_0")), n_threads=1, pin=False, hugepages="hugetlb")


def test_the_arenas_pages_are_read_back_and_a_small_huge_share_warned(tiny_model, caplog, monkeypatch):
    """info()'s hugepages carry what the kernel gave the arenas (smaps, not the request): every
    prepared byte resident, huge pages none with hugepages off; the load warns when under 90% of the
    resident bytes are on huge pages (a fragmented machine refuses THP at fault time), and not
    when they all are; weights_map: gguf has no arenas."""
    from ktd.server import engine as engine_mod
    path = str(tiny_model("qwen3moe", "Q8_0"))
    e = Engine.open(path, n_ctx=32, threads=1, pin=False, hugepages="off")
    hp = e.info()["memory"]["hugepages"]
    # Independently of smaps: the load's own count of the bytes it wrote into the arenas.
    written = int(e.model.repacked_bytes) + int(e.model.copied_bytes)
    assert written > 0 and hp["resident_bytes"] >= written
    assert hp["huge_bytes"] == 0 and hp["huge_share"] == 0.0
    pages = e.model.arena_pages()
    assert pages["KernelPageSize"] == PAGE and pages["AnonHugePages"] == 0
    g = Engine.open(path, n_ctx=32, threads=1, pin=False, weights_map="gguf")
    assert g.model.arena_pages() == {}
    assert g.info()["memory"]["hugepages"]["huge_share"] is None
    for share, warned in ((0.5, True), (1.0, False)):
        monkeypatch.setattr(engine_mod, "arena_huge_pages",
                            lambda m, s=share: {"resident_bytes": 1 << 30, "huge_bytes": int(s * (1 << 30)),
                                                "huge_share": s})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
            engine_mod.log_memory(e.model, "auto")
        assert ("are on huge pages (50%)" in caplog.text) == warned, caplog.text


# ---- ktd inspect: the plan for this machine's nodes ----------------------------------------------

def test_inspect_numa_plan_splits_expert_bytes_by_row_slices(tiny_model):
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import numa_plan, render, inspect_model

    path = str(tiny_model("deepseek2", "Q8_0"))
    f = GGUFFile(path, willneed=False)
    plan = numa_plan(f, [0, 1, 2])
    assert plan["experts_sharded"] and plan["dense"] == "interleave"
    # Independently: each expert tensor's rows cut into 16-row blocks, block i*blocks//3 onwards.
    expected = [0, 0, 0]
    for t in GGUFReader(path).tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        k, rows, n_mat = (int(d) for d in t.shape)
        blocks = -(-rows // ROW_ALIGN)
        cuts = [min(rows, blocks * i // 3 * ROW_ALIGN) for i in range(4)]
        for i in range(3):
            expected[i] += (cuts[i + 1] - cuts[i]) * (int(t.n_bytes) // (rows * n_mat)) * n_mat
    assert [n["expert_bytes"] for n in plan["nodes"]] == expected
    assert sum(expected) == _expert_tensor_bytes(path)
    one = numa_plan(f, [0])
    assert not one["experts_sharded"] and one["nodes"] == [{"node": 0, "expert_bytes": 0}]
    text = render(inspect_model(path))
    assert "numa plan" in text


# ---- ktd run --config: the same keys, the same path -----------------------------------------------

def test_run_takes_placement_from_a_config_file(tiny_model, tmp_path, capsys, monkeypatch):
    from ktd import cli

    for k in [k for k in os.environ if k.startswith("KTD_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # model.weights_cache auto: not ~/.cache
    path = str(tiny_model("qwen3moe", "Q8_0"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("numa:\n  experts: mirror\n")
    assert cli.main(["run", path, "--prompt", "a", "--max-tokens", "1", "--threads", "1", "--config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "numa.experts: expected one of shard, off" in err and "Traceback" not in err
    if _meminfo("HugePages_Free") == 0:
        # hugetlb demanded through the file reaches the arena: no pool here, a one-line error.
        hugetlb = tmp_path / "hugetlb.yaml"
        hugetlb.write_text("model:\n  hugepages: hugetlb\n")
        rc = cli.main(["run", path, "--prompt", "a", "--max-tokens", "1", "--threads", "1", "--config", str(hugetlb)])
        err = capsys.readouterr().err
        assert rc == 1 and "Reserve at least" in err and "Traceback" not in err
    ok = tmp_path / "ok.yaml"
    ok.write_text("model:\n  hugepages: off\nnuma:\n  experts: off\n")
    assert cli.main(["run", path, "--prompt", "a", "--max-tokens", "2", "--threads", "1", "--config", str(ok)]) == 0
    assert "decode:" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "deepseek2"])
def test_hot_experts_identical_on_both_moe_paths(tiny_model, fake_numa_machine, arch):
    """Held experts (the hybrid's gpu.experts, over the loopback device): on a 2-node machine the
    experts are sharded and a decode step takes moe_ffn's general path, on one node its decode
    path; both leave the held experts to the device and sum the rest in the same order, and the
    loopback device computes a held expert from its NUMA parts as from the whole matrix: the same
    bits."""
    path = str(tiny_model(arch, "F32", moe=True))
    f = GGUFReader(path)
    moe = sorted({int(t.name.split(".")[1]) for t in f.tensors if t.name.endswith("ffn_gate_exps.weight")})
    held = {il: [0, 3] for il in moe}

    def run(**placement) -> np.ndarray:
        e = Engine.open(path, n_ctx=64, threads=2, pin=False, **placement)
        e.context.set_backend("loopback", experts=held)
        toks = np.random.default_rng(1).integers(0, e.n_vocab, N_TOKENS + 3)
        out = [e.forward(toks[:N_TOKENS], np.arange(N_TOKENS), np.zeros(N_TOKENS), np.ones(N_TOKENS, bool))]
        for i in range(N_TOKENS, N_TOKENS + 3):
            out.append(e.forward(toks[i:i + 1], np.array([i]), np.zeros(1), np.ones(1, bool)))
        assert e.context.hybrid_stats()["device_pairs"] > 0
        return np.concatenate(out)

    np.testing.assert_array_equal(run(**fake_numa_machine(2)), run())
