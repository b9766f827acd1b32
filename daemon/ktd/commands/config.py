"""``ktd config check [FILE]`` and ``ktd config explain``."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("config", help="validate or explain the daemon configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = csub.add_parser("check", help="validate FILE (default /etc/ktd/ktd.yaml, with KTD_* "
                        "environment overrides) and print the effective configuration")
    c.add_argument("file", nargs="?", default=None, metavar="FILE")
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing when valid")
    c.set_defaults(func=run_check)
    e = csub.add_parser("explain", help="list every key with its default, unit and effect")
    e.set_defaults(func=run_explain)


def run_check(args) -> int:
    from ktd.ops import config
    from ktd.cli import UserError

    try:
        cfg = config.load(args.file or config.DEFAULT_PATH)
    except config.ConfigError as e:
        raise UserError(str(e)) from None
    if not args.quiet:
        print(config.dump(cfg), end="")
    return 0


def run_explain(args) -> int:
    from ktd.ops import config
    print(config.explain())
    return 0
