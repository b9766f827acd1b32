"""A first load writes its prepared-weights cache entry while it prepares the weights
(native WeightsCacheWriter: the arenas are shared mappings of the entry's temporary file, the
model then serves from the entry's pages), instead of preparing into fresh anonymous memory and
copying that to the entry afterwards (``cache_direct=False``, also what a placement that cannot map
does). Checked against the no-cache load and the write-after path: identical logits, the same
section bytes, an entry that verifies and is hit afterwards; a process killed in the middle leaves
no usable entry (only its temporary file, pruned when old); two first loads at once leave one
complete entry. KTD_TEST_LOAD_TENSOR_DELAY_MS (a test hook of the native loader: a sleep after
every tensor) keeps a load in progress long enough to be killed or overlapped."""

from __future__ import annotations

import os
import signal
import struct
import time

import numpy as np
import pytest

from engine_probes import cache_child, cache_child_result, engine_logits, mapped_inodes, open_cached
from ktd import _native

from ktd.ops import weights_cache
from models import synthetic_moe as S
from models.tiny_dense import make_model


def _sections(entry: str) -> list[bytes]:
    """Each section's bytes, read from the file by parsing its header here (format in
    native/src/model/weights_cache.h), independently of the native reader."""
    data = open(entry, "rb").read()
    assert data[:8] == b"KTDWCACH"
    n_sections, key_len = struct.unpack_from("<II", data, 40)
    at = (48 + key_len + 7) // 8 * 8
    out = []
    for s in range(n_sections):
        off, n = struct.unpack_from("<QQ", data, at + 16 * s)
        assert off % (2 << 20) == 0 and off + n <= len(data)
        out.append(data[off:off + n])
    return out


@pytest.mark.parametrize("arch,wtype,hugepages", [("llama", "Q8_0", "auto"), ("llama", "Q4_0", "auto"),
                                                  ("llama", "Q5_0", "auto"), ("llama", "F32", "auto"),
                                                  ("llama", "Q8_0", "off"), ("qwen3moe", "Q8_0", "auto")])
def test_the_first_load_prepares_into_the_entry_and_computes_the_same(tmp_path, arch, wtype, hugepages):
    if arch == "llama":
        path = make_model(arch, tmp_path / "m.gguf", wtype=wtype)
    else:  # routed experts (matrix stacks), one node
        path = S.make_model(arch, tmp_path / "m.gguf", wtype=wtype)
    reference = engine_logits(open_cached(path, hugepages=hugepages))
    (tmp_path / "direct").mkdir()
    (tmp_path / "after").mkdir()
    direct = open_cached(path, tmp_path / "direct", hugepages=hugepages)
    after = open_cached(path, tmp_path / "after", hugepages=hugepages, cache_direct=False)
    d, a = direct.model.cache, after.model.cache
    assert d["state"] == a["state"] == "written" and d["reason"] == a["reason"] == ""
    assert d["direct"] is True and a["direct"] is False
    assert os.path.getsize(d["path"]) == d["bytes"]
    # the model serves from the entry's pages, computing exactly what the others compute
    assert os.stat(d["path"]).st_ino in mapped_inodes(d["path"])
    assert np.array_equal(engine_logits(direct), reference) and np.array_equal(engine_logits(after), reference)
    assert direct.model.memory == after.model.memory
    # the two ways of writing leave the same bytes in every section, and complete entries
    assert _sections(d["path"]) == _sections(a["path"])
    assert _native.weights_cache_verify(d["path"]) == ""
    assert _native.weights_cache_header(d["path"])["key"] == _native.weights_cache_header(a["path"])["key"]
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == [os.path.basename(d["path"])]
    hit = open_cached(path, tmp_path / "direct", hugepages=hugepages)
    assert hit.model.cache["state"] == "hit" and np.array_equal(engine_logits(hit), reference)
    read = open_cached(path, tmp_path / "direct", hugepages=hugepages, cache_map=False)
    assert read.model.cache["state"] == "hit" and np.array_equal(engine_logits(read), reference)


def test_a_process_killed_in_the_middle_leaves_no_usable_entry(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    child = cache_child(path, cache, env={"KTD_TEST_LOAD_TENSOR_DELAY_MS": "200"})
    try:
        deadline = time.monotonic() + 60
        while not any(weights_cache.TMP_MARK in p.name for p in cache.iterdir()):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.01)
        time.sleep(0.3)  # a tensor or two written into it (each load step then sleeps 200 ms)
        assert child.poll() is None, "the load ended before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
    names = [p.name for p in cache.iterdir()]
    assert len(names) == 1 and weights_cache.TMP_MARK in names[0] and not names[0].endswith(weights_cache.SUFFIX)
    [tmp] = weights_cache.entries(str(cache))
    assert not tmp["ok"] and "temporary file" in tmp["problem"]
    # the next load finds no entry, writes one (the leftover is not read), computes the same
    again = open_cached(path, cache)
    assert again.model.cache["state"] == "written" and again.model.cache["reason"] == ""
    assert np.array_equal(engine_logits(again), reference)
    assert _native.weights_cache_verify(again.model.cache["path"]) == ""
    # a leftover younger than an hour may be a write in progress: kept; an old one is pruned
    assert weights_cache.prune(str(cache)) == []
    old = time.time() - 2 * weights_cache.TMP_STALE_S
    os.utime(cache / names[0], (old, old))
    assert [os.path.basename(p) for p, _, _ in weights_cache.prune(str(cache))] == names
    assert [p.name for p in cache.iterdir()] == [os.path.basename(again.model.cache["path"])]


def test_two_first_loads_at_once_leave_one_complete_entry(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    # both loads still preparing when the other starts
    procs = [cache_child(path, cache, env={"KTD_TEST_LOAD_TENSOR_DELAY_MS": "30"}) for _ in range(2)]
    results = [cache_child_result(p) for p in procs]
    for logits, state in results:
        assert np.array_equal(logits, reference)
        assert state.startswith(("CACHE written", "CACHE hit")), state
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".ktdw", entries
    assert _native.weights_cache_verify(str(entries[0])) == ""
    hit = open_cached(path, cache)
    assert hit.model.cache["state"] == "hit" and np.array_equal(engine_logits(hit), reference)

