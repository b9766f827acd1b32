"""The daemon's GPU policy (config section ``gpu``): whether this load runs the hybrid CPU + GPU
forward, on which backend, with which VRAM plan — decided before the weights are read, so a
wrong configuration fails in a second and names its numbers.

- ``gpu.device`` unset (default): CPU only; nothing is probed.
- ``gpu.device`` set: the VRAM plan (ktd.model.placement, from the GGUF header) is computed against
  ``gpu.vram_budget`` and a plan that does not fit is refused at load with the numbers, on any
  machine (a configuration error is one everywhere). Then the backend is checked:
  ``gpu.backend: cuda`` needs ``cuda_status()`` available and the device index present, and then
  the model's architecture supported by the CUDA device backend (model/cuda_device.h: checked when
  the engine sets it up, ktd.server.engine.load, with the same required/fallback rule); ``loopback`` (the hybrid data flow with the CPU playing
  the device: a diagnostic, and how CI drives the daemon through HybridBackend) always can.
- The GPU cannot be used: with ``gpu.required`` the load fails with the reason; otherwise the
  reason is logged as a warning and the daemon runs on the CPU (what Ollama and llama.cpp do on
  a host without a usable GPU), and ``status`` shows ``gpu.backend: cpu`` with the reason.
- ``gpu.experts: hot`` (or a number): the routed experts of each layer the leftover VRAM holds,
  the most used per the routing profile (without a profile yet: the first ones), and the share of
  routed tokens they took over the profile. The device computes the pairs routed to them (the
  host still routes every token); ``status`` gives the live hit rate (``hybrid.hot_hit_rate``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger("ktd.model.gpu")


class GpuError(ValueError):
    """The GPU configuration cannot be honoured (plan over budget, or gpu.required and no GPU)."""


@dataclass
class GpuDecision:
    backend: str                       # "cpu", "loopback" or "cuda"
    device: int | None = None
    reason: str | None = None          # why the GPU is not used (backend "cpu" with gpu.device set)
    plan: dict[str, Any] | None = None
    hot: dict[str, Any] | None = None  # {"per_layer": {layer: [experts]}, "hit_rate": float, "routed": int}
    held: dict[int, list[int]] = field(default_factory=dict)  # the experts the device holds, per layer
    notes: list[str] = field(default_factory=list)
    pool_spin_us: int | None = None    # the CPU pool's spin while the hybrid backend runs (gpu.pool_spin_us)

    def summary(self, hybrid_stats: dict[str, int] | None = None) -> dict[str, Any]:
        """The ``gpu`` part of ``status`` (docs/PROTOCOL.md)."""
        out: dict[str, Any] = {"backend": self.backend, "device": self.device}
        if self.reason:
            out["reason"] = self.reason
        if self.plan is not None:
            p = self.plan
            out["plan"] = {"vram_budget": p["vram_budget"], "fits": p["fits"],
                           "gpu_bytes": p["device"]["total"], "cpu_bytes": p["host"]["total"],
                           "gpu": {k: v for k, v in p["device"].items() if k != "by_class"},
                           "gpu_by_class": p["device"]["by_class"], "cpu": p["host"],
                           "layers_on_gpu": p["layers_on_gpu"], "n_layer": p["n_layer"],
                           "experts_per_layer_on_gpu": p["experts_per_layer_on_gpu"]}
        if self.hot is not None:
            out["hot_experts"] = {"hit_rate": self.hot["hit_rate"], "routed": self.hot["routed"],
                                  "per_layer": {str(k): v for k, v in self.hot["per_layer"].items()}}
        if self.notes:
            out["notes"] = list(self.notes)
        if hybrid_stats is not None and self.backend != "cpu":
            out["hybrid"] = dict(hybrid_stats)
            if self.pool_spin_us is not None:
                out["hybrid"]["pool_spin_us"] = self.pool_spin_us
            if self.held and hybrid_stats.get("routed_pairs"):
                out["hybrid"]["hot_hit_rate"] = hybrid_stats["device_pairs"] / hybrid_stats["routed_pairs"]
        return out


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable: what the loopback "device" may use when gpu.vram_budget is auto."""
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise GpuError(f"{meminfo} has no MemAvailable line")


def file_plan(path: str, *, n_ctx: int, n_seq: int, vram_budget: int, experts: str | int,
              layers: int) -> dict[str, Any]:
    """ktd.model.placement.hybrid_plan for a GGUF file, from its header (what ``ktd inspect --vram``
    computes, without the rest of the report)."""
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import _get_str, bytes_per_token, memory_plan, placement_classes
    from ktd.model.placement import hybrid_plan

    f = GGUFFile(path, willneed=False)
    arch = _get_str(f, "general.architecture")
    hparams = {k[len(arch) + 1:]: v for k, v in f.metadata.items() if arch and k.startswith(arch + ".")}
    classes = placement_classes(f)
    n_expert = bytes_per_token(f, arch, classes)["n_expert"]
    kv = memory_plan(f, arch, hparams, n_ctx, n_seq)["kv_cache"] or 0
    n_layer = int(hparams.get("block_count") or 0)
    return hybrid_plan(f.tensors, classes, n_expert, kv, vram_budget, experts, layers=layers, n_layer=n_layer)


def hot_experts(counts: np.ndarray, per_layer: int) -> dict[str, Any]:
    """The ``per_layer`` most used experts of each MoE layer (ties: lower index first) and the
    share of all routed tokens those experts received (the hit rate a GPU holding them would have
    had over the profile; 0 for an empty profile)."""
    counts = np.asarray(counts, np.uint64)
    chosen: dict[int, list[int]] = {}
    hit = 0
    for il, row in enumerate(counts):
        if per_layer <= 0 or not row.any():
            continue
        top = np.argsort(-row.astype(np.int64), kind="stable")[:per_layer]
        chosen[il] = sorted(int(e) for e in top)
        hit += int(row[top].sum())
    routed = int(counts.sum())
    return {"per_layer": chosen, "hit_rate": hit / routed if routed else 0.0, "routed": routed}


def _profile_counts(model_path: str, profile_dir: str, shape: tuple[int, int]) -> np.ndarray | None:
    from ktd.ops import routing_profile
    if profile_dir == "off":
        return None
    directory = routing_profile.default_dir() if profile_dir == "auto" else Path(profile_dir)
    try:
        key = routing_profile.model_key(model_path)
    except (OSError, ValueError):
        return None
    prof = routing_profile.RoutingProfile(directory, key, shape)
    counts = prof.counts()
    return counts if counts.any() else None


# Test hook: gpu.backend cuda runs over the CUDA ABI's host emulation (Context backend
# "cuda-emulated", native/src/cuda/emu_device.cpp), so the daemon's whole path through the CUDA
# device backend is tested without a GPU. Never set in production.
TEST_EMULATED_ENV = "KTD_TEST_CUDA_EMULATED"


def cuda_backend_name() -> str:
    """The Context backend that plays gpu.backend: cuda ("cuda", or "cuda-emulated" under the test hook)."""
    return "cuda-emulated" if os.environ.get(TEST_EMULATED_ENV) == "1" else "cuda"


def _emulated_status() -> dict[str, Any]:
    return {"available": True, "devices": 1, "library": "emulated",
            "reason": f"the CUDA ABI emulated on the host ({TEST_EMULATED_ENV}=1: tests only)"}


def decide(config: Any, *, cuda_status: Callable[[], dict[str, Any]] | None = None,
           meminfo: str = "/proc/meminfo") -> GpuDecision:
    """The GPU decision for ``config`` (a ktd.ops.config.Config) before the model loads.

    Raises GpuError (one line with the numbers) for a plan over budget, or when gpu.required
    is set and the GPU cannot be used; logs a warning and decides "cpu" otherwise."""
    g, mc = config.gpu, config.model
    if g.device is None:
        return GpuDecision("cpu")
    if not mc.path:
        raise GpuError("gpu.device is set but model.path is not")
    status: dict[str, Any] | None = None
    if g.backend == "cuda":
        if cuda_status is None and cuda_backend_name() == "cuda-emulated":
            cuda_status = _emulated_status
        if cuda_status is None:
            from ktd import _native
            cuda_status = _native.cuda_status
        status = dict(cuda_status())
    # The budget: given, or what the device has.
    budget: int | None
    if g.vram_budget != "auto":
        budget = int(g.vram_budget)
    elif g.backend == "loopback":
        budget = host_available_bytes(meminfo)
    else:
        mem = (status or {}).get("device_memory") or []
        budget = int(mem[g.device]) if status and status.get("available") and g.device < len(mem) else None
    n_seq = mc.n_seq_max + config.prefix_cache.slots
    plan = None
    if budget is not None:
        plan = file_plan(mc.path, n_ctx=mc.n_ctx, n_seq=n_seq, vram_budget=budget, experts=g.experts,
                         layers=g.layers)
        if not plan["fits"]:
            raise GpuError(f"gpu: the VRAM plan does not fit (gpu.vram_budget {g.vram_budget}): {plan['reason']}")
        if g.layers > plan["n_layer"] > 0:
            raise GpuError(f"gpu.layers is {g.layers} but the model has {plan['n_layer']} layers")
    decision = GpuDecision(g.backend, g.device, plan=plan)
    if plan is not None and plan["experts_per_layer_on_gpu"] and plan["moe_layers"]:
        per_layer = plan["experts_per_layer_on_gpu"]
        counts = _profile_counts(mc.path, mc.routing_profile, (plan["n_layer"], _n_expert(mc.path)))
        if counts is not None:
            counts = counts.copy()
            counts[plan["layers_on_gpu"]:] = 0  # the layers past gpu.layers run on the CPU
            decision.hot = hot_experts(counts, per_layer)
            decision.held = dict(decision.hot["per_layer"])
        else:
            decision.held = {il: list(range(per_layer)) for il in _moe_layers(mc.path) if il < plan["layers_on_gpu"]}
        decision.notes.append(f"{per_layer} routed experts per layer are held in VRAM and computed there"
                              + ("" if counts is not None else " (no routing profile yet: the first ones; the "
                                 "most used after a restart with a profile)"))
    if plan is not None and plan["layers_on_gpu"] < plan["n_layer"]:
        decision.notes.append(f"gpu.layers {g.layers}: layers {g.layers}..{plan['n_layer'] - 1} run wholly on the CPU "
                              "(their KV cache in host memory); the residual crosses once per chunk")
    unusable: str | None = None
    if g.backend == "cuda":
        assert status is not None
        if not status.get("available"):
            unusable = f"CUDA is not usable: {status.get('reason') or 'unknown reason'}"
        elif g.device >= int(status.get("devices") or 0):
            unusable = f"gpu.device {g.device} does not exist (the CUDA runtime sees {status.get('devices')})"
        if budget is None and unusable is None:
            unusable = "the device's memory is unknown: set gpu.vram_budget"
    if unusable is not None:
        if g.required:
            raise GpuError(f"gpu.required is set and gpu.device {g.device} cannot be used: {unusable}")
        log.warning("gpu.device %d cannot be used, running on the CPU only: %s (set gpu.required: true to "
                    "refuse to start instead)", g.device, unusable)
        decision.backend, decision.reason = "cpu", unusable
        return decision
    if plan is not None:
        from ktd.model.placement import render
        for line in render(plan):
            log.info("%s", line)
    if decision.hot is not None:
        log.info("hot experts: %.1f%% of the %d profiled routed tokens went to the planned experts",
                 100 * decision.hot["hit_rate"], decision.hot["routed"])
    for note in decision.notes:
        log.info("gpu: %s", note)
    log.info("hybrid forward on %s (device %d)", g.backend, g.device)
    return decision


def _moe_layers(path: str) -> list[int]:
    from ktd.model.gguf import GGUFFile

    f = GGUFFile(path, willneed=False)
    return sorted(int(name.split(".")[1]) for name in f.tensors if name.endswith(".ffn_gate_exps.weight"))


def _n_expert(path: str) -> int:
    from ktd.model.gguf import GGUFFile
    from ktd.model.inspect import _get_str

    f = GGUFFile(path, willneed=False)
    arch = _get_str(f, "general.architecture")
    return int(f.metadata.get(f"{arch}.expert_count") or 0)
