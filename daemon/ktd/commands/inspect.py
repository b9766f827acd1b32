"""``ktd inspect MODEL.gguf``: what a model file holds and what running it will cost.

``--prepare`` also loads it as the daemon would (placement and model.weights_cache from the
configuration), with a progress bar on a terminal, which leaves its prepared-weights cache entry
written: run it before a restart to make the restart fast."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF model and this machine")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--vram", metavar="SIZE", default=None,
                   help="plan the hybrid CPU + GPU split for a card of this size (e.g. 24G): what goes to VRAM, "
                        "what stays in host memory")
    p.add_argument("--gpu-experts", metavar="N|hot|none", default="none",
                   help="with --vram: routed experts per MoE layer also in VRAM (a number, hot = as many as fit)")
    p.add_argument("--gpu-layers", metavar="N", type=int, default=0,
                   help="with --vram: layers (from the first) whose dense part goes to the GPU; 0 = all")
    p.add_argument("--n-ctx", type=int, default=4096, help="context per sequence for the KV cache figures")
    p.add_argument("--n-seq", type=int, default=8, help="KV-cache slots for the KV cache figures")
    p.add_argument("--prepare", action="store_true",
                   help="also load the model (placement and model.weights_cache from --config) and "
                        "write its prepared-weights cache entry; reports what the load did")
    p.add_argument("--config", metavar="FILE", default=None, help="ktd.yaml for --prepare and the memory "
                   "plan's model.weights_map (default: built-in defaults with KTD_* overrides)")
    p.set_defaults(func=run)


def _prepare(path: str, config_path: str | None) -> dict:
    import sys
    import time

    from ktd import _native

    from ktd.ops import weights_cache
    from ktd.ops import config as ktd_config
    from ktd.cli import UserError
    from ktd.commands.run import _progress_bar
    from ktd.server.engine import _ProgressReporter, placement_options

    try:
        cfg = ktd_config.load(config_path)
    except ktd_config.ConfigError as e:
        raise UserError(str(e)) from None
    placement = placement_options(cfg)
    if placement["weights_map"] == "auto":  # prepare the entry an auto start maps (a miss would serve the file)
        placement["weights_map"] = "arena"
    cache_dir, why_off = weights_cache.prepare_dir(placement.pop("weights_cache"))
    loading = _native.LoadProgress()
    reporter = _ProgressReporter(loading, _progress_bar) if sys.stderr.isatty() else None
    t0 = time.perf_counter()
    try:
        model = _native.Model(path, n_threads=cfg.model.threads, cache_dir=cache_dir, progress=loading, **placement)
    finally:
        if reporter:
            reporter.stop()
            sys.stderr.write("\r\x1b[K")
    return {"seconds": round(time.perf_counter() - t0, 3), "repacked_bytes": int(model.repacked_bytes),
            "copied_bytes": int(model.copied_bytes), "weights_cache": {**model.cache, "why_off": why_off},
            "weights_map": model.memory["weights_map"], "file_mapped_bytes": int(model.memory["file_bytes"]),
            "weights_map_note": model.memory["weights_map_note"]}


def run(args) -> int:
    import json

    from ktd.cli import UserError
    from ktd.model.inspect import inspect_model, render
    from ktd.model.placement import parse_size

    vram = None
    experts = args.gpu_experts
    try:
        if args.vram is not None:
            vram = parse_size(args.vram)
        if experts not in ("none", "hot"):
            experts = int(experts)
    except ValueError as e:
        raise UserError(f"inspect: {e}") from None
    weights_map = None  # the default configuration's
    if args.config:
        from ktd.ops import config as ktd_config
        try:
            weights_map = ktd_config.load(args.config).model.weights_map
        except ktd_config.ConfigError as e:
            raise UserError(str(e)) from None
    try:
        report = inspect_model(args.model, n_ctx=args.n_ctx, n_seq=args.n_seq, vram=vram, gpu_experts=experts,
                               gpu_layers=args.gpu_layers, weights_map=weights_map)
    except ValueError as e:
        if type(e) is not ValueError:   # GGUFError and friends keep their own handling
            raise
        raise UserError(f"inspect: {e}") from None
    if args.prepare:
        report["prepare"] = _prepare(args.model, args.config)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(render(report))
    if args.prepare:
        p, c = report["prepare"], report["prepare"]["weights_cache"]
        mib = 1 << 20
        print(f"prepared    in {p['seconds']:.2f} s: {p['repacked_bytes'] / mib:.1f} MiB repacked, "
              f"{p['copied_bytes'] / mib:.1f} MiB copied"
              + (f", {p['file_mapped_bytes'] / mib:.1f} MiB served from the file (weights_map: gguf)"
                 if p["weights_map"] == "gguf" else ""))
        if p["weights_map_note"]:
            print(f"weights map  {p['weights_map_note']}")
        what = {"hit": "read from", "written": "written to"}.get(c["state"], c["state"])
        detail = c["path"] if c["state"] in ("hit", "written") else (c["reason"] or c["why_off"])
        print(f"weights cache  {what} {detail}" + (f" ({c['reason']})" if c["state"] == "written" and c["reason"]
                                                      else ""))
    return 0
