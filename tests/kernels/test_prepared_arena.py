"""prepare_weights into a weights arena (native/src/kernels/matmul.cpp): the repacked bytes are
carved from the arena (its smaps readback shows them resident there), with the alignment and size
prepared_bytes promises, and the product is bitwise the one of the heap-prepared weights.
The model's use (one arena per model, sized from prepared_bytes) is covered by loading a real
model with and without repacking."""

from __future__ import annotations

import numpy as np
import pytest

from host_memory import thp_mode
from kernel_inputs import random_k_weights
from kernel_oracle import row_bytes
from ktd import _native

K = _native.kernels
MiB = 1 << 20


def weights(qt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if qt in ("Q4_K", "Q6_K"):
        return random_k_weights(qt, rows, k, rng)
    w = rng.integers(0, 256, size=(rows, row_bytes(qt, k)), dtype=np.uint8)
    w.reshape(-1, 34)[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # Q8_0 d
    return w


@pytest.mark.parametrize("hugepages", ["auto", "thp", "off"])
@pytest.mark.parametrize("qt", ["Q4_K", "Q6_K", "Q8_0"])
def test_repacked_weights_land_in_the_arena(qt, hugepages):
    if hugepages == "thp" and thp_mode() not in ("madvise", "always"):
        pytest.skip(f"THP mode is '{thp_mode()}', not madvise/always")
    rng = np.random.default_rng(4)
    rows, k, n = 1536, 2048, 3  # 3.4-6.3 MiB of repacked weights: more than one 2 MiB page
    w = weights(qt, rows, k, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    info = K.matmul_prepared_in_arena(qt, w, rows, k, x, hugepages=hugepages, threads=2)
    assert info["repacked"]
    assert info["repacked_bytes"] == K.repack(qt, w, rows, k).size
    assert info["prepared_bytes"] == K.prepared_bytes(qt, rows, k)
    assert info["repacked_bytes"] <= info["prepared_bytes"] < info["repacked_bytes"] + 64
    off = info["data_offset"]
    assert off >= 0 and off % 64 == 0
    assert off + info["repacked_bytes"] <= info["arena_used"] <= info["arena_capacity"]
    # The repack wrote every byte, so every page holding them is resident in the arena's mapping.
    smaps = info["smaps"]
    page = 4096 if info["kind"] in ("thp", "normal") else 2 * MiB
    assert smaps["Rss"] >= info["repacked_bytes"] // page * page
    if info["kind"] == "normal":
        assert smaps["AnonHugePages"] == 0
    if hugepages == "off":
        assert info["kind"] == "normal"
    y_heap, repacked = K.matmul_prepared(qt, w, rows, k, x, threads=2)
    assert repacked
    np.testing.assert_array_equal(info["y"].view(np.uint32), y_heap.view(np.uint32))


def test_prepared_bytes_zero_without_repack():
    assert K.prepared_bytes("Q4_K", 17, 512, allow_repack=False) == 0
    assert K.prepared_bytes("F32", 17, 512) == 0
    assert K.prepared_bytes("Q4_K", 17, 512) == 3 * 2 * 8 * 144  # 3 groups of 8 rows, 2 blocks
    with pytest.raises(ValueError):
        K.prepared_bytes("Q4_K", 17, 300)


@pytest.mark.slow
def test_real_model_repacked_matches_plain(real_model):
    """The 1.5B model (Q4_K + Q6_K) loads with its matrices repacked into the arena, and its
    logits match the unrepacked model's within the summation-order tolerance."""
    path = real_model("qwen2.5-coder-1.5b")
    plain = _native.Model(str(path), n_threads=2, allow_repack=False)
    packed = _native.Model(str(path), n_threads=2, allow_repack=True)
    assert plain.repacked_bytes == 0 and packed.repacked_bytes > 0
    tokens = [151644, 872, 198, 7985, 264, 729]
    n = len(tokens)

    def logits(model):
        ctx = _native.Context(model, 64, 1, 64)
        return ctx.forward(np.array(tokens), np.arange(n), np.zeros(n), np.ones(n, bool)).astype(np.float64)

    lp, lr = logits(plain), logits(packed)
    assert np.isfinite(lr).all()
    # Per matmul the two differ only in float32 summation order (~1e-6 relative, tested per
    # kernel); through 28 layers that flips some Q8_K roundings of the activations, so the
    # logits differ at the level test_forward_oracle.py allows against llama.cpp (max 1.0).
    assert (lp.argmax(-1) == lr.argmax(-1)).all()
    assert np.max(np.abs(lp - lr)) < 1.0
    assert np.corrcoef(lp.ravel(), lr.ravel())[0, 1] > 0.999


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                inside = line.rstrip("\n").endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(head[1]) * 1024
    return rss


def test_the_loaded_model_no_longer_maps_its_file(real_model):
    """After the load nothing of the GGUF file is mapped into the process (GGUFFile::detach_data):
    every matrix is repacked or copied into the arena and token_embd's lookup rows are copied too.
    On Qwen2.5-Coder-0.5B (its own output.weight, not tied) every matrix type repacks, so what was
    copied as it is, is token_embd's rows: the figures are checked against the file's tensor table
    read by the Python reader."""
    from ktd.model.gguf import GGUFFile
    path = str(real_model("qwen2.5-coder-0.5b"))
    header = GGUFFile(path, willneed=False)
    embd = header.tensors["token_embd.weight"]
    matrices = [t for t in header.tensors.values() if len(t.shape) >= 2]
    assert "output.weight" in header.tensors  # not tied: token_embd is only looked up
    del header
    model = _native.Model(path, n_threads=2, allow_repack=True)
    assert _mapped_rss(path) == 0
    with open("/proc/self/maps") as f:
        assert not [line for line in f if line.rstrip("\n").endswith(path)]
    assert model.copied_bytes == embd.nbytes
    mem = model.memory
    assert mem["embd_bytes"] == (embd.nbytes + 63) // 64 * 64
    # The dense arena: every other matrix repacked, each rounded up to 64 bytes.
    assert model.repacked_bytes <= mem["dense_bytes"] < model.repacked_bytes + 64 * len(matrices)
    # Without repacking everything is copied as it is: every matrix (token_embd as lookup rows).
    plain = _native.Model(path, n_threads=2, allow_repack=False)
    assert plain.repacked_bytes == 0
    assert plain.copied_bytes == sum(t.nbytes for t in matrices)
    assert sum(t.nbytes for t in matrices) - embd.nbytes <= plain.memory["dense_bytes"] < (
        sum(t.nbytes for t in matrices) - embd.nbytes + 64 * len(matrices))
    assert _mapped_rss(path) == 0


def test_inspect_plans_the_arena_the_load_fills(real_model):
    """ktd inspect's plan (Python, from the tensor table) against the loaded model's figures."""
    from ktd.model.inspect import inspect_model
    path = str(real_model("qwen2.5-coder-0.5b"))
    plan = inspect_model(path)["memory_plan"]
    model = _native.Model(path, n_threads=2, allow_repack=True)
    assert plan["arena_copied_weights"] == model.copied_bytes
    # Repacking keeps every format's size: the plan's bytes are the file's, the model's the layout's.
    assert plan["arena_repacked_weights"] == model.repacked_bytes


@pytest.mark.slow
def test_a_q6_k_output_head_stays_plain_where_it_streams_faster(real_model):
    """The 1.5B's output head is Q6_K. Where the active kernels' plain Q6_K rows stream faster at one
    activation row than their repacked layout (kernels.gemv_plain; no kernel sets it since the Q6_K
    x8 layouts of version 4 and on, which stream as fast as the plain rows), the load copies the head
    as it is and repacks every other matrix (Q6_K ffn_down and attn_v too: prefill's GEMM gains from
    the layout); checked against the file's tensor table read by the Python reader, and ktd
    inspect's plan against the load. The logits stay within the repacked-vs-plain tolerance of
    test_real_model_repacked_matches_plain, which loads the same model."""
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import inspect_model
    path = str(real_model("qwen2.5-coder-1.5b"))
    header = GGUFFile(path, willneed=False)
    head, embd = header.tensors["output.weight"], header.tensors["token_embd.weight"]
    assert head.type_name == "Q6_K"
    others = [t for t in header.tensors.values() if len(t.shape) >= 2 and t.name not in (head.name, embd.name)]
    assert {t.type_name for t in others} == {"Q4_K", "Q6_K"}
    del header
    plain_head = K.gemv_plain("Q6_K")
    assert not K.gemv_plain("Q4_K")
    model = _native.Model(path, n_threads=2, allow_repack=True)
    # Repacking Q4_K/Q6_K keeps the bytes: what is not copied is repacked.
    assert model.copied_bytes == embd.nbytes + (head.nbytes if plain_head else 0)
    assert model.repacked_bytes == sum(t.nbytes for t in others) + (0 if plain_head else head.nbytes)
    plan = inspect_model(path)["memory_plan"]
    assert plan["arena_copied_weights"] == model.copied_bytes
    assert plan["arena_repacked_weights"] == model.repacked_bytes
