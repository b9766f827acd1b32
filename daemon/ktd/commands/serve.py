"""``ktd serve --config FILE [--socket PATH]``: run the daemon in the foreground (systemd's ExecStart)."""

from __future__ import annotations

import importlib


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon (foreground; Type=notify under systemd)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="configuration file (default /etc/ktd/ktd.yaml if it exists, else built-in defaults)")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="socket path to bind instead of server.socket (ignored when socket-activated)")
    p.set_defaults(func=run)


def default_engine_factory():
    """``ktd.server.engine.load(config, progress)``, or a clear error while this build has no engine."""
    from ktd.cli import UserError

    try:
        engine = importlib.import_module("ktd.server.engine")
    except ModuleNotFoundError as e:
        if e.name in ("ktd.server.engine",):
            raise UserError("model execution is not available in this build yet") from None
        raise
    return engine.load


def default_weights_factory():
    """``ktd.server.weights.WeightsManager.start(engine)``: the real engine's weights switch."""
    from ktd.server.weights import WeightsManager

    return WeightsManager.start


def run(args, engine_factory=None) -> int:
    import os

    from ktd.ops import config as config_mod

    from ktd.server import daemon as server
    from ktd.cli import UserError

    path = args.config
    if path is None and os.path.exists(config_mod.DEFAULT_PATH):
        path = config_mod.DEFAULT_PATH
    try:
        cfg = config_mod.load(path)
    except config_mod.ConfigError as e:
        raise UserError(str(e)) from None
    # An injected engine (the tests' fake) has no weights to switch to.
    factory = engine_factory or default_engine_factory()
    weights = None if engine_factory else default_weights_factory()
    try:
        return server.serve(cfg, factory, config_path=path, socket_path=args.socket, weights_factory=weights)
    except server.StartupError as e:
        raise UserError(str(e)) from None
