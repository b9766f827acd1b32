"""``ktd cache list|prune|verify``: the prepared-weights cache (``model.weights_cache``)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("cache", help="list, prune or verify the prepared-weights cache")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for name, text in (("list", "every entry: model, size, whether it is current"),
                       ("prune", "remove unusable entries (stale, unreadable, left-over temporary files)"),
                       ("verify", "check every entry's header and checksums")):
        c = csub.add_parser(name, help=text)
        c.add_argument("--dir", metavar="DIR", default=None,
                       help="the cache directory (default: model.weights_cache of --config)")
        c.add_argument("--config", metavar="FILE", default=None, help="ktd.yaml to read model.weights_cache from")
        if name == "prune":
            c.add_argument("--all", action="store_true", help="remove every entry")
        c.set_defaults(func=run)


def _dir(args) -> str:
    from ktd.ops import config as ktd_config
    from ktd.ops import weights_cache
    from ktd.cli import UserError

    if args.dir:
        return args.dir
    try:
        value = ktd_config.load(args.config).model.weights_cache
    except ktd_config.ConfigError as e:
        raise UserError(str(e)) from None
    d = weights_cache.configured_dir(value)
    if d is None:
        raise UserError("model.weights_cache is off (give --dir DIR to look at a directory anyway)")
    return d


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _say_whose(d: str) -> None:
    """A note when this user would not use the directory: entries are judged as this user's load
    would judge them (the daemon's user may trust what root may not, and the other way round)."""
    import os
    import pwd

    from ktd.ops import file_trust

    why = file_trust.directory_problem(d)
    if why:
        owner = os.stat(d).st_uid
        try:
            name = pwd.getpwuid(owner).pw_name
        except KeyError:
            name = str(owner)
        print(f"note: {why}: ktd running as uid {os.geteuid()} would not use it "
              f"(as its owner: sudo -u {name} ktd cache ...)")


def run(args) -> int:
    import os

    from ktd.ops import weights_cache
    from ktd.cli import UserError

    d = _dir(args)
    if not os.path.isdir(d):
        if args.cache_command == "list":
            print(f"{d}: no cache directory (nothing cached yet)")
            return 0
        raise UserError(f"{d}: no such directory")
    _say_whose(d)
    if args.cache_command == "list":
        es = weights_cache.entries(d)
        for e in es:
            if e["ok"]:
                k = e["key"]
                state = f"stale: {e['stale']}" if e["stale"] else "current"
                print(f"{e['path']}\n  model {k.get('model')}, {_mib(e['bytes'])}, isa {k.get('isa')}, "
                      f"nodes {k.get('nodes')}, repack {k.get('allow_repack')}: {state}")
            else:
                print(f"{e['path']}\n  {_mib(e['bytes'])}: unusable: {e['problem']}")
        print(f"{len(es)} entries, {_mib(sum(e['bytes'] for e in es))} in {d}")
        return 0
    if args.cache_command == "prune":
        removed = weights_cache.prune(d, everything=args.all)
        for path, n, why in removed:
            print(f"removed {path} ({_mib(n)}): {why}")
        print(f"{len(removed)} removed, {_mib(sum(n for _, n, _ in removed))} freed")
        return 0
    bad = 0
    for path, problem in weights_cache.verify(d):
        print(f"{path}: {problem or 'ok'}")
        bad += bool(problem)
    return 1 if bad else 0
