"""The prepared-weights cache (native/src/model/weights_cache.h, ktd.ops.weights_cache): an entry is
written after a load, read back on the next (hit), never used when it does not match or is
damaged (stale model, truncated file, flipped bits: rebuilt), and the logits of a model loaded
from it are bit-identical to those of a model prepared from the GGUF file without any cache.
Also: two processes starting at once on one cache, a directory the process may not write (runs
without the cache and says why), CRC-32C against a bitwise reference, `ktd cache`."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engine_probes import cache_child, cache_child_result, engine_logits, mapped_inodes, open_cached
from ktd import _native
from ktd.server.engine import Engine
from models import synthetic_moe as S
from models.tiny_dense import make_model


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C bit by bit from its definition (reflected polynomial 0x82F63B78)."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_crc32c_matches_the_definition():
    assert _native.crc32c(b"123456789") == 0xE3069283  # the published check value
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 100, 1000, 4099):
        data = rng.integers(0, 256, n, np.uint8).tobytes()
        assert _native.crc32c(data) == _crc32c_reference(data), n
        # The block checksum: the CRC of each quarter (three of floor(n/4) rounded down to 8 bytes).
        q = n // 4 // 8 * 8
        parts = [data[:q], data[q:2 * q], data[2 * q:3 * q], data[3 * q:]]
        assert _native.crc32c_x4(data) == tuple(_crc32c_reference(p) for p in parts), n


def test_crc32c_uses_the_instruction_exactly_where_cpuid_has_it():
    # common/crc32c.cpp asks the compiler's CPUID query (the bottom layer includes nothing from
    # cpu/): it must agree with the CPU features ktd reports.
    assert _native.crc32c_hardware() == _native.cpu_features().sse4_2


# Dense llama with repacked (Q8_0) and copied (F32) matrices, and a MoE model whose routed
# experts are cut into two nodes' slices (three arenas: dense, and one per node).
CASES = ["llama-Q8_0", "llama-F32", "qwen3moe-2nodes"]


@pytest.fixture
def model(request, tmp_path, fake_numa_machine):
    case = request.param
    if case.startswith("qwen3moe"):
        return S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0"), fake_numa_machine(2)
    arch, wtype = case.split("-")
    return make_model(arch, tmp_path / "m.gguf", wtype=wtype), {}


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_hit_miss_and_identical_logits(model, tmp_path, caplog):
    path, placement = model
    reference = engine_logits(open_cached(path, **placement))
    cache = tmp_path / "cache"
    cache.mkdir()
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        first = open_cached(path, cache, **placement)
    c = first.model.cache
    assert c["state"] == "written" and c["reason"] == "" and os.path.getsize(c["path"]) == c["bytes"] > 0
    assert "prepared-weights cache: written" in caplog.text
    assert np.array_equal(engine_logits(first), reference)
    h = _native.weights_cache_header(c["path"])
    assert h["ok"] and h["key"]["model"] == os.path.realpath(path)
    assert h["key"]["size"] == str(os.path.getsize(path)) and h["key"]["build_id"] == _native.native_build_id()
    assert "layout_choice" in h["key"]  # which matrices are repacked (model_load.cpp, repack_matrix)
    assert sum(h["section_bytes"]) >= first.model.repacked_bytes + first.model.copied_bytes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        second = open_cached(path, cache, **placement)
    assert second.model.cache["state"] == "hit" and second.model.cache["path"] == c["path"]
    assert "prepared-weights cache: read" in caplog.text
    assert np.array_equal(engine_logits(second), reference)
    assert second.model.repacked_bytes == first.model.repacked_bytes
    assert second.model.copied_bytes == first.model.copied_bytes
    assert second.model.memory == first.model.memory
    assert [p.name for p in cache.iterdir()] == [os.path.basename(c["path"])]  # no temporary file left
    # Another layout (no repacking) is another entry, not a reuse of this one.
    plain = Engine.open(str(path), n_ctx=32, threads=2, pin=False, allow_repack=False, weights_cache=str(cache),
                        **placement)
    assert plain.model.cache["state"] == "written" and plain.model.cache["path"] != c["path"]
    assert np.array_equal(engine_logits(plain), engine_logits(open_cached(path, allow_repack=False, **placement)))


def test_a_changed_model_makes_its_entry_stale(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0", seed=1)
    old = open_cached(path, cache)
    entry = old.model.cache["path"]
    make_model("llama", tmp_path / "m.gguf", wtype="Q8_0", seed=2)  # same name and shapes, other weights
    new = open_cached(path, cache)
    c = new.model.cache
    assert c["state"] == "written" and c["path"] == entry  # the same entry, overwritten
    assert c["reason"].startswith("stale: ") and ("mtime_ns" in c["reason"] or "header_crc32c" in c["reason"])
    reference = engine_logits(open_cached(path))
    assert np.array_equal(engine_logits(new), reference) and not np.array_equal(engine_logits(old), reference)
    assert open_cached(path, cache).model.cache["state"] == "hit"


def _damage(entry: str, how: str) -> None:
    size = os.path.getsize(entry)
    if how == "truncated":
        os.truncate(entry, size - 5000)
    else:
        with open(entry, "r+b") as f:
            at = {"bit flip in the weights": size - 3000, "bit flip in the header": 60}[how]
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("how,reason", [("truncated", "truncated"), ("bit flip in the weights", "checksum mismatch"),
                                        ("bit flip in the header", "header checksum mismatch")])
def test_a_damaged_entry_is_rebuilt_never_used(tmp_path, how, reason):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    entry = open_cached(path, cache).model.cache["path"]
    _damage(entry, how)
    assert _native.weights_cache_verify(entry) != ""
    e = open_cached(path, cache)
    c = e.model.cache
    assert c["state"] == "written" and reason in c["reason"], c
    assert np.array_equal(engine_logits(e), reference)
    assert _native.weights_cache_verify(entry) == ""
    assert open_cached(path, cache).model.cache["state"] == "hit"


def test_two_processes_starting_at_once_share_one_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    procs = [cache_child(path, cache), cache_child(path, cache)]
    results = [cache_child_result(p) for p in procs]
    for logits, state in results:
        assert np.array_equal(logits, reference)
        assert state.startswith(("CACHE written", "CACHE hit")), state
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".ktdw", entries  # complete, no temporary file
    assert _native.weights_cache_verify(str(entries[0])) == ""
    logits, state = cache_child_result(cache_child(path, cache))
    assert state.startswith("CACHE hit") and np.array_equal(logits, reference)


def test_a_cache_directory_without_write_permission_runs_without_and_says_why(tmp_path):
    prefix: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere: take away the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv (util-linux) is missing to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    os.chmod(cache, 0o500)
    try:
        logits, state = cache_child_result(cache_child(path, cache, prefix))
    finally:
        os.chmod(cache, 0o700)
    assert state.startswith("CACHE not written") and "Permission denied" in state, state
    assert np.array_equal(logits, reference)
    assert list(cache.iterdir()) == []


def test_ktd_cache_list_verify_prune(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    a = make_model("llama", tmp_path / "a.gguf", wtype="Q8_0")
    b = make_model("llama", tmp_path / "b.gguf", wtype="F32")
    entry_a = open_cached(a, cache).model.cache["path"]
    entry_b = open_cached(b, cache).model.cache["path"]
    (cache / "junk.ktdw").write_bytes(b"not a cache")

    def ktd(*args):
        return subprocess.run([sys.executable, "-m", "ktd", "cache", *args, "--dir", str(cache)],
                              capture_output=True, text=True, timeout=120)

    out = ktd("list")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": current") == 2 and "unusable: truncated (11 bytes, no header)" in out.stdout
    assert "3 entries" in out.stdout
    _damage(entry_b, "bit flip in the weights")
    out = ktd("verify")
    assert out.returncode == 1
    assert f"{entry_a}: ok" in out.stdout and f"{entry_b}: checksum mismatch" in out.stdout
    os.unlink(a)  # a's model is gone: its entry is stale
    out = ktd("list")
    assert "stale: the model" in out.stdout
    out = ktd("prune")
    assert out.returncode == 0 and "2 removed" in out.stdout, out.stdout  # stale a, junk (b: at its next load)
    assert sorted(p.name for p in cache.iterdir()) == [os.path.basename(entry_b)]
    assert "1 removed" in ktd("prune", "--all").stdout and list(cache.iterdir()) == []


def test_load_progress_reports_phases_and_bytes(tmp_path, monkeypatch):
    """The progress a load reports (STATUS= in the daemon, the bar of `ktd run`): the preparing
    phase counts the file's tensor bytes, reading and writing the cache the entry's section bytes."""
    import ktd.server.engine
    from ktd.model.gguf import GGUFFile
    monkeypatch.setattr(ktd.server.engine._ProgressReporter, "PERIOD_S", 0.0005)
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    tensor_bytes = sum(t.nbytes for t in GGUFFile(str(path), willneed=False).tensors.values())
    cache = tmp_path / "cache"
    cache.mkdir()
    seen: list[tuple[str, float | None]] = []
    # The tiny model would load within the reporter's first period on a fast machine (or before a
    # busy one schedules the reporter thread): the loader's test hook sleeps 20 ms after each
    # tensor, so the first load is watched in progress whatever the machine's speed or load.
    monkeypatch.setenv("KTD_TEST_LOAD_TENSOR_DELAY_MS", "20")
    open_cached(path, cache, progress=lambda what, f: seen.append((what, f)))
    monkeypatch.delenv("KTD_TEST_LOAD_TENSOR_DELAY_MS")
    e = open_cached(path, cache, progress=lambda what, f: seen.append((what, f)))
    section_gib = f"{sum(_native.weights_cache_header(e.model.cache['path'])['section_bytes']) / (1 << 30):.2f} GiB"
    weights = [(w, f) for w, f in seen if f is not None]
    assert weights and all(0 <= f <= 1 for _, f in weights)
    phases = {w.split(":")[0] for w, _ in weights}
    assert phases <= {"preparing weights", "writing the weights cache", "reading the weights cache"}, phases
    for w, _ in weights:
        total = w.rsplit(" of ", 1)[1]
        assert total == (f"{tensor_bytes / (1 << 30):.2f} GiB" if w.startswith("preparing") else section_gib), w
    # The native counters themselves, at the end of a load that wrote the cache.
    os.mkdir(tmp_path / "c3")
    p = _native.LoadProgress()
    m = _native.Model(str(path), n_threads=1, pin=False, cache_dir=str(tmp_path / "c3"), progress=p)
    assert m.cache["state"] == "written" and p.phase == "done"
    assert p.done == p.total == sum(_native.weights_cache_header(m.cache["path"])["section_bytes"])


def test_inspect_and_status_show_the_entries(tmp_path, monkeypatch):
    from ktd.server.connections import _unprivileged_model
    from ktd.model.inspect import inspect_model, render
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    e = open_cached(path, cache)
    monkeypatch.setenv("KTD_MODEL__WEIGHTS_CACHE", str(cache))
    r = inspect_model(str(path))["weights_cache"]
    assert r["dir"] == str(cache) and [x["path"] for x in r["entries"]] == [e.model.cache["path"]]
    assert r["bytes"] == os.path.getsize(e.model.cache["path"]) and r["entries"][0]["stale"] == ""
    assert "weights cache  1 entries for this file, " in render(inspect_model(str(path)))
    monkeypatch.setenv("KTD_MODEL__WEIGHTS_CACHE", "off")
    assert inspect_model(str(path))["weights_cache"] == {"dir": None, "entries": [], "bytes": 0}
    # status: the entry's path names the model's: only privileged peers see it.
    info = e.info()
    assert info["weights_cache"]["state"] == "written" and info["weights_cache"]["path"]
    assert _unprivileged_model(info)["weights_cache"] == {"state": "written", "bytes": info["weights_cache"]["bytes"]}


def test_the_daemon_writes_a_new_entry_in_the_background(tmp_path, caplog):
    """The daemon's factory writes the entry after the load, from a thread of its own, while the
    model serves: the first forward does not wait for it, the entry it leaves is complete."""
    import time

    from ktd.ops import config as ktd_config
    from ktd.server.engine import load
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    cfg = ktd_config.load(text=f"model:\n  path: {path}\n  n_ctx: 32\n  threads: 2\n  weights_cache: {cache}\n"
                               "  weights_map: arena\n",
                          environ={})
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = load(cfg, lambda what, f: None)
        assert e.model.cache["state"] in ("writing", "written")
        assert np.array_equal(engine_logits(e), reference)
        deadline = time.monotonic() + 60
        while e.model.cache["state"] == "writing" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.model.cache["state"] == "written", e.model.cache
        assert _native.weights_cache_verify(e.model.cache["path"]) == ""
        deadline = time.monotonic() + 10
        while "prepared-weights cache: written" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "prepared-weights cache: written" in caplog.text
    again = load(cfg, lambda what, f: None)
    assert again.model.cache["state"] == "hit" and np.array_equal(engine_logits(again), reference)


def test_ktd_inspect_prepare_writes_then_reads_the_entry(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    env = dict(os.environ, KTD_MODEL__WEIGHTS_CACHE=str(cache), KTD_MODEL__THREADS="1")

    def inspect(*extra):
        return subprocess.run([sys.executable, "-m", "ktd", "inspect", str(path), "--prepare", *extra],
                              capture_output=True, text=True, timeout=120, env=env)

    out = inspect()
    assert out.returncode == 0, out.stderr
    [entry] = list(cache.iterdir())
    assert f"weights cache  written to {entry}" in out.stdout
    out = inspect("--json")
    import json
    c = json.loads(out.stdout)["prepare"]["weights_cache"]
    assert c["state"] == "hit" and c["path"] == str(entry)


def test_a_hit_takes_the_matrices_from_the_entry_not_the_file(tmp_path):
    """What the key covers, and what a hit reads: the matrices' bytes of the GGUF rewritten in
    place with the size, mtime, header and tensor table kept is not seen (the file's contents
    are not hashed: that would cost a full read of the file on every start); the entry's
    matrices are used, not the file's. `ktd cache prune --all` or touching the file rebuilds."""
    from ktd.model.gguf import GGUFFile
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    before = engine_logits(open_cached(path, cache))
    t = GGUFFile(str(path), willneed=False).tensors["blk.0.attn_q.weight"]
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(bytes(t.nbytes))  # zero blocks: a valid Q8_0 matrix of zeros
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = engine_logits(open_cached(path))
    assert not np.array_equal(changed, before)
    hit = open_cached(path, cache)
    assert hit.model.cache["state"] == "hit" and np.array_equal(engine_logits(hit), before)
    os.utime(path)  # a new mtime: the entry is stale and rebuilt from the file
    again = open_cached(path, cache)
    assert again.model.cache["state"] == "written" and "mtime_ns" in again.model.cache["reason"]
    assert np.array_equal(engine_logits(again), changed)


def test_a_cache_write_that_fails_midway_runs_without_it_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    # files the child writes may not grow past 64 KiB: the cache entry cannot be written, as on a
    # full disk
    logits, state = cache_child_result(cache_child(path, cache, max_file_bytes=65536))
    assert state.startswith("CACHE not written") and "File too large" in state, state
    assert np.array_equal(logits, reference)
    assert list(cache.iterdir()) == []  # the temporary file is removed


# ---- a hit maps the entry (model.weights_cache_map) ----------------------------------------------

def _smaps_of(path: str) -> list[dict[str, int]]:
    """Per mapping of `path` in this process (also once deleted or replaced): its smaps fields in
    kB (Rss, FilePmdMapped, ...)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                cur = {} if path in line else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
                cur[head[0][:-1]] = int(head[1])
    return out


@pytest.mark.parametrize("hugepages", ["auto", "off"])
def test_a_hit_maps_the_entry_and_gives_the_same_logits_as_reading_it(tmp_path, hugepages):
    """A hit on one node maps the entry's sections into the arenas (no fresh pages, no copy) and
    computes exactly what the read path and an uncached load compute; the mapping outlives the
    entry's removal and its replacement by another file (ktd only unlinks or renames over)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path, hugepages=hugepages))
    written = open_cached(path, cache, hugepages=hugepages)
    assert written.model.cache["state"] == "written" and written.model.cache["mapped"] is False
    entry = written.model.cache["path"]
    # the first load prepared its weights into the entry's pages and serves from them (direct)
    assert written.model.cache["direct"] is True
    by_writer = _smaps_of(entry)
    assert by_writer and sum(m.get("Rss", 0) for m in by_writer) > 0
    read = open_cached(path, cache, hugepages=hugepages, cache_map=False)
    assert read.model.cache["state"] == "hit" and read.model.cache["mapped"] is False
    assert _smaps_of(entry) == by_writer  # the read copy maps nothing of the entry
    mapped = open_cached(path, cache, hugepages=hugepages)
    assert mapped.model.cache["state"] == "hit" and mapped.model.cache["mapped"] is True
    maps = _smaps_of(entry)
    assert len(maps) > len(by_writer) and sum(m.get("Rss", 0) for m in maps) > sum(
        m.get("Rss", 0) for m in by_writer)  # the entry's pages are the arena's
    assert np.array_equal(engine_logits(mapped), reference)
    assert np.array_equal(engine_logits(read), reference)
    assert mapped.model.memory == read.model.memory
    # Replaced on disk the way ktd replaces an entry (a new file renamed over it), then removed:
    # the mapped model keeps its bytes.
    junk = tmp_path / "junk"
    junk.write_bytes(b"\xff" * os.path.getsize(entry))
    os.replace(junk, entry)
    assert np.array_equal(engine_logits(mapped), reference)
    os.unlink(entry)
    assert np.array_equal(engine_logits(mapped), reference)


def test_a_mapped_entry_that_fails_its_checksums_is_rebuilt_into_fresh_memory(tmp_path):
    """A bit flipped in a section: found by the checksums computed over the mapping, the arena
    gets anonymous memory back, the weights are prepared from the GGUF (identical logits), and
    nothing of the damaged entry stays mapped."""
    cache = tmp_path / "cache"
    cache.mkdir()
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    reference = engine_logits(open_cached(path))
    entry = open_cached(path, cache).model.cache["path"]
    h = _native.weights_cache_header(entry)
    size = os.path.getsize(entry)
    with open(entry, "r+b") as f:  # the last byte of the last section
        pos = size - 1
        while pos > 0:
            f.seek(pos)
            if f.read(1) != b"\0":
                break
            pos -= 1
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    assert h["ok"]
    damaged = os.stat(entry).st_ino
    again = open_cached(path, cache)
    assert again.model.cache["state"] == "written" and "checksum mismatch" in again.model.cache["reason"]
    assert again.model.cache["mapped"] is False
    # the rebuilt entry (a new file renamed over the damaged one) is what `again` maps: nothing of
    # the damaged file stays mapped
    assert again.model.cache["direct"] is True and os.stat(entry).st_ino != damaged
    assert damaged not in mapped_inodes(entry) and os.stat(entry).st_ino in mapped_inodes(entry)
    assert np.array_equal(engine_logits(again), reference)
    hit = open_cached(path, cache)
    assert hit.model.cache["state"] == "hit" and hit.model.cache["mapped"] is True
    assert np.array_equal(engine_logits(hit), reference)


def test_sections_are_written_2mib_aligned(tmp_path):
    """The writer puts every section at a 2 MiB-aligned offset (a mapped section's 2 MiB folios
    then map whole); the header's offsets are checked by parsing the file independently here."""
    import struct
    cache = tmp_path / "cache"
    cache.mkdir()
    path = S.make_model("qwen3moe", tmp_path / "m.gguf", wtype="Q8_0")
    entry = open_cached(path, cache).model.cache["path"]
    data = open(entry, "rb").read()
    assert data[:8] == b"KTDWCACH"
    n_sections, key_len = struct.unpack_from("<II", data, 40)
    at = (48 + key_len + 7) // 8 * 8
    offsets = [struct.unpack_from("<QQ", data, at + 16 * s) for s in range(n_sections)]
    assert offsets and all(off % (2 << 20) == 0 and n > 0 for off, n in offsets)
