"""``ktd inspect MODEL.gguf``: what a model file holds and what running it will cost."""

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
    p.add_argument("--n-ctx", type=int, default=4096, help="context per sequence for the KV cache figures")
    p.add_argument("--n-seq", type=int, default=8, help="KV-cache slots for the KV cache figures")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from ktd.cli import UserError
    from ktd.inspect import inspect_model, render
    from ktd.placement import parse_size

    vram = None
    experts = args.gpu_experts
    try:
        if args.vram is not None:
            vram = parse_size(args.vram)
        if experts not in ("none", "hot"):
            experts = int(experts)
    except ValueError as e:
        raise UserError(f"inspect: {e}") from None
    try:
        report = inspect_model(args.model, n_ctx=args.n_ctx, n_seq=args.n_seq, vram=vram, gpu_experts=experts)
    except ValueError as e:
        if type(e) is not ValueError:   # GGUFError and friends keep their own handling
            raise
        raise UserError(f"inspect: {e}") from None
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
