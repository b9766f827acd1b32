"""The daemon's GPU policy (config section ``gpu``, ktd.model.gpu): config validation, the decision at
load (CPU when gpu.device is unset; the CUDA runtime's own reason and a CPU fallback, or a refusal
with gpu.required; an impossible VRAM plan refused with its numbers; the loopback backend driving
the whole daemon through the hybrid data flow), the hot-expert choice from a routing profile, and
the split as `status`, `ktctl status` and `ktd inspect` show it. The byte figures are checked
against sums taken independently with gguf-py's reader; the loopback daemon's greedy text against
the CPU engine's in-process text; the unavailable-CUDA reason against _native.cuda_status()."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import GGUFReader

from daemon_helpers import wait_serving
from engine_probes import greedy_ids
from ktd import _native
from ktd.ops import config as config_mod
from ktd.model import gpu
from ktd.client import Client
from ktd.server.engine import Engine
from ktd.ops.routing_profile import RoutingProfile, model_key

GiB = 1 << 30


def cfg(text: str = "", **env: str) -> config_mod.Config:
    return config_mod.load(text=text, environ=env)


# --- configuration ---------------------------------------------------------------------------

def test_gpu_keys_defaults_and_values():
    g = cfg().gpu
    assert (g.device, g.backend, g.required, g.vram_budget, g.layers, g.experts) == (None, "cuda", False, "auto", 0, "none")
    g = cfg("gpu:\n  device: 1\n  backend: loopback\n  required: true\n  vram_budget: 22G\n"
            "  layers: 12\n  experts: hot\n").gpu
    assert (g.device, g.backend, g.required, g.vram_budget, g.layers, g.experts) == (1, "loopback", True, 22 * GiB, 12, "hot")
    assert cfg("gpu:\n  device: off\n  experts: 3\n  vram_budget: 1000000\n").gpu == \
        config_mod.GpuConfig(device=None, experts=3, vram_budget=1000000)
    assert cfg(KTD_GPU__DEVICE="0", KTD_GPU__VRAM_BUDGET="24GiB").gpu.vram_budget == 24 * GiB
    assert "gpu.device = off" in config_mod.explain()


@pytest.mark.parametrize("text, fragment", [
    ("gpu:\n  device: -1\n", "<config>:2: gpu.device: expected a CUDA device index (0, 1, ...) or off/null"),
    ("gpu:\n  device: cuda0\n", "gpu.device: expected a CUDA device index"),
    ("gpu:\n  device: true\n", "gpu.device: expected a CUDA device index"),
    ("gpu:\n  backend: rocm\n", "gpu.backend: expected one of cuda, loopback"),
    ("gpu:\n  vram_budget: lots\n", "gpu.vram_budget: expected auto or a positive size"),
    ("gpu:\n  vram_budget: 0\n", "gpu.vram_budget: expected auto or a positive size"),
    ("gpu:\n  vram_budget: 0G\n", "gpu.vram_budget: expected auto or a positive size"),
    ("gpu:\n  layers: -2\n", "gpu.layers: -2 is below the minimum 0"),
    ("gpu:\n  experts: many\n", "gpu.experts: expected none, hot or a number of experts per layer"),
    ("gpu:\n  experts: -1\n", "gpu.experts: expected none, hot or a number"),
    ("gpu:\n  devices: 0\n", "unknown key gpu.devices"),
])
def test_gpu_keys_errors(text, fragment):
    with pytest.raises(config_mod.ConfigError) as e:
        cfg(text)
    assert fragment in str(e.value) and "\n" not in str(e.value)


# --- the decision ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tiny_model):
    return str(tiny_model("qwen3moe"))


def _split(path):
    """(bytes not routed experts, routed expert bytes, n_expert, n_layer, one expert in every MoE
    layer) with gguf-py's reader."""
    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    exps = {t.name: int(t.n_bytes) for t in r.tensors if "_exps" in t.name}
    rest = sum(int(t.n_bytes) for t in r.tensors if "_exps" not in t.name)
    n_expert = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    n_layer = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    return rest, sum(exps.values()), n_expert, n_layer, sum(b // n_expert for b in exps.values()), r


def _no_probe():
    raise AssertionError("cuda_status must not be called")


def test_no_device_means_cpu_and_nothing_probed(moe):
    d = gpu.decide(cfg(f"model:\n  path: {moe}\n"), cuda_status=_no_probe)
    assert d.backend == "cpu" and d.reason is None and d.plan is None
    assert d.summary() == {"backend": "cpu", "device": None}


def test_cuda_unusable_here_falls_back_with_the_runtime_reason(moe, caplog):
    real = _native.cuda_status()
    if real["available"]:
        pytest.skip("a CUDA device is usable on this machine (this checks the fallback without one)")
    c = cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n")
    with caplog.at_level(logging.WARNING, logger="ktd.model.gpu"):
        d = gpu.decide(c)
    assert d.backend == "cpu" and real["reason"] and real["reason"] in d.reason
    assert any("gpu.device 0 cannot be used, running on the CPU only" in r.getMessage()
               and real["reason"] in r.getMessage() for r in caplog.records)
    with pytest.raises(gpu.GpuError, match="gpu.required is set and gpu.device 0 cannot be used") as e:
        gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n  required: true\n"))
    assert real["reason"] in str(e.value)


@pytest.mark.parametrize("status, fragment", [
    ({"available": False, "devices": 0, "reason": "CUDA driver version is insufficient for CUDA runtime version"},
     "CUDA is not usable: CUDA driver version is insufficient"),
    ({"available": True, "devices": 1, "reason": "NVIDIA H200", "device_memory": [140 * GiB]},
     "gpu.device 3 does not exist (the CUDA runtime sees 1)"),
])
def test_cuda_status_cases(moe, status, fragment):
    c = cfg(f"model:\n  path: {moe}\ngpu:\n  device: 3\n  vram_budget: 4G\n")
    d = gpu.decide(c, cuda_status=lambda: status)
    assert d.backend == "cpu" and fragment in d.reason
    assert d.summary()["reason"] == d.reason and d.summary()["plan"]["fits"]
    required = dataclass_replace(c, required=True)
    with pytest.raises(gpu.GpuError, match=fragment.split("(")[0].strip()):
        gpu.decide(required, cuda_status=lambda: status)


def test_cuda_usable_is_decided_for_the_device_backend(moe):
    """With a usable device the decision is the CUDA device backend (model/cuda_device.h); whether
    the model runs there is checked when the engine sets it up (test_cuda_device_emulated.py)."""
    status = {"available": True, "devices": 4, "reason": "NVIDIA H200", "device_memory": [140 * GiB] * 4}
    d = gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 3\n  vram_budget: 4G\n"), cuda_status=lambda: status)
    assert d.backend == "cuda" and d.device == 3 and d.reason is None and d.plan["fits"]


def dataclass_replace(c: config_mod.Config, **gpu_keys) -> config_mod.Config:
    import dataclasses
    return dataclasses.replace(c, gpu=dataclasses.replace(c.gpu, **gpu_keys))


def test_loopback_plan_is_the_gguf_py_split(moe):
    rest, exps, n_expert, n_layer, one, _ = _split(moe)
    d = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\n  n_seq_max: 2\nprefix_cache:\n  slots: 0\n"
                       "gpu:\n  device: 0\n  backend: loopback\n  vram_budget: 1G\n"), cuda_status=_no_probe)
    assert d.backend == "loopback" and d.reason is None
    p = d.summary()["plan"]
    assert p["gpu"]["weights"] == rest and p["cpu"]["routed_experts"] == exps and p["cpu"]["total"] == exps
    assert p["gpu_bytes"] == rest + p["gpu"]["kv_cache"] + p["gpu"]["reserve"]
    assert p["gpu"]["kv_cache"] > 0 and p["layers_on_gpu"] == p["n_layer"] == n_layer
    # auto: the host's MemAvailable plays the card's memory
    d = gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n  backend: loopback\n"), cuda_status=_no_probe)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(d.plan["vram_budget"] - avail) < avail // 4


def test_impossible_plan_is_refused_with_the_numbers(moe):
    rest, *_ = _split(moe)
    # below the 512 MiB reserve alone
    with pytest.raises(gpu.GpuError) as e:
        gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n  backend: loopback\n  vram_budget: 256M\n"))
    msg = str(e.value)
    assert "the VRAM plan does not fit (gpu.vram_budget 268435456)" in msg
    assert f"weights {rest / GiB:.2f} GiB" in msg and "reserve 0.50 GiB" in msg and "0.25 GiB budget" in msg
    # on the CUDA backend too, before the runtime is asked anything else: a config error everywhere
    status = {"available": False, "devices": 0, "reason": "no driver"}
    with pytest.raises(gpu.GpuError, match="does not fit"):
        gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n  vram_budget: 256M\n"), cuda_status=lambda: status)
    with pytest.raises(gpu.GpuError, match="gpu.layers is 99 but the model has"):
        gpu.decide(cfg(f"model:\n  path: {moe}\ngpu:\n  device: 0\n  backend: loopback\n  vram_budget: 1G\n  layers: 99\n"))


def test_partial_layers_keep_the_rest_in_host_memory(moe):
    rest, exps, n_expert, n_layer, one, r = _split(moe)
    assert n_layer >= 2
    L = 1
    late = sum(int(t.n_bytes) for t in r.tensors
               if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= L and "_exps" not in t.name)
    d = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\ngpu:\n  device: 0\n  backend: loopback\n"
                       f"  vram_budget: 1G\n  layers: {L}\n"))
    full = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\ngpu:\n  device: 0\n  backend: loopback\n"
                          "  vram_budget: 1G\n"))
    p, f = d.plan, full.plan
    assert p["host"]["dense"] == late and p["device"]["weights"] == rest - late
    assert p["host"]["kv_cache"] + p["device"]["kv_cache"] == f["device"]["kv_cache"]
    assert p["host"]["kv_cache"] == f["device"]["kv_cache"] * (n_layer - L) // n_layer
    assert p["layers_on_gpu"] == L and any(f"gpu.layers 1: layers 1..{n_layer - 1} run wholly on the CPU" in n
                                           for n in d.notes)


def test_hot_experts_from_the_routing_profile(moe, tmp_path):
    rest, exps, n_expert, n_layer, one, _ = _split(moe)
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 1000, size=(n_layer, n_expert)).astype(np.uint64)
    prof = RoutingProfile(tmp_path, model_key(moe), (n_layer, n_expert))
    prof.update(counts)
    assert prof.save()
    base = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\n  n_seq_max: 1\nprefix_cache:\n  slots: 0\n"
                          "gpu:\n  device: 0\n  backend: loopback\n  vram_budget: 1G\n"))
    need = base.plan["device"]["total"]
    budget = need + 2 * one + one // 3              # room for two more experts per layer
    d = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\n  n_seq_max: 1\n  routing_profile: {tmp_path}\n"
                       f"prefix_cache:\n  slots: 0\ngpu:\n  device: 0\n  backend: loopback\n  vram_budget: {budget}\n"
                       "  experts: hot\n"))
    assert d.plan["experts_per_layer_on_gpu"] == 2
    # independently: the two largest counts of each row, and their share of everything routed
    want = {il: sorted(int(e) for e in sorted(range(n_expert), key=lambda e: (-int(row[e]), e))[:2])
            for il, row in enumerate(counts)}
    hit = sum(sum(int(counts[il][e]) for e in es) for il, es in want.items()) / int(counts.sum())
    assert d.hot["per_layer"] == want and d.hot["hit_rate"] == pytest.approx(hit)
    s = d.summary()["hot_experts"]
    assert s["routed"] == int(counts.sum()) and s["per_layer"]["0"] == want[0]
    assert d.held == want and any("held in VRAM and computed there" in n for n in d.notes)
    # gpu.layers 1: only layer 0's experts are held (the others' layers run on the CPU)
    d1 = gpu.decide(cfg(f"model:\n  path: {moe}\n  n_ctx: 64\n  n_seq_max: 1\n  routing_profile: {tmp_path}\n"
                        f"prefix_cache:\n  slots: 0\ngpu:\n  device: 0\n  backend: loopback\n  vram_budget: {budget}\n"
                        "  experts: 1\n  layers: 1\n"))
    assert d1.held == {0: [int(np.argmax(counts[0]))]}
    # without a profile: the first ones of every MoE layer
    d = gpu.decide(cfg(f"model:\n  path: {moe}\n  routing_profile: off\ngpu:\n  device: 0\n  backend: loopback\n"
                       "  vram_budget: 1G\n  experts: 1\n"))
    assert d.hot is None and any("no routing profile yet" in n for n in d.notes)
    assert d.held == {il: [0] for il in range(n_layer)}


def test_hot_experts_ties_and_empty_rows():
    h = gpu.hot_experts(np.array([[5, 5, 1], [0, 0, 0], [0, 2, 9]], np.uint64), 2)
    assert h["per_layer"] == {0: [0, 1], 2: [1, 2]} and h["routed"] == 22 and h["hit_rate"] == pytest.approx(21 / 22)
    assert gpu.hot_experts(np.zeros((2, 4), np.uint64), 3) == {"per_layer": {}, "hit_rate": 0.0, "routed": 0}


# --- the daemon ------------------------------------------------------------------------------

def _start(model: str, sock, extra_env: dict[str, str]) -> subprocess.Popen:
    env = dict(os.environ, KTD_MODEL__PATH=model, KTD_MODEL__N_CTX="64", KTD_MODEL__N_SEQ_MAX="2",
               KTD_MODEL__ROUTING_PROFILE="off", KTD_MODEL__THREADS="1", KTD_SERVER__SOCKET_GROUP="null",
               **extra_env)
    proc = subprocess.Popen([sys.executable, "-m", "ktd", "serve", "--socket", str(sock)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_serving(proc, sock, 120)  # it accepts while loading: until health says ok
    return proc


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return out


def _greedy_in_process(path: str, prompt: str, n: int) -> list[int]:
    return greedy_ids(Engine.open(path, n_ctx=64, n_seq_max=1, threads=1), prompt, n)


def test_daemon_on_the_loopback_backend(moe, tmp_path):
    """gpu.backend: loopback drives the daemon's whole path through HybridBackend: the greedy text
    is the CPU engine's, status shows the split and the activations that crossed, ktctl too."""
    want = _greedy_in_process(moe, "hello world", 6)
    assert want
    sock = tmp_path / "k.sock"
    proc = _start(moe, sock, {"KTD_GPU__DEVICE": "0", "KTD_GPU__BACKEND": "loopback", "KTD_GPU__VRAM_BUDGET": "2G"})
    try:
        with Client(str(sock), timeout=120) as c:
            r = c.generate("hello world", temperature=0, max_tokens=len(want))
            st = c.status()
        g = st["gpu"]
        assert g["backend"] == "loopback" and g["device"] == 0 and "reason" not in g
        rest, exps, *_ = _split(moe)
        assert g["plan"]["gpu"]["weights"] == rest and g["plan"]["cpu_bytes"] == exps
        assert g["plan"]["vram_budget"] == 2 * GiB and st["model"]["gpu"] == g
        ktctl = subprocess.run([sys.executable, "-m", "ktd.ctl", "--socket", str(sock), "status"],
                               capture_output=True, text=True, timeout=60)
        assert ktctl.returncode == 0 and json.loads(ktctl.stdout)["gpu"]["plan"]["cpu_bytes"] == exps
    finally:
        log = _stop(proc)
    eng = Engine.open(moe, n_ctx=64, n_seq_max=1, threads=1)
    assert r["text"] == eng.tokenizer.decode(want)
    assert "hybrid forward on loopback (device 0)" in log and "hybrid plan (VRAM budget 2.00 GiB): fits" in log


def _greedy_through_the_daemon(moe: str, tmp_path, env: dict[str, str]) -> tuple[dict, str]:
    """Greedy text of "hello world" through a daemon on gpu device 0 (1G budget) with `env`: it
    must be the CPU engine's; the `gpu` part of status once the hybrid counters moved, and the log."""
    want = _greedy_in_process(moe, "hello world", 6)
    assert want
    sock = tmp_path / "k.sock"
    proc = _start(moe, sock, {"KTD_GPU__DEVICE": "0", "KTD_GPU__VRAM_BUDGET": "1G", **env})
    try:
        with Client(str(sock), timeout=120) as c:
            r = c.generate("hello world", temperature=0, max_tokens=len(want))
            deadline = time.monotonic() + 30
            while True:   # the hybrid snapshot is refreshed about once a second
                g = c.status()["gpu"]
                if (g.get("hybrid") or {}).get("moe_calls") or time.monotonic() > deadline:
                    break
                time.sleep(1.1)
    finally:
        log = _stop(proc)
    eng = Engine.open(moe, n_ctx=64, n_seq_max=1, threads=1)
    assert r["text"] == eng.tokenizer.decode(want)
    return g, log


@pytest.mark.parametrize("layers", [0, 1])
def test_daemon_on_the_cuda_device_backend_emulated(moe, tmp_path, layers):
    """gpu.backend: cuda through the daemon, with the CUDA ABI emulated on the host (test hook
    KTD_TEST_CUDA_EMULATED): the scheduler's thread drives CudaDevice behind HybridBackend; the
    greedy text is the CPU engine's (F32 tiny model: the device path is within float rounding of
    it), status says cuda with its plan, and activations crossed per MoE layer. gpu.layers 1: the
    device runs layer 0 only, the rest run on the CPU (the residual comes down at the split)."""
    g, log = _greedy_through_the_daemon(moe, tmp_path, {"KTD_GPU__BACKEND": "cuda", "KTD_TEST_CUDA_EMULATED": "1",
                                                        "KTD_GPU__LAYERS": str(layers)})
    assert g["backend"] == "cuda" and g["device"] == 0 and "reason" not in g
    n_layer = _split(moe)[3]
    h = g["hybrid"]
    assert h["device_layers"] == (layers or n_layer) and h["moe_calls"] > 0 and h["bytes_to_device"] > 0
    if layers:
        assert h["bytes_to_host"] > h["bytes_to_device"]   # + the residual at the split
        assert f"gpu.layers 1: layers 1..{n_layer - 1} run wholly on the CPU" in log
    else:
        assert h["bytes_to_host"] == h["bytes_to_device"]
    assert "hybrid forward on cuda (device 0)" in log


@pytest.mark.parametrize("backend", ["loopback", "cuda"])
def test_daemon_with_hot_experts_held_by_the_device(moe, tmp_path, backend):
    """gpu.experts 2 (no routing profile: experts 0 and 1 of each MoE layer): the device computes
    the pairs routed to them; the greedy text is the CPU engine's and status gives the live hit
    rate (that device_pairs are exactly the pairs routed to the held experts is checked against
    the expert statistics in test_hybrid_loopback.py and test_cuda_device_emulated.py)."""
    env = {"KTD_GPU__BACKEND": backend, "KTD_GPU__EXPERTS": "2", "KTD_GPU__POOL_SPIN_US": "1234"}
    if backend == "cuda":
        env["KTD_TEST_CUDA_EMULATED"] = "1"
    g, log = _greedy_through_the_daemon(moe, tmp_path, env)
    assert g["plan"]["experts_per_layer_on_gpu"] == 2
    h = g["hybrid"]
    assert h["pool_spin_us"] == 1234                     # gpu.pool_spin_us, set on the model's pool
    assert 0 < h["early_launches"] <= h["moe_calls"]     # held experts sent once routed
    k = int(GGUFReader(moe).fields["qwen3moe.expert_used_count"].parts[-1][0])
    assert h["routed_pairs"] > 0 and h["routed_pairs"] % (k * _split(moe)[3]) == 0   # every token, every MoE layer
    assert 0 < h["device_pairs"] < h["routed_pairs"]
    assert h["hot_hit_rate"] == pytest.approx(h["device_pairs"] / h["routed_pairs"])
    assert "routed experts per layer are held in VRAM and computed there" in log


def test_the_hybrid_backend_sets_the_pools_spin(moe):
    """gpu.pool_spin_us goes to the model's pool with a hybrid backend (read back from the pool),
    and the CPU-only load leaves the pool's default alone."""
    from ktd.server.engine import load

    for device, want in [("0", 777), ("off", None)]:
        c = cfg(f"model:\n  path: {moe}\n  n_ctx: 64\n  threads: 1\ngpu:\n  device: {device}\n"
                f"  backend: loopback\n  vram_budget: 4G\n  pool_spin_us: 777\n")
        eng = load(c, progress=None)
        assert eng.gpu.backend == ("loopback" if want else "cpu")
        assert eng.pool_spin_us == want
        assert eng.context.pool_spin_us == (want or 50)


def test_daemon_hybrid_counters_move(moe, tmp_path):
    sock = tmp_path / "k.sock"
    proc = _start(moe, sock, {"KTD_GPU__DEVICE": "0", "KTD_GPU__BACKEND": "loopback", "KTD_GPU__VRAM_BUDGET": "2G"})
    try:
        with Client(str(sock), timeout=120) as c:
            deadline = time.monotonic() + 30
            hyb = None
            while time.monotonic() < deadline:   # the snapshot is refreshed about once a second
                c.generate("abc", temperature=0, max_tokens=4)
                hyb = c.status()["gpu"].get("hybrid")
                if hyb and hyb["moe_calls"]:
                    break
                time.sleep(1.1)
    finally:
        _stop(proc)
    assert hyb and hyb["moe_calls"] > 0 and hyb["bytes_to_host"] == hyb["bytes_to_device"] > 0
    assert hyb["host_experts_ns"] > 0 and hyb["sync_wait_ns"] >= 0


def test_daemon_without_usable_cuda(moe, tmp_path):
    real = _native.cuda_status()
    if real["available"]:
        pytest.skip("a CUDA device is usable on this machine (this checks the fallback without one)")
    sock = tmp_path / "k.sock"
    proc = _start(moe, sock, {"KTD_GPU__DEVICE": "0"})
    try:
        with Client(str(sock), timeout=60) as c:
            g = c.status()["gpu"]
    finally:
        log = _stop(proc)
    assert g["backend"] == "cpu" and real["reason"] in g["reason"]
    assert "running on the CPU only" in log
    # gpu.required: the daemon refuses to start, with the reason on one line, exit 1
    env = dict(os.environ, KTD_MODEL__PATH=moe, KTD_GPU__DEVICE="0", KTD_GPU__REQUIRED="true",
               KTD_SERVER__SOCKET_GROUP="null")
    r = subprocess.run([sys.executable, "-m", "ktd", "serve", "--socket", str(tmp_path / "r.sock")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "gpu.required is set" in r.stderr and real["reason"] in r.stderr
    # an impossible plan: refused, the numbers on the line
    env.update(KTD_GPU__REQUIRED="false", KTD_GPU__BACKEND="loopback", KTD_GPU__VRAM_BUDGET="100M")
    r = subprocess.run([sys.executable, "-m", "ktd", "serve", "--socket", str(tmp_path / "r.sock")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the VRAM plan does not fit" in r.stderr and "reserve 0.50 GiB" in r.stderr


def test_inspect_shows_partial_layers(moe):
    r = subprocess.run([sys.executable, "-m", "ktd", "inspect", moe, "--vram", "1G", "--gpu-layers", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["hybrid_plan"]
    rest, exps, n_expert, n_layer, one, rd = _split(moe)
    late = sum(int(t.n_bytes) for t in rd.tensors
               if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= 1 and "_exps" not in t.name)
    assert plan["host"]["dense"] == late and plan["layers_on_gpu"] == 1
    r = subprocess.run([sys.executable, "-m", "ktd", "inspect", moe, "--vram", "1G", "--gpu-layers", "1"],
                       capture_output=True, text=True, timeout=120)
    assert f"CPU   also layers 1..{n_layer - 1} (gpu.layers = 1)" in r.stdout


def test_engine_load_falls_back_or_refuses_when_the_device_backend_cannot_run(moe, monkeypatch, caplog):
    """The decision says cuda, the device backend then refuses (here: no driver for the real
    library): the engine runs on the CPU with the reason, or with gpu.required refuses to load."""
    if _native.cuda_status()["available"]:
        pytest.skip("a CUDA device is usable on this machine (this checks the refusal without one)")
    from ktd.server.engine import load
    monkeypatch.setattr(gpu, "decide", lambda config, **kw: gpu.GpuDecision("cuda", 0))
    c = cfg(f"model:\n  path: {moe}\n  n_ctx: 64\ngpu:\n  device: 0\n  vram_budget: 4G\n")
    with caplog.at_level(logging.WARNING, logger="ktd.server.engine"):
        eng = load(c, progress=None)
    assert eng.context.backend == "cpu" and eng.gpu.backend == "cpu" and eng.gpu.reason
    assert any("cannot be used, running on the CPU only" in r.getMessage() for r in caplog.records)
    with pytest.raises(gpu.GpuError, match="gpu.required is set and gpu.device 0 cannot be used"):
        load(dataclass_replace(c, required=True), progress=None)
