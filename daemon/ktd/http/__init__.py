"""``ktd-http``: an OpenAI- and Ollama-compatible HTTP gateway in front of the daemon.

A separate process (its own systemd unit, ``ktd-http.socket`` + ``ktd-http.service``) that
translates HTTP requests into the daemon's msgpack socket protocol through
``ktd.client.AsyncClient``; the daemon itself stays network-free. Starlette routes the requests,
uvicorn (h11, pure Python) speaks HTTP/1.1. The parts:

- ``backend``: the connection to the daemon (reconnects after a daemon restart, caches
  ``hello``), the served model's names, and the mapping of the daemon's typed errors to HTTP;
- ``generation``: the ASGI response that runs one ``generate`` (streamed or not) and cancels it
  in the daemon when the HTTP client goes away;
- ``openai`` / ``ollama``: the two API dialects (request validation, response shapes);
- ``app``: routes, API-key authentication, body limits, /health, /metrics, request log;
- ``serve``: the command line (``ktd http``, ``ktd-http``, ``python -m ktd.http``), listeners
  (loopback TCP, Unix socket, systemd socket activation) and sd_notify.

Default address: 127.0.0.1:11435 (one above Ollama's 11434, so both can run side by side).
"""

DEFAULT_PORT = 11435
