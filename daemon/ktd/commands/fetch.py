"""``ktd fetch``: fetch the known real models into the cache and verify them."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("fetch", help="fetch a known model into the cache (SHA-256 verified)")
    p.add_argument("names", nargs="*", metavar="NAME", help="model name (see --list)")
    p.add_argument("--all", action="store_true", help="fetch every known model")
    p.add_argument("--list", action="store_true", help="list the known models and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from ktd.ops import models
    from ktd.cli import UserError

    if args.list:
        for m in models.MODELS.values():
            state = "cached" if models.is_cached(m.name) else "not cached"
            print(f"{m.name:22} {state:11} {m.description}")
        return 0
    names = list(models.MODELS) if args.all else args.names or [models.DEFAULT_MODEL]
    for name in names:
        try:
            print(models.fetch(name))
        except models.FetchError as e:
            raise UserError(str(e)) from None
    return 0
