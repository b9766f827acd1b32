"""Files the daemon reads back are trusted by who may write them, not by their checksums: a
prepared-weights entry (native/src/model/weights_cache.h) or a routing profile
(ktd.ops.routing_profile) is used only when it and its directory belong to this process's user
or root and no one else may write them, and is opened without following a symbolic link.
Otherwise it is ignored with the reason logged, and ``ktd cache`` says why. CRC-32C proves an
entry intact, not who wrote it: an entry another user planted, with valid checksums, is the case
that matters. Files are given away with chown (the tests run as root)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engine_probes import engine_logits, open_cached
from ktd import _native
from ktd.ops import routing_profile as rp
from models.tiny_dense import make_model

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
OTHER = 65534  # nobody


@pytest.fixture
def built(tmp_path):
    """A model, its reference logits, a cache directory (0755) and the entry a load wrote there."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755)
    path = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    first = open_cached(path, cache)
    assert first.model.cache["state"] == "written"
    return path, engine_logits(first), cache, first.model.cache["path"]


def _ktd_cache(cache, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktd", "cache", *args, "--dir", str(cache)],
                          capture_output=True, text=True, timeout=120)


@needs_root
@pytest.mark.parametrize("plant, why", [
    (lambda entry: os.chown(entry, OTHER, OTHER), f"owned by uid {OTHER}"),
    (lambda entry: os.chmod(entry, 0o664), "writable by its group or others"),
    (lambda entry: os.chmod(entry, 0o646), "writable by its group or others"),
])
def test_an_entry_others_wrote_or_may_write_is_not_used(built, plant, why):
    path, reference, cache, entry = built
    plant(entry)
    assert why in _native.weights_cache_header(entry)["problem"]
    out = _ktd_cache(cache, "verify")
    assert out.returncode == 1 and f"{entry}: " in out.stdout and why in out.stdout, out.stdout
    assert why in _ktd_cache(cache, "list").stdout
    e = open_cached(path, cache)
    c = e.model.cache
    assert c["state"] == "written" and why in c["reason"], c  # replaced by one of its own
    assert np.array_equal(engine_logits(e), reference)
    st = os.stat(entry)
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022
    assert open_cached(path, cache).model.cache["state"] == "hit"


@needs_root
def test_an_entry_planted_in_a_world_writable_directory_is_not_loaded(built, tmp_path, caplog):
    """The finding: a directory others may write (1777), an entry another user put there with
    every checksum valid. Neither the directory nor the entry is used; the load says why."""
    path, reference, cache, entry = built
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = shared / os.path.basename(entry)
    shutil.copy(entry, planted)
    os.chown(planted, OTHER, OTHER)
    os.chmod(shared, 0o1777)
    assert _native.weights_cache_verify(str(planted)) != ""  # refused before a checksum is read
    with caplog.at_level(logging.INFO, logger="ktd.server.engine"):
        e = open_cached(path, shared)
    assert e.model.cache["state"] != "hit"
    assert "writable by its group or others" in caplog.text and "off" in caplog.text, caplog.text
    assert np.array_equal(engine_logits(e), reference)
    assert sorted(os.listdir(shared)) == [planted.name]  # nothing written there either
    out = _ktd_cache(shared, "verify")
    assert out.returncode == 1 and "writable by its group or others" in out.stdout, out.stdout
    # the native loader keeps the rule on its own (a caller that skips ktd.ops.weights_cache)
    m = _native.Model(str(path), n_threads=1, pin=False, cache_dir=str(shared))
    assert m.cache["state"] == "not written" and "writable by its group or others" in m.cache["reason"]


@needs_root
@pytest.mark.parametrize("mode, owner, why", [(0o775, None, "writable by its group or others"),
                                              (0o755, OTHER, f"owned by uid {OTHER}")])
def test_a_cache_directory_others_control_is_not_used(built, mode, owner, why):
    path, reference, cache, entry = built
    os.chmod(cache, mode)
    if owner is not None:
        os.chown(cache, owner, owner)
    assert why in _native.weights_cache_header(entry)["problem"]
    out = _ktd_cache(cache, "list")
    assert why in out.stdout, out.stdout
    e = open_cached(path, cache)
    assert e.model.cache["state"] == "off"
    assert np.array_equal(engine_logits(e), reference)


def test_an_entry_that_is_a_symbolic_link_is_not_followed(built, tmp_path):
    path, reference, cache, entry = built
    elsewhere = tmp_path / "elsewhere.ktdw"
    os.rename(entry, elsewhere)
    os.symlink(elsewhere, entry)
    assert "symbolic link" in _native.weights_cache_header(entry)["problem"]
    assert "symbolic link" in _ktd_cache(cache, "verify").stdout
    c = open_cached(path, cache).model.cache
    assert c["state"] == "written" and "symbolic link" in c["reason"], c
    assert not os.path.islink(entry)  # the link was replaced by an entry of its own


# --- the routing profile ---------------------------------------------------------------------------

def _saved_profile(tmp_path) -> tuple[rp.RoutingProfile, str]:
    p = rp.RoutingProfile(tmp_path, "k", (2, 3))
    p.update(np.array([[1, 2, 3], [4, 5, 6]], np.uint64))
    assert p.save()
    assert rp.RoutingProfile(tmp_path, "k", (2, 3)).counts().sum() == 21
    return p, str(p.path)


@needs_root
@pytest.mark.parametrize("plant, why", [
    (lambda f, d: os.chown(f, OTHER, OTHER), f"owned by uid {OTHER}"),
    (lambda f, d: os.chmod(f, 0o666), "writable by its group or others"),
    (lambda f, d: os.chmod(d, 0o1777), "writable by its group or others"),
    (lambda f, d: os.chown(d, OTHER, OTHER), f"owned by uid {OTHER}"),
])
def test_a_routing_profile_others_control_is_ignored(tmp_path, caplog, plant, why):
    _, f = _saved_profile(tmp_path)
    plant(f, os.path.dirname(f))
    with caplog.at_level(logging.WARNING, logger="ktd.ops.routing_profile"):
        p = rp.RoutingProfile(tmp_path, "k", (2, 3))
    assert p.counts().sum() == 0
    assert why in caplog.text and "ignored" in caplog.text, caplog.text


def test_a_routing_profile_behind_a_symbolic_link_is_ignored(tmp_path, caplog):
    _, f = _saved_profile(tmp_path)
    os.rename(f, tmp_path / "real.npy")
    os.symlink(tmp_path / "real.npy", f)
    with caplog.at_level(logging.WARNING, logger="ktd.ops.routing_profile"):
        assert rp.RoutingProfile(tmp_path, "k", (2, 3)).counts().sum() == 0
    assert "symbolic link" in caplog.text
