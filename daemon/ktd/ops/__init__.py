"""Operating the daemon: configuration, systemd, status and metrics, what the machine offers,
the known real models, and the caches it keeps on disk (prepared weights, routing profile)."""
