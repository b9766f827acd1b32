"""Run the real daemon main (``ktd serve``) with the fake engine injected (tests only).

    python tests/daemon_launcher.py [FAKE_OPTIONS_JSON] -- serve --config FILE [--socket PATH]

FAKE_OPTIONS_JSON: keyword arguments of ``fake_engine.factory`` (step_delay_s, eos_bias,
wedge_after_steps, die_after_steps, load_steps, load_delay_s, fim).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_engine  # noqa: E402

from ktd import cli  # noqa: E402
from ktd.commands import serve  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    options = {}
    if argv and argv[0] != "--":
        options = json.loads(argv.pop(0))
    if argv and argv[0] == "--":
        argv.pop(0)
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    factory = fake_engine.factory(**options)
    try:
        return serve.run(args, engine_factory=factory)
    except cli.UserError as e:
        print(f"ktd: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
