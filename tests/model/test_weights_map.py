"""model.weights_map: gguf (native/src/model/model_load.cpp, WeightLoader::serve): every matrix and
token_embd is served in its plain GGUF layout from the file's own read-only mapping, nothing
repacked or copied. Compared with the arena path without repacking (allow_repack=False: the same
plain rows, copied into an arena), the logits are bit-identical for every architecture family;
the bytes served are the file's matrix bytes as gguf-py reads them; the matrices' addresses lie
in the file's mapping (/proc/self/maps); the model keeps serving after the file is unlinked; a file
whose data is not aligned as the plain kernels read it is copied (and said so); several NUMA
nodes fall back to the arenas with the reason; no weights-cache entry is read or written; the
config key is validated; status and the load log show the map."""

from __future__ import annotations

import logging
import os
import resource

import gguf
import numpy as np
import pytest

from engine_probes import file_ranges, greedy_in_process, model_logits
from ktd import _native
from ktd.ops import config as ktd_config
from ktd.server.engine import Engine, placement_options
from ktd.server.weights import WeightsManager
from models import synthetic_moe as S
from models import tiny_dense
from models.tiny_dense import make_model

GREEDY_TOKENS = 8  # what the daemon test streams and compares


def _matrix_bytes(path) -> int:
    """gguf-py: the bytes of every tensor of two or more dimensions (matrices, expert stacks and
    token_embd, which the lookup reads row by row): what gguf serves from the file."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) >= 2)


CASES = [("llama", "Q8_0", None), ("qwen2", "F16", "tied"), ("qwen3", "Q4_0", None), ("gemma3", "Q5_0", None),
         ("llama", "F32", None), ("qwen3moe", "Q8_0", None), ("deepseek2", "Q8_0", None)]


def _make(tmp_path, arch, wtype, variant):
    if arch in ("qwen3moe", "deepseek2"):
        return S.make_model(arch, tmp_path / f"{arch}.gguf", wtype=wtype)
    return make_model(arch, tmp_path / f"{arch}.gguf", wtype=wtype, variant=variant)


@pytest.mark.parametrize("arch,wtype,variant", CASES, ids=[f"{a}-{w}{'-' + v if v else ''}" for a, w, v in CASES])
def test_gguf_serves_the_plain_rows_bit_identically(tmp_path, arch, wtype, variant):
    path = _make(tmp_path, arch, wtype, variant)
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    served = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf")
    mem = served.memory
    assert mem["weights_map"] == "gguf" and mem["weights_map_note"] == "" and mem["file_copy_note"] == ""
    assert plain.memory["weights_map"] == "arena" and plain.memory["file_bytes"] == 0
    # Nothing prepared: no arena, no byte repacked or copied; every matrix byte read from the file.
    assert served.repacked_bytes == 0 and served.copied_bytes == 0
    assert mem["dense_bytes"] == 0 and mem["embd_bytes"] == 0 and mem["page_kind"] == ""
    assert mem["file_bytes"] == _matrix_bytes(path)
    np.testing.assert_array_equal(model_logits(served).view(np.uint32), model_logits(plain).view(np.uint32))


def test_gguf_experts_are_read_from_the_file_mapping(tmp_path):
    path = S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0")
    served = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf")
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    ranges = file_ranges(path)
    assert ranges, "the file is not mapped"

    def in_file(addr, n):
        return any(lo <= addr and addr + n <= hi for lo, hi in ranges)

    for which in ("gate", "up", "down"):
        for parts in served._expert_slice_ranges(1, which):
            assert all(in_file(addr, n) for addr, n, _, _ in parts)
        for parts in plain._expert_slice_ranges(1, which):  # the arena's copy: not the file
            assert not any(in_file(addr, n) for addr, n, _, _ in parts)


def test_gguf_keeps_serving_after_the_file_is_unlinked(tmp_path):
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    expected = model_logits(_native.Model(str(path), n_threads=2, pin=False, allow_repack=False))
    served = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf")
    ino = os.stat(path).st_ino
    os.unlink(path)
    # The mapping holds the (deleted) file: the kernel still lists it.
    with open("/proc/self/maps") as f:
        assert any(line.split()[4] == str(ino) and line.rstrip().endswith("(deleted)") for line in f
                   if len(line.split()) >= 6)
    np.testing.assert_array_equal(model_logits(served).view(np.uint32), expected.view(np.uint32))


class _Align1Writer(gguf.GGUFWriter):
    """general.alignment 1: the tensor data starts right after the tensor infos, at whatever byte."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.add_custom_alignment(1)


def test_gguf_copies_tensors_the_plain_kernels_cannot_read_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_dense, "GGUFWriter", _Align1Writer)
    for seed in range(8):  # a name length that puts the data at an odd byte
        path = make_model("llama", tmp_path / f"m{seed}.gguf", wtype="Q8_0", seed=seed)
        r = gguf.GGUFReader(str(path))
        if r.data_offset % 2:
            break
        os.unlink(path)
    else:
        pytest.fail("no seed put the tensor data at an odd offset")
    assert r.alignment == 1
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    served = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf")
    mem = served.memory
    assert mem["weights_map"] == "gguf"
    # Q8_0 blocks (fp16 scale) need 2-byte alignment, F32 4: every matrix and token_embd copied.
    assert mem["file_bytes"] == 0 and served.copied_bytes == _matrix_bytes(path)
    assert "general.alignment 1" in mem["file_copy_note"]
    for t in r.tensors:
        if len(t.shape) >= 2:
            assert t.name in mem["file_copy_note"]
    np.testing.assert_array_equal(model_logits(served).view(np.uint32), model_logits(plain).view(np.uint32))


def test_gguf_on_several_numa_nodes_falls_back_to_the_arenas(tmp_path, fake_numa_machine):
    path = S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0")
    served = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf", **fake_numa_machine(2))
    arena = _native.Model(str(path), n_threads=2, pin=False, **fake_numa_machine(2))
    mem = served.memory
    assert mem["weights_map"] == "arena" and mem["file_bytes"] == 0
    assert "one NUMA node" in mem["weights_map_note"] and "2 (0,1)" in mem["weights_map_note"]
    assert mem["experts_sharded"] and served.repacked_bytes == arena.repacked_bytes > 0
    np.testing.assert_array_equal(model_logits(served).view(np.uint32), model_logits(arena).view(np.uint32))


def test_gguf_neither_reads_nor_writes_the_weights_cache(tmp_path, caplog):
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    cache = tmp_path / "cache"
    cache.mkdir()
    Engine.open(str(path), n_ctx=32, threads=2, pin=False, weights_cache=str(cache))  # writes an entry
    entries = sorted(p.name for p in cache.iterdir())
    assert any(n.endswith(".ktdw") for n in entries)
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(str(path), n_ctx=32, threads=2, pin=False, weights_cache=str(cache), weights_map="gguf")
    c = e.model.cache
    assert c["state"] == "off" and "weights_map: gguf" in c["reason"]
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new, nothing removed
    assert "weights_map: gguf" in caplog.text
    info = e.info()["memory"]
    assert info["weights_map"] == "gguf" and info["file_mapped_bytes"] == _matrix_bytes(path)


def test_status_and_log_show_the_map(tmp_path, caplog):
    path = make_model("qwen2", tmp_path / "m.gguf", wtype="Q8_0", variant="tied")
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(str(path), n_ctx=32, threads=2, pin=False, weights_map="gguf")
    info = e.info()["memory"]
    assert info == {**info, "weights_map": "gguf", "file_mapped_bytes": _matrix_bytes(path),
                    "weights_map_note": "", "file_copy_note": ""}
    assert "weights map: gguf" in caplog.text and "served from the model file" in caplog.text
    a = Engine.open(str(path), n_ctx=32, threads=2, pin=False).info()["memory"]
    assert a["weights_map"] == "arena" and a["file_mapped_bytes"] == 0


def test_gguf_mlock_locks_the_file_pages(tmp_path):
    path = make_model("llama", tmp_path / "m.gguf", wtype="F32")
    size = os.path.getsize(path)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < 4 * size:
        pytest.skip(f"RLIMIT_MEMLOCK {soft} bytes is below 4x the {size}-byte model")

    def locked_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))

    before = locked_kib()
    m = _native.Model(str(path), n_threads=2, pin=False, weights_map="gguf", mlock=True, hugepages="off")
    assert locked_kib() - before >= size // 1024
    del m


def test_native_rejects_an_unknown_map(tmp_path):
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    with pytest.raises(ValueError, match="weights_map must be 'arena', 'gguf' or 'auto', got 'mmap'"):
        _native.Model(str(path), n_threads=1, pin=False, weights_map="mmap")


def test_config_key():
    assert ktd_config.load(None, environ={}).model.weights_map == "auto"  # the default
    cfg = ktd_config.load(None, text="model:\n  weights_map: arena\n", environ={})
    assert cfg.model.weights_map == "arena" and placement_options(cfg)["weights_map"] == "arena"
    cfg = ktd_config.load(None, text="model:\n  weights_map: gguf\n", environ={})
    assert cfg.model.weights_map == "gguf" and placement_options(cfg)["weights_map"] == "gguf"
    assert ktd_config.load(None, environ={"KTD_MODEL__WEIGHTS_MAP": "gguf"}).model.weights_map == "gguf"
    with pytest.raises(ktd_config.ConfigError, match=r"<config>:2: model.weights_map: .*one of arena, gguf, auto"):
        ktd_config.load(None, text="model:\n  weights_map: mmap\n", environ={})
    with pytest.raises(ktd_config.ConfigError, match="weights_map: gguf .* model.hugepages: hugetlb requires"):
        ktd_config.load(None, text="model:\n  weights_map: gguf\n  hugepages: hugetlb\n", environ={})
    ktd_config.load(None, text="model:\n  weights_map: gguf\n  hugepages: thp\n  mlock: true\n", environ={})


# model.weights_map: auto -------------------------------------------------------------------------

def test_auto_miss_serves_from_the_file_and_prepares_the_entry_for_the_next_start(tmp_path, caplog):
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    cache = tmp_path / "cache"
    cache.mkdir()
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = Engine.open(str(path), n_ctx=32, threads=2, pin=False, weights_cache=str(cache), weights_map="auto")
        w = WeightsManager.start(e)
    c = e.model.cache
    assert c["state"] == "absent" and c["path"].startswith(str(cache))
    assert e.model.memory["weights_map"] == "gguf" and e.model.repacked_bytes == 0
    assert "serves from the model file now" in caplog.text
    plain = _native.Model(str(path), n_threads=2, pin=False, allow_repack=False)
    np.testing.assert_array_equal(model_logits(e.model).view(np.uint32), model_logits(plain).view(np.uint32))
    # The background builder writes the entry the next start maps.
    assert w.builder is not None and w.builder.wait(timeout=300) == 0
    assert [str(p) for p in cache.iterdir() if p.suffix == ".ktdw"] == [c["path"]]
    e2 = Engine.open(str(path), n_ctx=32, threads=2, pin=False, weights_cache=str(cache), weights_map="auto")
    assert e2.model.cache["state"] == "hit" and WeightsManager.start(e2).builder is None
    assert e2.model.memory["weights_map"] == "arena" and e2.model.repacked_bytes > 0
    fresh = _native.Model(str(path), n_threads=2, pin=False)  # repacked, no cache
    np.testing.assert_array_equal(model_logits(e2.model).view(np.uint32), model_logits(fresh).view(np.uint32))


def test_auto_without_a_cache_or_on_several_nodes_is_arena(tmp_path, fake_numa_machine):
    path = S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0")
    m = _native.Model(str(path), n_threads=2, pin=False, weights_map="auto")
    assert m.memory["weights_map"] == "arena" and m.repacked_bytes > 0 and m.cache["state"] == "off"
    assert "without a weights cache" in m.memory["weights_map_note"]
    cache = tmp_path / "cache"
    cache.mkdir()
    m2 = _native.Model(str(path), n_threads=2, pin=False, weights_map="auto", cache_dir=str(cache),
                       **fake_numa_machine(2))
    assert m2.memory["weights_map"] == "arena" and "several NUMA nodes" in m2.memory["weights_map_note"]
    assert m2.cache["state"] in ("written", "not written")  # the arena path's own entry handling


def test_cache_builder_runs_at_idle_priority():
    import subprocess
    import sys
    code = "from ktd.ops.cache_builder import _lower_priority; import os; _lower_priority(); " \
           "print(os.sched_getscheduler(0), os.nice(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert (int(out[0]), int(out[1])) == (os.SCHED_IDLE, 19)


def test_auto_config():
    cfg = ktd_config.load(None, text="model:\n  weights_map: auto\n", environ={})
    assert cfg.model.weights_map == "auto" and placement_options(cfg)["weights_map"] == "auto"
    assert ktd_config.effective_weights_map(cfg.model) == ("auto", "")
    # hugetlb (a configuration written when arena was the default) keeps starting: auto is arena.
    for text in ("model:\n  weights_map: auto\n  hugepages: hugetlb\n", "model:\n  hugepages: hugetlb\n"):
        cfg = ktd_config.load(None, text=text, environ={})
        assert placement_options(cfg)["weights_map"] == "arena"
        assert "reserved huge pages cannot back" in ktd_config.effective_weights_map(cfg.model)[1]


def test_daemon_status_shows_the_map_and_serves_from_the_file(tmp_path):
    """A real daemon with KTD_MODEL__WEIGHTS_MAP=gguf: status says gguf with the bytes served from
    the file, and it generates what an in-process arena engine generates (greedy)."""
    from daemon_helpers import RealServe
    from ktd.client import Client

    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    sock = tmp_path / "ktd.sock"
    with RealServe(path, sock, {"KTD_MODEL__N_CTX": "128", "KTD_MODEL__WEIGHTS_MAP": "gguf",
                                "KTD_MODEL__WEIGHTS_CACHE": "off", "KTD_MODEL__THREADS": "1"}) as daemon:
        with Client(str(sock), timeout=60) as c:
            status = c.status()
            got = "".join(c.stream("hello", temperature=0, max_tokens=GREEDY_TOKENS))
    out = daemon.output
    assert status["memory"]["weights_map"] == "gguf"
    assert status["memory"]["file_mapped_bytes"] == _matrix_bytes(path) > 0
    assert status["model"]["memory"]["weights_map"] == "gguf"
    assert "weights map: gguf" in out
    engine = Engine.open(str(path), n_ctx=128, n_seq_max=1, threads=1)
    assert got == greedy_in_process(engine, "hello", GREEDY_TOKENS)


def test_inspect_prepare_with_auto_writes_the_entry_an_auto_start_maps(tmp_path):
    import json
    import subprocess
    import sys
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    env = dict(os.environ, KTD_MODEL__WEIGHTS_CACHE=str(cache), KTD_MODEL__THREADS="1", KTD_MODEL__WEIGHTS_MAP="auto")
    out = subprocess.run([sys.executable, "-m", "ktd", "inspect", str(path), "--prepare", "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)["prepare"]
    assert p["weights_map"] == "arena" and p["weights_cache"]["state"] == "written"
    e = Engine.open(str(path), n_ctx=32, threads=1, pin=False, weights_cache=str(cache), weights_map="auto")
    assert e.model.cache["state"] == "hit" and WeightsManager.start(e).builder is None
