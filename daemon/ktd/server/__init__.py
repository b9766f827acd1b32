"""The serving core: the socket and its clients (``sockets``, ``connections``, ``protocol``),
admission of requests (``admission``), continuous batching on the engine thread (``scheduler``,
``events``), the model engine (``engine``, ``engine_api``), the prefix cache, and the daemon's
lifecycle that composes them (``daemon``)."""
