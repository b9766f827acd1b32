"""Subcommands of the ``ktd`` command line (one module each, see ktd.cli)."""

from __future__ import annotations


def model_path(model: str) -> str:
    """``ktd.ops.models.resolve`` for a subcommand's MODEL argument: its error as a UserError."""
    from ktd.cli import UserError
    from ktd.ops import models

    try:
        return models.resolve(model)
    except models.FetchError as e:
        raise UserError(str(e)) from None
