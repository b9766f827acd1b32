"""What a GGUF model file holds and what decoding with it costs: the data behind ``ktd inspect``.

:func:`inspect_model` returns plain data (JSON-serialisable); :func:`render` turns it into the
human-readable report. Nothing here touches tensor data: only the header is read.

Bytes read per decoded token: decoding one token streams every weight the forward uses once —
every tensor of every dense layer, the output head, and for MoE layers only ``n_expert_used`` of
the ``n_expert`` routed experts (whose last GGML dimension is the expert) plus the shared experts
(counted in full like any dense tensor). Lookup tables (the token embedding) contribute one row,
which is ignored — except that when there is no ``output.weight`` the token embedding *is* the
output head (tied embeddings) and is read in full.

Which tensors are routed experts, shared experts, router, embedding or output is each tensor's
placement class: the one the engine loads and places it by (its architecture's tensor table,
``ktd._native.Model.tensor_classes``) where ktd runs the file's architecture, and llama.cpp's
naming (``*_exps*``, ``*_shexp*``, ``ffn_gate_inp``, ...) for the tensors no table names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ktd import GGUFError

from ktd.ops import machine
from ktd.model.gguf import GGUFFile

# Tensors read one row per token (a lookup, not a matrix product); not counted per token unless
# one of them doubles as the output head.
LOOKUP_TABLES = frozenset({"token_embd.weight", "position_embd.weight", "token_types.weight"})
OUTPUT_HEAD = "output.weight"
TIED_HEAD = "token_embd.weight"


def _json_value(v: Any) -> Any:
    """A metadata value as plain JSON-able data (arrays -> lists, invalid-UTF-8 bytes -> str)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    return v


def _get_str(f: GGUFFile, key: str) -> str | None:
    if key not in f.metadata:
        return None
    if f.metadata_type(key) != "STRING":
        raise GGUFError(f"{f.path}: key '{key}' must be a STRING, not {f.metadata_type(key)}")
    return _json_value(f.metadata[key])


_INT_TYPES = frozenset({"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"})


def _get_count(f: GGUFFile, key: str) -> int | None:
    """A non-negative integer key, or None when absent."""
    if key not in f.metadata:
        return None
    value = f.metadata[key]
    if f.metadata_type(key) not in _INT_TYPES or value < 0:
        raise GGUFError(f"{f.path}: key '{key}' must be a non-negative integer, "
                        f"found {f.metadata_type(key)} {_json_value(value)!r}")
    return value


def class_from_name(name: str) -> str:
    """A tensor's placement class from llama.cpp's naming alone."""
    if name in LOOKUP_TABLES:
        return "embedding"
    if name.startswith("output"):
        return "output"
    if "_exps" in name:
        return "routed_expert"
    if "_shexp" in name:
        return "shared_expert"
    if ".ffn_gate_inp." in name or ".exp_probs_b." in name:
        return "router"
    return "dense"


def placement_classes(f: GGUFFile) -> dict[str, str]:
    """{tensor name: placement class} for every tensor of the file (module docstring)."""
    from ktd import _native

    try:
        table = _native.Model.tensor_classes(f.path)
    except (GGUFError, OSError, ValueError):  # an architecture or metadata the engine does not run
        table = {}
    return {name: table.get(name) or class_from_name(name) for name in f.tensors}


def bytes_per_token(f: GGUFFile, arch: str | None, classes: dict[str, str]) -> dict[str, Any]:
    """Weight bytes one decoded token reads, split into dense, routed experts and output head."""
    tensors = f.tensors
    expert_tensors = [t for t in tensors.values() if classes[t.name] == "routed_expert"]
    n_expert = n_expert_used = None
    routed_bytes_all = routed_bytes = 0
    if expert_tensors:
        n_expert = _get_count(f, f"{arch}.expert_count") if arch else None
        n_expert_used = _get_count(f, f"{arch}.expert_used_count") if arch else None
        if not n_expert or n_expert_used is None:
            raise GGUFError(f"{f.path}: expert tensors (e.g. '{expert_tensors[0].name}') but no valid "
                            f"{arch}.expert_count / {arch}.expert_used_count")
        if n_expert_used > n_expert:
            raise GGUFError(f"{f.path}: {arch}.expert_used_count = {n_expert_used} exceeds "
                            f"{arch}.expert_count = {n_expert}")
        for t in expert_tensors:
            # GGML order: the expert index is the outermost (last) dimension.
            if t.shape[-1] != n_expert:
                raise GGUFError(f"{f.path}: tensor '{t.name}': last dimension {t.shape[-1]} "
                                f"is not {arch}.expert_count = {n_expert}")
            routed_bytes_all += t.nbytes
            routed_bytes += t.nbytes // n_expert * n_expert_used

    head = tensors.get(OUTPUT_HEAD) or tensors.get(TIED_HEAD)
    head_bytes = head.nbytes if head is not None else 0
    dense_bytes = sum(t.nbytes for t in tensors.values()
                      if classes[t.name] != "routed_expert" and t.name not in LOOKUP_TABLES and t.name != OUTPUT_HEAD)
    return {
        "total": dense_bytes + routed_bytes + head_bytes,
        "dense": dense_bytes,
        "routed_experts": routed_bytes,
        "routed_experts_all": routed_bytes_all,  # all experts, as stored
        "output_head": head_bytes,
        "output_head_tensor": head.name if head is not None else None,
        "n_expert": n_expert,
        "n_expert_used": n_expert_used,
    }


def _kv_bytes_per_token(arch: str | None, hp: dict[str, Any]) -> int | None:
    """F16 KV-cache bytes one token of context takes in one sequence (all layers)."""
    n_layer = hp.get("block_count")
    if not isinstance(n_layer, int):
        return None
    if "attention.kv_lora_rank" in hp:  # MLA: the compressed latent + the shared rope key
        return n_layer * (int(hp["attention.kv_lora_rank"]) + int(hp.get("rope.dimension_count", 0))) * 2
    n_head = hp.get("attention.head_count")
    n_head_kv = hp.get("attention.head_count_kv", n_head)
    n_embd = hp.get("embedding_length")
    if not all(isinstance(v, int) and v > 0 for v in (n_head, n_head_kv, n_embd)):
        return None  # per-layer head counts (arrays) or missing keys: not planned here
    k_dim = hp.get("attention.key_length", n_embd // n_head)
    v_dim = hp.get("attention.value_length", n_embd // n_head)
    return n_layer * n_head_kv * (k_dim + v_dim) * 2


def memory_plan(f: GGUFFile, arch: str | None, hparams: dict[str, Any], n_ctx: int, n_seq: int,
                weights_map: str = "arena") -> dict[str, Any]:
    """What loading the model takes: the file (mapped while loading, released after), the weights
    arena (tensors whose block type has a row-interleaved layout are repacked there at load, but
    an output head whose type streams faster plain at one row (kernels.gemv_plain) is not; the
    other matrices and token_embd's lookup rows copied as they are; a tied output head is a
    second copy of token_embd besides, repacked where the type repacks, plain otherwise), the KV
    cache, and the 2 MiB huge pages the arena would need.
    ``weights_map`` (model.weights_map): with gguf the matrices and token_embd are served from the
    file's mapping (``file_served_weights``) and the arena holds only those whose data is not aligned
    as the plain kernels read them (copied; _native.plain_alignment), nothing repacked.
    Tensor types without kernels are listed: such a model fails at load."""
    from ktd import _native

    k = _native.kernels
    supported = set(k.supported_types("ref"))
    def repacks(t, head: bool = False) -> bool:
        # The output head stays plain where the type's plain rows stream faster at n = 1
        # (model_load.cpp, repack_matrix).
        return (t.type_name in supported and k.repack_rows(t.type_name) > 0
                and not (head and k.gemv_plain(t.type_name)))

    matrices = [t for t in f.tensors.values() if len(t.shape) >= 2 and t.name not in LOOKUP_TABLES]
    repacked = sum(t.nbytes for t in matrices if repacks(t, head=t.name == OUTPUT_HEAD))
    copied = sum(t.nbytes for t in matrices if not repacks(t, head=t.name == OUTPUT_HEAD))
    embd = f.tensors.get("token_embd.weight")
    if embd is not None:
        copied += embd.nbytes  # the rows the embedding lookup reads
        if "output.weight" not in f.tensors:  # tied: token_embd is also the output head
            if repacks(embd, head=True):
                repacked += embd.nbytes
            else:  # kept plain: a copy of its own besides the lookup rows, as the load makes
                copied += embd.nbytes
    served = 0
    if weights_map == "gguf":
        weights = matrices + ([embd] if embd is not None else [])
        aligned = [t for t in weights if t.offset % _native.plain_alignment(t.type_id) == 0]
        served = sum(t.nbytes for t in aligned)
        repacked, copied = 0, sum(t.nbytes for t in weights) - served
    unsupported = sorted({t.type_name for t in f.tensors.values() if t.type_name not in supported})
    kv_per_token = _kv_bytes_per_token(arch, hparams)
    hugepage = 2 << 20
    return {
        "mapped_file": f.file_size,
        "weights_map": weights_map,
        "file_served_weights": served,
        "arena_repacked_weights": repacked,
        "arena_copied_weights": copied,
        "arena_hugepages_2M": -(-(repacked + copied) // hugepage),
        "kv_bytes_per_token": kv_per_token,
        "n_ctx": n_ctx,
        "n_seq_max": n_seq,
        "kv_cache": kv_per_token * n_ctx * n_seq if kv_per_token is not None else None,
        "unsupported_types": unsupported,
    }


def inspect_model(path: str, *, n_ctx: int = 4096, n_seq: int = 8, vram: int | None = None,
                  gpu_experts: str | int = "none", gpu_layers: int = 0,
                  weights_map: str | None = None) -> dict[str, Any]:
    """Everything ``ktd inspect`` reports about a model file, as plain data; with ``vram`` (bytes)
    also the hybrid CPU + GPU placement plan (ktd.model.placement). ``weights_map``: the memory plan's
    model.weights_map (None: the default configuration's, with its KTD_* overrides)."""
    f = GGUFFile(path, willneed=False)  # header only: no readahead of the weights
    arch = _get_str(f, "general.architecture")

    hparams: dict[str, Any] = {}
    if arch:
        prefix = arch + "."
        for key in f.metadata:
            if key.startswith(prefix):
                hparams[key[len(prefix):]] = _json_value(f.metadata[key])

    tokens_type = f.metadata_array_type("tokenizer.ggml.tokens") if "tokenizer.ggml.tokens" in f.metadata else None
    if tokens_type not in (None, "STRING"):
        raise GGUFError(f"{f.path}: key 'tokenizer.ggml.tokens' must be an array of STRING, "
                        f"not of {tokens_type}")
    tokenizer = {
        "model": _get_str(f, "tokenizer.ggml.model"),
        "vocab_size": len(f.metadata["tokenizer.ggml.tokens"]) if tokens_type else None,
        "chat_template": "tokenizer.chat_template" in f.metadata,
    }

    classes = placement_classes(f)
    by_type: dict[str, dict[str, int]] = {}
    by_class: dict[str, dict[str, int]] = {}
    for t in f.tensors.values():
        for table, key in ((by_type, t.type_name), (by_class, classes[t.name])):
            entry = table.setdefault(key, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += t.nbytes

    report: dict[str, Any] = {
        "path": f.path,
        "file_size": f.file_size,
        "gguf_version": f.version,
        "alignment": f.alignment,
        "data_offset": f.data_offset,
        "name": _get_str(f, "general.name"),
        "architecture": arch,
        "hyperparameters": hparams,
        "tokenizer": tokenizer,
        "tensors": {
            "count": len(f.tensors),
            "bytes": sum(t.nbytes for t in f.tensors.values()),
            "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
            "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]["bytes"])),
        },
        "bytes_per_token": bytes_per_token(f, arch, classes),
    }
    if weights_map is None:
        from ktd.ops import config as ktd_config
        try:
            weights_map = ktd_config.load(None).model.weights_map
        except ktd_config.ConfigError:
            weights_map = "arena"
    report["memory_plan"] = memory_plan(f, arch, hparams, n_ctx, n_seq, weights_map)
    if vram is not None:
        from ktd.model.placement import hybrid_plan
        report["hybrid_plan"] = hybrid_plan(f.tensors, classes, report["bytes_per_token"]["n_expert"],
                                            report["memory_plan"]["kv_cache"] or 0, vram, gpu_experts,
                                            layers=gpu_layers, n_layer=int(hparams.get("block_count") or 0))
    # This machine: CPU features and the kernel ISA they select, topology, huge pages.
    report["machine"] = machine.describe()
    report["numa_plan"] = numa_plan(f, sorted(set(report["machine"]["thread_pool"]["nodes"])), classes)
    report["weights_cache"] = weights_cache_report(path)
    return report


def weights_cache_report(path: str) -> dict[str, Any]:
    """The prepared-weights cache entries of this model file (model.weights_cache of the default
    configuration with its KTD_* overrides): directory, entries (path, bytes, stale), total bytes."""
    from ktd.ops import config as ktd_config
    from ktd.ops import weights_cache
    try:
        d = weights_cache.configured_dir(ktd_config.load(None).model.weights_cache)
    except ktd_config.ConfigError:
        d = None
    es = [{"path": e["path"], "bytes": e["bytes"], "stale": e["stale"]} for e in weights_cache.for_model(d, path)]
    return {"dir": d, "entries": es, "bytes": sum(e["bytes"] for e in es)}


def numa_plan(f: GGUFFile, nodes: list[int], classes: dict[str, str] | None = None) -> dict[str, Any]:
    """How loading on this machine's default pool (every usable node) would place the routed
    experts with ``numa.experts: shard``: per node the bytes of its row slices (in the file's
    format; repacking keeps the size within a few percent). One node: nothing is sharded."""
    from ktd import _native

    classes = classes if classes is not None else placement_classes(f)
    per_node = [0] * len(nodes)
    for t in f.tensors.values():
        if classes[t.name] != "routed_expert" or len(t.shape) != 3:
            continue
        rows, n_mat = t.shape[1], t.shape[2]  # GGML order: ne = [k, rows, n_expert]
        if rows * n_mat == 0:
            continue
        row_bytes = t.nbytes // (rows * n_mat)
        for i in range(len(nodes)):
            r0, r1 = _native.numa_slice_rows(rows, len(nodes), i)
            per_node[i] += (r1 - r0) * row_bytes * n_mat
    sharded = len(nodes) > 1 and any(per_node)
    return {"nodes": [{"node": n, "expert_bytes": b if sharded else 0} for n, b in zip(nodes, per_node)],
            "experts_sharded": sharded, "dense": "interleave" if len(nodes) > 1 else "local"}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.1f} {unit})"
    return f"{n:,} B"


def _short(v: Any, width: int = 60) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"  # metadata floats are mostly FLOAT32: 7 significant digits
    s = repr(v) if not isinstance(v, str) else v
    if isinstance(v, list) and len(s) > width:
        s = f"[{len(v)} values]"
    return s if len(s) <= width else s[: width - 3] + "..."


def render(r: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [
        f"model       {r['path']}",
        f"file        {_size(r['file_size'])}, GGUF v{r['gguf_version']}, alignment {r['alignment']}, "
        f"tensor data at byte {r['data_offset']:,}",
        f"name        {r['name'] or '(none)'}",
        f"arch        {r['architecture'] or '(none)'}",
    ]
    if r["hyperparameters"]:
        lines.append(f"hyperparameters ({r['architecture']}.*)")
        for key, value in r["hyperparameters"].items():
            lines.append(f"  {key:40} {_short(value)}")
    tok = r["tokenizer"]
    vocab = f"{tok['vocab_size']:,}" if tok["vocab_size"] is not None else "(no token list)"
    lines.append(f"tokenizer   {tok['model'] or '(none)'}, vocab {vocab}, "
                 f"chat template {'present' if tok['chat_template'] else 'absent'}")
    t = r["tensors"]
    lines.append(f"tensors     {t['count']:,}, {_size(t['bytes'])}")
    for type_name, e in t["by_type"].items():
        lines.append(f"  {type_name:8} {e['count']:5} tensors  {_size(e['bytes'])}")
    lines.append("  placement: " + ", ".join(f"{c} {_size(e['bytes'])} ({e['count']})" for c, e in t["by_class"].items()))
    b = r["bytes_per_token"]
    wc = r.get("weights_cache")
    if wc:
        if wc["dir"] is None:
            lines.append("weights cache  off (model.weights_cache)")
        else:
            stale = sum(1 for e in wc["entries"] if e["stale"])
            lines.append(f"weights cache  {len(wc['entries'])} entries for this file, {_size(wc['bytes'])} "
                         f"in {wc['dir']}" + (f" ({stale} stale)" if stale else ""))
    lines.append(f"per token   {_size(b['total'])} of weights read per decoded token")
    lines.append(f"  dense layers   {_size(b['dense'])}")
    if b["n_expert"]:
        lines.append(f"  routed experts {_size(b['routed_experts'])} "
                     f"({b['n_expert_used']} of {b['n_expert']} experts; {_size(b['routed_experts_all'])} stored)")
    head = f" ({b['output_head_tensor']}{', tied embeddings' if b['output_head_tensor'] == TIED_HEAD else ''})"
    lines.append(f"  output head    {_size(b['output_head'])}{head if b['output_head_tensor'] else ''}")
    if "memory_plan" in r:
        p = r["memory_plan"]
        lines.append("memory plan")
        if p.get("weights_map") == "gguf":
            lines.append(f"  model file         {_size(p['mapped_file'])} (mapped while serving, page cache; "
                         f"model.weights_map: gguf)")
            lines.append(f"  served from file   {_size(p['file_served_weights'])} of matrices and token_embd, "
                         f"plain layout, nothing repacked")
            if p["arena_copied_weights"]:
                lines.append(f"  copied             {_size(p['arena_copied_weights'])} (data not aligned as the "
                             f"plain kernels read it)")
        else:
            lines.append(f"  model file         {_size(p['mapped_file'])} (read while loading, page cache)")
            lines.append(f"  weights arena      {_size(p['arena_repacked_weights'])} repacked at load + "
                         f"{_size(p['arena_copied_weights'])} copied "
                         f"({p['arena_hugepages_2M']} huge pages of 2 MiB for hugepages: hugetlb)")
        if p["kv_cache"] is not None:
            lines.append(f"  KV cache (F16)     {_size(p['kv_cache'])} for {p['n_seq_max']} slots x {p['n_ctx']} tokens "
                         f"({_size(p['kv_bytes_per_token'])} per token)")
        if p["unsupported_types"]:
            lines.append(f"  unsupported types  {', '.join(p['unsupported_types'])} (the model cannot be loaded)")
    if "hybrid_plan" in r:
        from ktd.model.placement import render as render_plan
        lines += render_plan(r["hybrid_plan"])
    if "numa_plan" in r:
        n = r["numa_plan"]
        if n["experts_sharded"]:
            per = ", ".join(f"node {x['node']} {_size(x['expert_bytes'])}" for x in n["nodes"])
            lines.append(f"numa plan   {len(n['nodes'])} nodes; experts sharded by row slices: {per}; "
                         f"dense weights {n['dense']}")
        else:
            lines.append(f"numa plan   {len(n['nodes'])} node(s); nothing sharded, dense weights {n['dense']}")
    if "machine" in r:
        lines.append("machine")
        lines += [f"  {line}" for line in machine.summary_lines(r["machine"])]
    return "\n".join(lines)
