"""Subcommands of the ``ktd`` command line (one module each, see ktd.cli)."""
