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
import re
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ktd.http import ollama, openai
from ktd.ops import file_trust
from ktd.http.backend import Backend, HTTPFailure, from_daemon
from ktd.http.generation import GenerationResponse
from ktd.http.limits import MAX_IN_FLIGHT, ConnectionStats

log = logging.getLogger("ktd.http")

MAX_BODY_BYTES = 4 << 20   # a request body above this is 413 (the daemon's frame limit is 1 MiB)
BUSY_RETRY_AFTER_S = 1


# --- API keys --------------------------------------------------------------------------------------

class KeyFileError(ValueError):
    """The API-key file is unusable (unreadable, too open, malformed): the gateway does not start."""


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[tuple[str, bytes], ...]   # (key id, secret)

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """``ID:SECRET`` per line (``#`` comments, blank lines ignored). The file and its
        directory must belong to root or the gateway's user and not be writable by their group
        or others (ktd.ops.file_trust: whoever could write it could add a key), the file must
        not be readable by others, and it is not reached through a symbolic link
        (root:<gateway group> 0640 in /etc/ktd under the .deb)."""
        try:
            fd = file_trust.open_trusted(path)
        except file_trust.UntrustedFile as e:
            raise KeyFileError(f"refusing the API-key file: {e}") from None
        except OSError as e:
            raise KeyFileError(f"{path}: cannot read the API-key file: {e.strerror or e}") from None
        try:
            with open(fd, encoding="utf-8") as f:
                st = os.fstat(f.fileno())
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
        self.connections = ConnectionStats()   # counted by ktd.http.limits
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
        c = self.connections
        out += ["# HELP ktd_http_in_flight HTTP requests being answered.", "# TYPE ktd_http_in_flight gauge",
                f"ktd_http_in_flight {self.in_flight}",
                "# HELP ktd_http_connections HTTP connections open (refused ones not counted).",
                "# TYPE ktd_http_connections gauge", f"ktd_http_connections {c.open}",
                "# HELP ktd_http_connections_refused_total Connections answered 503 over --max-connections.",
                "# TYPE ktd_http_connections_refused_total counter", f"ktd_http_connections_refused_total {c.refused}",
                "# HELP ktd_http_timeouts_total Connections closed for sending their headers or body too slowly.",
                "# TYPE ktd_http_timeouts_total counter",
                f'ktd_http_timeouts_total{{kind="header"}} {c.header_timeouts}',
                f'ktd_http_timeouts_total{{kind="body"}} {c.body_timeouts}']
        return "\n".join(out) + "\n"


# --- the application -------------------------------------------------------------------------------

@dataclass
class Gateway:
    backend: Backend
    keys: ApiKeys | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    metrics: HTTPMetrics | None = None
    max_in_flight: int = MAX_IN_FLIGHT

    def __post_init__(self) -> None:
        self.metrics = self.metrics or HTTPMetrics()


# What the daemon's msgpack carries, and how deep a body may nest (OpenAI and Ollama bodies
# nest a few levels; a JSON Schema in response_format a dozen or two).
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _unfit(value: Any, depth: int = 1) -> tuple[list[str | int], str] | None:
    """Why a parsed body value cannot go on to the daemon: (path to it, what is wrong) or None.
    Lone UTF-16 surrogates (JSON's \\ud800 escapes) cannot be encoded as UTF-8; integers past
    64 bits cannot be packed; nesting is bounded. Recursion stops at ``MAX_JSON_DEPTH``."""
    if isinstance(value, str):
        if value.isascii() or not _SURROGATE.search(value):
            return None
        return [], "holds a lone UTF-16 surrogate (not encodable as UTF-8)"
    if isinstance(value, int) and not isinstance(value, bool):
        return None if _INT_MIN <= value <= _INT_MAX else ([], "is an integer outside [-2**63, 2**64)")
    if not isinstance(value, (dict, list)):
        return None
    if depth > MAX_JSON_DEPTH:
        return [], f"is nested more than {MAX_JSON_DEPTH} levels deep"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, v in items:
        if isinstance(k, str) and _unfit(k) is not None:
            return [], "has a key holding a lone UTF-16 surrogate (not encodable as UTF-8)"
        bad = _unfit(v, depth + 1)
        if bad is not None:
            return [k, *bad[0]], bad[1]
    return None


def _json_path(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the body"


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, or a 4xx: 413 above ``limit`` bytes, 400 for anything
    that is not a JSON object the daemon can be sent (any failure of the parser included: too
    deep for it, an integer longer than Python converts)."""
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
    except RecursionError:
        raise HTTPFailure(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                          code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int-string digits limit
        raise HTTPFailure(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPFailure(400, "the request body must be a JSON object", code="invalid_json")
    bad = _unfit(body)
    if bad is not None:
        raise HTTPFailure(400, f"the request body cannot be used: {_json_path(bad[0])} {bad[1]}",
                          code="invalid_json", param=_json_path(bad[0]) if bad[0] else None)
    return body


Render = Callable[[HTTPFailure], dict[str, Any]]
Action = Callable[[Gateway, Request], Awaitable[Any]]


def _error_response(render: Render, f: HTTPFailure) -> Response:
    """The dialect's error body as ASCII JSON (whatever the message quotes: a lone surrogate is
    escaped, not an encoding error); a body that cannot be rendered at all becomes a fixed one."""
    try:
        body = json.dumps(render(f), ensure_ascii=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        log.error("cannot render an error answer (%s): %s", type(e).__name__, ascii(f.message)[:200])
        body = b'{"error":{"message":"internal error","type":"server_error","param":null,"code":"internal"}}'
    return Response(body, status_code=f.status, headers=f.headers, media_type="application/json")


def _caller(gw: Gateway, request: Request) -> tuple[str, str | None]:
    """(key id for the log, the caller's identity for the prefix cache or None): the API key's
    id; without keys, the peer's uid on a Unix listener (ktd.http.limits puts it in the request
    state); a TCP caller without a key is the gateway's own (loopback only: see docs/HTTP.md).
    HTTPFailure 401 when keys are required and none is valid."""
    if gw.keys is not None:
        kid = gw.keys.identify(request.headers.get("authorization"))
        if kid is None:
            raise HTTPFailure(401, "missing or invalid API key (Authorization: Bearer <key>)",
                              type="authentication_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": 'Bearer realm="ktd"'})
        return kid, f"key:{kid}"
    uid = getattr(request.state, "peer_uid", None)
    return "-", (f"uid:{uid}" if uid is not None else None)


async def _answer(gw: Gateway, request: Request, action: Action, render: Render, auth: bool, capped: bool,
                  who: list[str], done: Callable[[int], None]) -> Response:
    """The response of one request, never an exception (but cancellation): every failure is the
    dialect's JSON error. ``who[0]`` is set to the key id for the log."""
    try:
        owner = None
        if auth:
            who[0], owner = _caller(gw, request)
        if capped and gw.metrics.in_flight > gw.max_in_flight:
            raise HTTPFailure(429, f"the gateway is answering {gw.max_in_flight} requests (--max-in-flight); "
                              "retry shortly", type="rate_limit_error", code="too_many_requests",
                              headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})
        result = await action(gw, request, done)
    except HTTPFailure as f:
        return _error_response(render, f)
    except ClientDisconnect:
        # the client left while sending its body, or ktd.http.limits ended a body that trickled
        return Response(status_code=408 if getattr(request.state, "timed_out", False) else 499)
    except Exception as e:  # noqa: BLE001 - a daemon error or a lost connection: typed answer
        f = from_daemon(e)
        if f.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, ascii(str(e))[:500])
        return _error_response(render, f)
    if isinstance(result, GenerationResponse):
        if owner is not None:
            result.params["cache_owner"] = owner
        return result  # it calls done() with the status it sends, when it ends
    return result if isinstance(result, Response) else JSONResponse(result)


def handler(gw: Gateway, route: str, action: Action, render: Render, *, auth: bool = True, capped: bool = True):
    """A Starlette endpoint: auth, the in-flight cap (``capped``), the action, errors in the
    dialect's shape, log and metrics. The in-flight gauge goes down exactly once per request."""

    async def endpoint(request: Request) -> Response:
        t0 = time.monotonic()
        who = ["-"]
        gw.metrics.in_flight += 1
        ended = False

        def done(status: int) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            gw.metrics.in_flight -= 1
            seconds = time.monotonic() - t0
            gw.metrics.observe(route, status, seconds)
            client = request.client
            peer = f"{client.host}:{client.port}" if client else "unix"
            log.info("%s %s %s %d %.3fs key=%s", peer, request.method, request.url.path, status,
                     seconds, who[0])

        try:
            response = await _answer(gw, request, action, render, auth, capped, who, done)
        except BaseException:
            done(499)
            raise
        if not isinstance(response, GenerationResponse):
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
    # /health and /metrics answer however busy the gateway is
    app = Starlette(routes=[Route(path, handler(gw, path, action, render, auth=auth,
                                                capped=path not in ("/health", "/metrics")), methods=methods)
                            for path, methods, action, render, auth in routes],
                    exception_handlers={HTTPException: _router_error})
    app.state.gateway = gw
    return app


async def _router_error(request: Request, exc: HTTPException) -> Response:
    """The router's own answers (an unknown path: 404, a method the route has not: 405) as JSON
    in the dialect of the path, like every other error."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    f = HTTPFailure(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                    headers=dict(exc.headers or {}))
    return _error_response(ollama.error_body if request.url.path.startswith("/api/") else openai.error_body, f)
