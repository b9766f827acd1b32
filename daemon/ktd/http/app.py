"""Routes, authentication, body limits, /health, /metrics and the request log of the gateway.

Every route is one ``Handler``: it reads and checks the body (bounded, JSON object), calls its
dialect, and answers; ``HTTPFailure`` becomes the dialect's error body. Authentication (when an
API-key file is given) is ``Authorization: Bearer <secret>`` on every route but /health; the key's
id (never the secret) goes to the request log, because the daemon sees every HTTP client as the
gateway's uid.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ktd.http import ollama, openai
from ktd.http.backend import Backend, HTTPFailure, from_daemon
from ktd.http.generation import GenerationResponse

log = logging.getLogger("ktd.http")

MAX_BODY_BYTES = 4 << 20   # a request body above this is 413 (the daemon's frame limit is 1 MiB)


# --- API keys --------------------------------------------------------------------------------------

class KeyFileError(ValueError):
    """The API-key file is unusable (unreadable, too open, malformed): the gateway does not start."""


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[tuple[str, bytes], ...]   # (key id, secret)

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """``ID:SECRET`` per line (``#`` comments, blank lines ignored); the file must not be
        readable or writable by others (root:<gateway group> 0640 under the .deb)."""
        try:
            st = os.stat(path)
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"{path}: cannot read the API-key file: {e}") from None
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise KeyFileError(f"{path}: the API-key file is readable or writable by others "
                               f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 0640 it")
        keys, seen = [], set()
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            kid, sep, secret = line.partition(":")
            kid, secret = kid.strip(), secret.strip()
            if not sep or not kid or len(secret) < 16 or any(c.isspace() for c in secret):
                raise KeyFileError(f"{path}:{n}: expected ID:SECRET with a secret of at least 16 "
                                   "characters and no spaces")
            if kid in seen:
                raise KeyFileError(f"{path}:{n}: key id {kid!r} appears twice")
            seen.add(kid)
            keys.append((kid, secret.encode()))
        if not keys:
            raise KeyFileError(f"{path}: no keys in the API-key file")
        return cls(tuple(keys))

    def identify(self, authorization: str | None) -> str | None:
        """The key id of a valid ``Bearer`` header, else None (constant-time per key)."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for kid, secret in self.keys:
            if hmac.compare_digest(given, secret):
                found = kid
        return found


# --- the gateway's own metrics ---------------------------------------------------------------------

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HTTPMetrics:
    """Request counters by route and status, latency histograms by route (Prometheus text)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.buckets: dict[str, list[int]] = {}
        self.sums: Counter[str] = Counter()
        self.in_flight = 0

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        b = self.buckets.setdefault(route, [0] * (len(_BUCKETS) + 1))
        b[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.sums[route] += seconds

    def text(self) -> str:
        out = ["# HELP ktd_http_requests_total HTTP requests answered by ktd-http, by route and status.",
               "# TYPE ktd_http_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            out.append(f'ktd_http_requests_total{{route="{route}",status="{status}"}} {n}')
        out += ["# HELP ktd_http_request_duration_seconds Time from request to the end of the answer.",
                "# TYPE ktd_http_request_duration_seconds histogram"]
        for route, counts in sorted(self.buckets.items()):
            total = 0
            for le, c in zip((*_BUCKETS, "+Inf"), counts):
                total += c
                out.append(f'ktd_http_request_duration_seconds_bucket{{route="{route}",le="{le}"}} {total}')
            out.append(f'ktd_http_request_duration_seconds_sum{{route="{route}"}} {self.sums[route]:.6f}')
            out.append(f'ktd_http_request_duration_seconds_count{{route="{route}"}} {total}')
        out += ["# HELP ktd_http_in_flight HTTP requests being answered.", "# TYPE ktd_http_in_flight gauge",
                f"ktd_http_in_flight {self.in_flight}"]
        return "\n".join(out) + "\n"


# --- the application -------------------------------------------------------------------------------

@dataclass
class Gateway:
    backend: Backend
    keys: ApiKeys | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    metrics: HTTPMetrics | None = None

    def __post_init__(self) -> None:
        self.metrics = self.metrics or HTTPMetrics()


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPFailure(413, f"request body of {declared} bytes is above the limit of {limit} bytes",
                          code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPFailure(413, f"request body above the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPFailure(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPFailure(400, "the request body must be a JSON object", code="invalid_json")
    return body


Render = Callable[[HTTPFailure], dict[str, Any]]
Action = Callable[[Gateway, Request], Awaitable[Any]]


def handler(gw: Gateway, route: str, action: Action, render: Render, *, auth: bool = True):
    """A Starlette endpoint: auth, the action, errors in the dialect's shape, log and metrics."""

    async def endpoint(request: Request) -> Response:
        t0 = time.monotonic()
        key_id = "-"
        gw.metrics.in_flight += 1

        def done(status: int) -> None:
            gw.metrics.in_flight -= 1
            seconds = time.monotonic() - t0
            gw.metrics.observe(route, status, seconds)
            client = request.client
            peer = f"{client.host}:{client.port}" if client else "unix"
            log.info("%s %s %s %d %.3fs key=%s", peer, request.method, request.url.path, status,
                     seconds, key_id)

        try:
            if auth and gw.keys is not None:
                kid = gw.keys.identify(request.headers.get("authorization"))
                if kid is None:
                    raise HTTPFailure(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                      type="authentication_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": 'Bearer realm="ktd"'})
                key_id = kid
            result = await action(gw, request, done)
        except HTTPFailure as f:
            response: Response = JSONResponse(render(f), status_code=f.status, headers=f.headers)
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - a daemon error or a lost connection: typed answer
            f = from_daemon(e)
            if f.status >= 500:
                log.warning("%s %s: %s", request.method, request.url.path, e)
            response = JSONResponse(render(f), status_code=f.status, headers=f.headers)
        except BaseException:
            done(499)
            raise
        else:
            if isinstance(result, GenerationResponse):
                return result  # it calls done() with the status it sends, when it ends
            response = result if isinstance(result, Response) else JSONResponse(result)
        done(response.status_code)
        return response

    return endpoint


# actions: (gateway, request, done) -> JSON-able value, a Response or a GenerationResponse

async def _chat(gw, request, done):
    return await openai.chat_completions(gw.backend, await _read_json(request, gw.max_body_bytes), done)


async def _completions(gw, request, done):
    return await openai.completions(gw.backend, await _read_json(request, gw.max_body_bytes), done)


async def _models(gw, request, done):
    return openai.models_list(await gw.backend.model())


async def _model(gw, request, done):
    model = await gw.backend.model()
    name = request.path_params["name"]
    if not model.matches(name):
        raise HTTPFailure(404, f"the model {name!r} does not exist", code="model_not_found", param="model")
    return openai.model_object(model)


async def _o_chat(gw, request, done):
    return await ollama.chat(gw.backend, await _read_json(request, gw.max_body_bytes), done)


async def _o_generate(gw, request, done):
    return await ollama.generate(gw.backend, await _read_json(request, gw.max_body_bytes), done)


async def _o_tags(gw, request, done):
    return ollama.tags(await gw.backend.model())


async def _o_ps(gw, request, done):
    return ollama.ps(await gw.backend.model())


async def _o_show(gw, request, done):
    body = await _read_json(request, gw.max_body_bytes)
    return ollama.show(await ollama.resolve_model(gw.backend, body))


async def _o_version(gw, request, done):
    return ollama.version()


async def _o_offline(gw, request, done):
    raise HTTPFailure(501, ollama.OFFLINE, type="not_supported", code="offline")


async def _o_root(gw, request, done):
    return PlainTextResponse("ktd is running")  # Ollama's liveness answer at /, which clients probe


async def _health(gw, request, done):
    """200 while the daemon serves; 503 while it loads, reloads, stops, or cannot be reached."""
    try:
        state = (await asyncio.wait_for(gw.backend.call("health"), 3.0))["status"]
    except (TimeoutError, asyncio.TimeoutError):
        state = "loading"  # the daemon's socket exists (systemd) but it does not accept yet
    except Exception as e:  # noqa: BLE001
        failure = from_daemon(e)
        state = "loading" if failure.code == "loading" else f"unavailable: {failure.message}"
    code = 200 if state == "ok" else 503
    headers = {} if code == 200 else {"Retry-After": "5"}
    return JSONResponse({"status": state}, status_code=code, headers=headers)


async def _metrics(gw, request, done):
    try:
        daemon = await gw.backend.call("metrics")
        text = daemon["text"]
        if not text.endswith("\n"):
            text += "\n"
    except Exception as e:  # noqa: BLE001 - the gateway's own metrics still answer
        text = f"# daemon metrics unavailable: {from_daemon(e).message}\n"
    return PlainTextResponse(text + gw.metrics.text(), media_type="text/plain; version=0.0.4")


def build_app(gw: Gateway) -> Starlette:
    oa, ol = openai.error_body, ollama.error_body
    routes = [
        ("/v1/chat/completions", ["POST"], _chat, oa, True),
        ("/v1/completions", ["POST"], _completions, oa, True),
        ("/v1/models", ["GET"], _models, oa, True),
        ("/v1/models/{name:path}", ["GET"], _model, oa, True),
        ("/api/chat", ["POST"], _o_chat, ol, True),
        ("/api/generate", ["POST"], _o_generate, ol, True),
        ("/api/tags", ["GET"], _o_tags, ol, True),
        ("/api/ps", ["GET"], _o_ps, ol, True),
        ("/api/show", ["POST"], _o_show, ol, True),
        ("/api/version", ["GET"], _o_version, ol, True),
        *((f"/api/{name}", ["POST", "DELETE"], _o_offline, ol, True)
          for name in ("pull", "push", "create", "copy", "delete", "embed", "embeddings")),
        ("/", ["GET", "HEAD"], _o_root, ol, False),
        ("/health", ["GET"], _health, oa, False),
        ("/metrics", ["GET"], _metrics, oa, True),
    ]
    app = Starlette(routes=[Route(path, handler(gw, path, action, render, auth=auth), methods=methods)
                            for path, methods, action, render, auth in routes])
    app.state.gateway = gw
    return app
