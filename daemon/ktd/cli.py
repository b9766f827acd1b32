"""The ``ktd`` command line: admin commands (inspect, fetch, ...) and, later, the daemon itself.

Each subcommand lives in ``ktd.commands.<name>`` and exposes ``register(subparsers)``, which adds
its parser and sets ``func``. Errors the user can act on (bad file, bad config, missing model)
end as one line on stderr and exit status 1 — never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ktd import __version__

# Subcommand modules, in the order they appear in --help.
COMMANDS = ["inspect", "fetch", "config", "serve", "http", "run", "cache", "perplexity"]


class UserError(Exception):
    """An error caused by the user's input or environment: printed as one line, exit 1."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or (``only``) of that one alone: registering a subcommand
    imports its module, and some are heavy (``ktd http``'s gateway: asyncio, the client, the
    protocol; a third of a second), which ``ktd run`` should not pay at every start."""
    parser = argparse.ArgumentParser(prog="ktd", description="ktd LLM inference daemon")
    parser.add_argument("--version", action="version", version=f"ktd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if only is None or name == only:
            importlib.import_module(f"ktd.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from ktd import GGUFError, ResourceError

    try:
        rc = args.func(args)
    except (UserError, GGUFError, ResourceError) as e:
        print(f"ktd: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `ktd inspect ... | head`: the reader is gone, not an error
        sys.stderr.close()
        return 0
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"ktd: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)
