"""The Ollama dialect: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, and clear refusals for the model-management endpoints (ktd is offline: models
are installed as files, not pulled).

Streaming is the default (``"stream": false`` for one JSON object), as in Ollama; the stream is
NDJSON. ``options`` maps onto the daemon's generate options: temperature, top_k, top_p, min_p,
seed, num_predict (-1/-2: no limit), stop, repeat_penalty, repeat_last_n, presence_penalty,
frequency_penalty. Options that configure Ollama's runner (num_ctx, num_thread, num_gpu, ...) are
accepted and ignored: ktd's configuration is /etc/ktd/ktd.yaml. ``keep_alive`` is accepted and
ignored: the daemon keeps its one model loaded for its lifetime (``keep_alive: 0`` unloads
nothing).

``format`` ("json" or a JSON Schema object) becomes the daemon's ``grammar``; ``tools`` (the same
shape as OpenAI's) and tool-call/tool-result messages pass to the daemon, and its calls come
back in Ollama's shape (``message.tool_calls[].function`` with ``arguments`` as an object);
``logprobs``/``top_logprobs`` give each chunk's (or the whole answer's) ``logprobs`` entries
``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``.
"""

from __future__ import annotations

import datetime as dt
import json
import hashlib
from typing import Any

from ktd import __version__
from ktd.http.backend import Backend, HTTPFailure, ModelInfo, bad_request, fim_params
from ktd.http.generation import Dialect, GenerationResponse, Outcome, json_bytes

OFFLINE = ("ktd is offline and serves the one model its configuration names: there is nothing to "
           "pull. Install a model with `ktd fetch NAME` (known names: `ktd fetch --list`) or copy a "
           "GGUF file to /var/lib/ktd-models, set model.path in /etc/ktd/ktd.yaml and restart ktd.")

_OPTIONS = {  # Ollama option -> (daemon generate option, type)
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "min_p": ("min_p", float), "seed": ("seed", int), "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("penalty_last_n", int), "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}


def error_body(f: HTTPFailure) -> dict[str, Any]:
    return {"error": f.message}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def options(body: dict) -> dict[str, Any]:
    opts = body.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    out: dict[str, Any] = {}
    for key, (name, kind) in _OPTIONS.items():
        v = opts.get(key)
        if v is None:
            continue
        ok = (isinstance(v, int) if kind is int else isinstance(v, (int, float))) and not isinstance(v, bool)
        if not ok:
            raise bad_request(f"options.{key} must be {'an integer' if kind is int else 'a number'}")
        out[name] = v
    n = opts.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise bad_request("options.num_predict must be an integer")
        if n > 0:
            out["max_tokens"] = n
        elif n == 0 or n < -2:
            raise bad_request("options.num_predict must be positive, -1 (no limit) or -2 (fill the context)")
    stop = opts.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("options.stop must be an array of strings")
        out["stop"] = stop
    return out


def _check_common(body: dict) -> bool:
    """The stream flag; refuses what ktd cannot do."""
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean")
    if body.get("images"):
        raise bad_request("images are not supported by ktd (text models only)")
    ka = body.get("keep_alive")
    if ka is not None and (isinstance(ka, bool) or not isinstance(ka, (str, int, float))):
        raise bad_request("keep_alive must be a duration string or a number of seconds")
    return stream


def structured(body: dict) -> dict[str, Any]:
    """``format``, ``tools`` and ``logprobs``/``top_logprobs`` as the daemon's generate options."""
    out: dict[str, Any] = {}
    fmt = body.get("format")
    if fmt == "json":
        out["grammar"] = {"json_object": True}
    elif isinstance(fmt, dict):
        out["grammar"] = {"json_schema": fmt}
    elif fmt not in (None, ""):
        raise bad_request('format must be "json" or a JSON Schema object')
    ts = body.get("tools")
    if ts:
        if not isinstance(ts, list) or not all(isinstance(t, dict) for t in ts):
            raise bad_request("tools must be an array of objects")
        out["tools"] = ts
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad_request("logprobs must be a boolean")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise bad_request("top_logprobs must be an integer in [0, 20]")
    if lp:
        out.update(logprobs=True, top_logprobs=top or 0)
    return out


def _logprobs(entries: list[dict] | None) -> list[dict[str, Any]]:
    def one(e: dict) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}
    return [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs", ())]} for e in entries or ()]


def _ollama_calls(calls: list[dict]) -> list[dict[str, Any]]:
    out = []
    for c in calls:
        args = c["function"].get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = {}
        out.append({"id": c.get("id"), "function": {"name": c["function"]["name"], "arguments": args}})
    return out


async def resolve_model(backend: Backend, body: dict) -> ModelInfo:
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise bad_request("model is required")
    model = await backend.model()
    if not model.matches(name):
        raise HTTPFailure(404, f"model '{name}' not found (this server serves '{model.id}')")
    return model


class _OllamaDialect(Dialect):
    media_type = "application/x-ndjson"

    def __init__(self, model: str):
        self.model = model

    def error_body(self, failure: HTTPFailure) -> dict[str, Any]:
        return error_body(failure)

    def stream_error(self, failure: HTTPFailure) -> bytes:
        return json_bytes(error_body(failure)) + b"\n"

    def _final(self, outcome: Outcome) -> dict[str, Any]:
        t, u = outcome.timings, outcome.usage
        ns = 1_000_000
        return {"done": True, "done_reason": outcome.finish_reason,
                "total_duration": int(t.get("total_ms", 0) * ns), "load_duration": 0,
                "prompt_eval_count": int(u.get("prompt_tokens", 0)),
                "prompt_eval_duration": int(t.get("prefill_ms", 0) * ns),
                "eval_count": int(u.get("completion_tokens", 0)),
                "eval_duration": int(t.get("decode_ms", 0) * ns)}


def _lp(entries: list[dict] | None) -> dict[str, Any]:
    return {"logprobs": _logprobs(entries)} if entries else {}


class ChatDialect(_OllamaDialect):
    def piece(self, text: str, logprobs: list[dict] | None = None) -> bytes:
        return json_bytes({"model": self.model, "created_at": _now(),
                           "message": {"role": "assistant", "content": text}, "done": False,
                           **_lp(logprobs)}) + b"\n"

    def _message(self, text: str, outcome: Outcome) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": text}
        if outcome.tool_calls:
            m["tool_calls"] = _ollama_calls(outcome.tool_calls)
        return m

    def end(self, outcome: Outcome) -> bytes:
        out = b""
        if outcome.tool_calls or outcome.logprobs_tail:  # as Ollama: the calls in a chunk of their own
            out = json_bytes({"model": self.model, "created_at": _now(), "message": self._message("", outcome),
                              "done": False, **_lp(outcome.logprobs_tail)}) + b"\n"
        return out + json_bytes({"model": self.model, "created_at": _now(),
                                 "message": {"role": "assistant", "content": ""}, **self._final(outcome)}) + b"\n"

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now(), "message": self._message(outcome.text, outcome),
                **self._final(outcome), **_lp(outcome.logprobs)}

    def _final(self, outcome: Outcome) -> dict[str, Any]:
        f = super()._final(outcome)
        if f["done_reason"] == "tool_calls":
            f["done_reason"] = "stop"  # Ollama ends a reply with calls as "stop"
        return f


class GenerateDialect(_OllamaDialect):
    def piece(self, text: str, logprobs: list[dict] | None = None) -> bytes:
        return json_bytes({"model": self.model, "created_at": _now(), "response": text, "done": False,
                           **_lp(logprobs)}) + b"\n"

    def end(self, outcome: Outcome) -> bytes:
        return json_bytes({"model": self.model, "created_at": _now(), "response": "",
                           **self._final(outcome), **_lp(outcome.logprobs_tail)}) + b"\n"

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now(), "response": outcome.text, **self._final(outcome),
                **_lp(outcome.logprobs)}


def _loaded(model: str, key: str, empty: str) -> dict[str, Any]:
    """Ollama's answer to a request without input: the model is (already) loaded."""
    return {"model": model, "created_at": _now(), key: empty, "done": True, "done_reason": "load"}


def _message_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be an array")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", {}), (dict, str)):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}")
        out.append({"id": str(c.get("id") or f"call_{i}_{j}"), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", {})}})
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise bad_request("messages must be an array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content") or "", str):
            raise bad_request(f"messages[{i}] must be an object with string role and content")
        if m.get("images"):
            raise bad_request("images are not supported by ktd (text models only)")
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = _message_calls(i, m["tool_calls"])
        if m["role"] == "tool" and isinstance(m.get("tool_name", m.get("name")), str):
            msg["name"] = m.get("tool_name", m.get("name"))
        out.append(msg)
    return out


async def chat(backend: Backend, body: dict, on_done=None):
    model = await resolve_model(backend, body)
    stream = _check_common(body)
    messages = _messages(body)
    params = {**options(body), **structured(body)}
    if not messages:
        return _loaded(body["model"], "message", {"role": "assistant", "content": ""})
    return GenerationResponse(backend, {"messages": messages, **params}, ChatDialect(body["model"]),
                              stream=stream, on_done=on_done)


async def generate(backend: Backend, body: dict, on_done=None):
    model = await resolve_model(backend, body)
    stream = _check_common(body)
    params = {**options(body), **structured(body)}
    prompt, suffix, system = body.get("prompt", ""), body.get("suffix"), body.get("system")
    for name, v in (("prompt", prompt), ("suffix", suffix), ("system", system)):
        if v is not None and not isinstance(v, str):
            raise bad_request(f"{name} must be a string")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad_request("raw must be a boolean")
    if body.get("template"):
        raise bad_request("template is not supported by ktd: the model's own chat template is used "
                          "(send raw: true with a formatted prompt instead)")
    if suffix:
        params.update(fim_params(model, prompt or "", suffix))
    elif not prompt:
        return _loaded(body["model"], "response", "")
    elif raw:
        params.update(prompt=prompt, parse_special=True)
    else:  # as Ollama: the prompt is the user turn of the model's chat template
        params["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    return GenerationResponse(backend, params, GenerateDialect(body["model"]), stream=stream,
                              on_done=on_done)


def _details(model: ModelInfo) -> dict[str, Any]:
    n = model.n_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n else ""
    return {"parent_model": "", "format": "gguf", "family": model.architecture,
            "families": [model.architecture], "parameter_size": size,
            "quantization_level": str(model.info.get("quant", ""))}


def _entry(model: ModelInfo) -> dict[str, Any]:
    digest = hashlib.sha256(f"{model.id}/{model.n_params}/{model.architecture}".encode()).hexdigest()
    return {"name": model.id, "model": model.id, "modified_at": _now(), "size": 0, "digest": digest,
            "details": _details(model)}


def tags(model: ModelInfo) -> dict[str, Any]:
    return {"models": [_entry(model)]}


def ps(model: ModelInfo) -> dict[str, Any]:
    never = "2318-01-01T00:00:00Z"  # loaded for the daemon's lifetime (Ollama shows a far expiry too)
    return {"models": [{**_entry(model), "expires_at": never, "size_vram": 0,
                        "context_length": model.n_ctx}]}


def show(model: ModelInfo) -> dict[str, Any]:
    arch = model.architecture
    caps = ["completion"] + (["insert"] if model.fim else [])
    return {"modelfile": "", "parameters": "", "template": "", "details": _details(model),
            "model_info": {"general.architecture": arch, "general.parameter_count": model.n_params,
                           f"{arch}.context_length": model.n_ctx},
            "capabilities": caps, "modified_at": _now()}


def version() -> dict[str, Any]:
    return {"version": __version__}
