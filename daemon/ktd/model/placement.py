"""The hybrid CPU + GPU placement of a model (the KTransformers split), planned from the GGUF
header alone: what must sit in VRAM (everything read every token: attention, dense FFN layers,
shared experts, router, embeddings and output head, and the KV cache), what stays in host memory
(the routed experts), and how many routed experts per MoE layer the leftover VRAM could also hold
(``experts``: "none", a number per layer, or "hot": as many as fit; which ones comes from the
routing profile at load). ``ktd inspect --vram SIZE`` prints it; an impossible plan says by how
much it misses and what would make it fit.

Nothing here runs anything on a GPU: the CUDA backend (native/src/cuda) will load by this plan.
"""

from __future__ import annotations

import re
from typing import Any

from ktd import GGUFError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_EXPERT_LAYER = re.compile(r"^blk\.(\d+)\.")


def parse_size(text: str) -> int:
    """'24G', '24GiB', '16000M', '123456' → bytes (binary units: a GPU's "24 GB" is 24 GiB)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 24G, 80GiB, 16000M)")
    return int(float(m.group(1)) * _UNIT[m.group(2).upper()])


def hybrid_plan(tensors: dict[str, Any], classes: dict[str, str], n_expert: int | None,
                kv_cache_bytes: int, vram_budget: int, experts: str | int = "none",
                reserve_bytes: int = 512 << 20, layers: int = 0, n_layer: int = 0) -> dict[str, Any]:
    """The split of a model's bytes between VRAM and host memory.

    tensors: name → object with ``nbytes``; classes: name → placement class (ktd.model.inspect);
    reserve_bytes: VRAM kept for activations, scratch and the CUDA context; layers: how many layers
    (from the first) have their dense part on the GPU, 0 = all (gpu.layers): the others' tensors
    and their share of the KV cache (kv_cache_bytes x (n_layer - layers) / n_layer) stay in host
    memory; the embeddings and the output head stay on the GPU.
    """
    if vram_budget <= 0:
        raise ValueError("the VRAM budget must be positive")
    if layers < 0:
        raise ValueError(f"gpu layers must be >= 0, not {layers}")
    partial = 0 < layers < n_layer
    host_dense = 0
    host_kv = 0
    if partial:
        host_kv = kv_cache_bytes * (n_layer - layers) // n_layer
        kv_cache_bytes -= host_kv
    device_by_class: dict[str, int] = {}
    host = 0
    per_layer_expert: dict[int, int] = {}   # MoE layer → bytes of one routed expert (gate+up+down)
    for name, t in tensors.items():
        cls = classes[name]
        if cls == "routed_expert":
            host += t.nbytes
            if not n_expert:
                raise GGUFError(f"tensor '{name}' is a routed expert but the model has no expert count")
            m = _EXPERT_LAYER.match(name)
            layer = int(m.group(1)) if m else -1
            per_layer_expert[layer] = per_layer_expert.get(layer, 0) + t.nbytes // n_expert
        elif partial and (m := _EXPERT_LAYER.match(name)) and int(m.group(1)) >= layers:
            host_dense += t.nbytes
        else:
            device_by_class[cls] = device_by_class.get(cls, 0) + t.nbytes
    dense = sum(device_by_class.values())
    needed = dense + kv_cache_bytes + reserve_bytes
    one_expert_all_layers = sum(per_layer_expert.values())   # one more expert in every MoE layer
    left = vram_budget - needed
    if experts == "none":
        per_layer = 0
    elif experts == "hot":
        per_layer = max(0, left // one_expert_all_layers) if one_expert_all_layers else 0
        per_layer = min(per_layer, n_expert or 0)
    else:
        per_layer = int(experts)
        if per_layer < 0 or (n_expert is not None and per_layer > n_expert):
            raise ValueError(f"experts per layer must be in [0, {n_expert}], not {per_layer}")
    gpu_experts = per_layer * one_expert_all_layers
    device = needed + gpu_experts
    plan: dict[str, Any] = {
        "vram_budget": vram_budget,
        "device": {"by_class": dict(sorted(device_by_class.items(), key=lambda kv: -kv[1])),
                   "weights": dense, "kv_cache": kv_cache_bytes, "reserve": reserve_bytes,
                   "routed_experts": gpu_experts, "total": device},
        "host": {"routed_experts": host - gpu_experts, "dense": host_dense, "kv_cache": host_kv,
                 "total": host - gpu_experts + host_dense + host_kv},
        "layers_on_gpu": layers if partial else n_layer,
        "n_layer": n_layer,
        "experts_per_layer_on_gpu": per_layer,
        "moe_layers": len(per_layer_expert),
        "fits": device <= vram_budget,
    }
    if device > vram_budget:
        short = device - vram_budget
        fixes = []
        if gpu_experts:
            fixes.append("fewer experts on the GPU")
        if kv_cache_bytes:
            fixes.append("a smaller KV cache (model.n_ctx x model.n_seq_max)")
        fixes.append("a larger card")
        plan["reason"] = (f"the GPU part needs {_gib(device)} (weights {_gib(dense)}, KV cache {_gib(kv_cache_bytes)}, "
                          f"reserve {_gib(reserve_bytes)}, experts {_gib(gpu_experts)}), "
                          f"{_gib(short)} more than the {_gib(vram_budget)} budget: {', '.join(fixes)}")
    return plan


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def render(plan: dict[str, Any]) -> list[str]:
    d = plan["device"]
    lines = [f"hybrid plan (VRAM budget {_gib(plan['vram_budget'])}): "
             + ("fits" if plan["fits"] else "does not fit"),
             f"  GPU   {_gib(d['total'])}: weights {_gib(d['weights'])} ("
             + ", ".join(f"{c} {_gib(b)}" for c, b in d["by_class"].items())
             + f"), KV cache {_gib(d['kv_cache'])}, reserve {_gib(d['reserve'])}"
             + (f", {plan['experts_per_layer_on_gpu']} routed experts per layer {_gib(d['routed_experts'])}"
                if d["routed_experts"] else ""),
             f"  CPU   {_gib(plan['host']['routed_experts'])} of routed experts "
             f"({plan['moe_layers']} MoE layers; only activations cross PCIe)"]
    h = plan["host"]
    if h.get("dense"):
        lines.append(f"  CPU   also layers {plan['layers_on_gpu']}..{plan['n_layer'] - 1} (gpu.layers = "
                     f"{plan['layers_on_gpu']}): weights {_gib(h['dense'])}, KV cache {_gib(h['kv_cache'])}")
    if not plan["fits"]:
        lines.append(f"  {plan['reason']}")
    return lines
