"""``ktd inspect MODEL.gguf``: what a model file holds and what running it will cost."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF model and this machine")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from ktd.inspect import inspect_model, render

    report = inspect_model(args.model)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
