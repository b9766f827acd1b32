"""``ktd http``: the OpenAI- and Ollama-compatible HTTP gateway (``ktd.http``) in the foreground."""

from __future__ import annotations


def register(sub) -> None:
    from ktd.http.serve import add_arguments

    p = sub.add_parser("http", help="run the HTTP gateway (OpenAI and Ollama APIs) in front of the daemon")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ktd.cli import UserError
    from ktd.http.serve import StartupError, run as serve_http

    try:
        return serve_http(args)
    except StartupError as e:
        raise UserError(str(e)) from None
