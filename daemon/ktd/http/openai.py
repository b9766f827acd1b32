"""The OpenAI dialect: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Request fields are checked for type here (a wrong type is a 400 naming the field); ranges are
the daemon's (``docs/PROTOCOL.md`` generate options), whose ``bad_request`` becomes a 400 too.
Mapped onto the daemon's generate options: ``response_format`` (json_object, json_schema) →
``grammar``; ``tools``/``tool_choice`` and tool-call/tool-result messages → the daemon's (whose
answer is already in OpenAI's tool-call shape); ``logprobs``/``top_logprobs`` (chat) and
``logprobs: N`` (completions, the legacy shape) → ``logprobs``/``top_logprobs``.
Refused with 400 rather than silently ignored: ``n``/``best_of`` > 1, ``echo``, the legacy
``functions``/``function_call``, non-text content parts. Accepted and ignored: ``user``,
``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` (a reply may hold several calls
under ``auto``; ``required`` forces exactly one) and ``logit_bias`` when empty. Extensions (llama-server has them too): ``top_k``, ``min_p``,
``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ktd.http.backend import Backend, HTTPFailure, ModelInfo, bad_request, fim_params
from ktd.http.generation import Dialect, GenerationResponse, Outcome, json_bytes

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
MAX_TOP_LOGPROBS = 20  # the daemon's limit (OpenAI's chat API allows 20, its completions API 5)


def error_body(f: HTTPFailure) -> dict[str, Any]:
    return {"error": {"message": f.message, "type": f.type, "param": f.param, "code": f.code}}


def _usage(u: dict[str, int]) -> dict[str, int]:
    p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# --- request checking ------------------------------------------------------------------------------

def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"{name} must be a number", name, "invalid_type")
    return v


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name} must be an integer", name, "invalid_type")
    return v


def _boolean(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean", name, "invalid_type")
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad_request("stop must be a string or an array of strings", "stop", "invalid_type")


def _refuse(body: dict) -> None:
    for name in ("n", "best_of"):
        n = _integer(body, name)
        if n is not None and n != 1:
            raise bad_request(f"{name} = {n}: ktd generates one choice per request (send {n} requests)",
                              name, "unsupported_value")
    if body.get("echo"):
        raise bad_request("echo is not supported by ktd", "echo", "unsupported_parameter")
    for name in ("functions", "function_call"):
        if body.get(name):
            raise bad_request(f"{name} (the deprecated function calling) is not supported by ktd: send "
                              "tools and tool_choice", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by ktd", "logit_bias", "unsupported_parameter")


def response_format(body: dict) -> dict[str, Any] | None:
    """The daemon's ``grammar`` for OpenAI's ``response_format`` (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a string type", "response_format",
                          "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
            raise bad_request("response_format.json_schema must be an object with a name (and a schema)",
                              "response_format", "invalid_type")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be an object (a JSON Schema)",
                              "response_format", "invalid_type")
        if js.get("strict") not in (None, True, False):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format",
                              "invalid_type")
        # strict or not, the schema is enforced: the output always validates
        return {"json_schema": schema or {"type": "object"}}
    raise bad_request(f"response_format.type {kind!r}: expected text, json_object or json_schema",
                      "response_format")


def tools(body: dict) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` for the daemon, checked for shape; the daemon checks the rest."""
    out: dict[str, Any] = {}
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list) or not all(isinstance(t, dict) for t in ts):
            raise bad_request("tools must be an array of objects", "tools", "invalid_type")
        names = []
        for i, t in enumerate(ts):
            f = t.get("function")
            if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"parameters\": ...}}", "tools", "invalid_type")
            names.append(f["name"])
        if ts:
            out["tools"] = ts
    else:
        names = []
    choice = body.get("tool_choice")
    if choice is None:
        return out
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice {choice!r}: expected auto, none, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad_request("tool_choice must be auto, none, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice",
                              "invalid_type")
        if f["name"] not in names:
            raise bad_request(f"tool_choice names the function {f['name']!r}, which is not among the tools "
                              f"({', '.join(names) or 'none given'})", "tool_choice")
        choice = {"type": "function", "function": {"name": f["name"]}}
    else:
        raise bad_request("tool_choice must be a string or an object", "tool_choice", "invalid_type")
    if not out and choice == "none":
        return out  # no tools, none chosen: nothing to tell the daemon
    if not out:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    out["tool_choice"] = choice
    return out


def chat_logprobs(body: dict) -> dict[str, Any]:
    lp = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if top and not lp:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return {"logprobs": True, "top_logprobs": top or 0} if lp else {}


def completion_logprobs(body: dict) -> dict[str, Any]:
    v = body.get("logprobs")
    if v is None or v is False:
        return {}
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request("logprobs must be an integer (the number of alternatives per token)", "logprobs",
                          "invalid_type")
    if not 0 <= v <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return {"logprobs": True, "top_logprobs": v}


def sampling(body: dict) -> dict[str, Any]:
    """The daemon's generate options from an OpenAI request body."""
    _refuse(body)
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    params = {"max_tokens": max_tokens, "temperature": _number(body, "temperature"),
              "top_p": _number(body, "top_p"), "seed": _integer(body, "seed"),
              "presence_penalty": _number(body, "presence_penalty"),
              "frequency_penalty": _number(body, "frequency_penalty"), "stop": _stop(body)}
    # Non-standard, as llama-server accepts them: ignore_eos (benchmarks), top_k, min_p.
    params.update(ignore_eos=_boolean(body, "ignore_eos"), top_k=_integer(body, "top_k"),
                  min_p=_number(body, "min_p"))
    for name in ("presence_penalty", "frequency_penalty"):
        v = params[name]
        if v is not None and not -2.0 <= v <= 2.0:
            raise bad_request(f"{name} must be in [-2, 2]", name)
    return {k: v for k, v in params.items() if v is not None}


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_boolean(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = bool(opts and _boolean(opts, "include_usage"))
    return stream, include_usage


def _tool_calls(where: str, calls: Any) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array", f"{where}.tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", "{}"), (str, dict)):
            raise bad_request(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                              "\"function\": {\"name\", \"arguments\"}}", f"{where}.tool_calls", "invalid_type")
        out.append({"id": str(c.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "{}")}})
    return out


def chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"{where} must be an object with a string role", where, "invalid_type")
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if m.get("function_call"):
            raise bad_request(f"{where}: function_call (deprecated) is not supported by ktd: send tool_calls",
                              where, "unsupported_parameter")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.content[{j}]: only text parts are supported by ktd",
                                      f"{where}.content", "unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or an array of text parts",
                              f"{where}.content", "invalid_type")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(where, m["tool_calls"])
            if m.get("content") is None:
                msg["content"] = None
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    msg[key] = m[key]
        out.append(msg)
    return out


async def resolve_model(backend: Backend, body: dict) -> ModelInfo:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required (GET /v1/models lists it)", "model", "invalid_type")
    model = await backend.model()
    if not model.matches(name):
        raise HTTPFailure(404, f"the model {name!r} does not exist: this server serves {model.id!r}",
                          code="model_not_found", param="model")
    return model


# --- responses -------------------------------------------------------------------------------------

class _OpenAIDialect(Dialect):
    media_type = "text/event-stream"

    def __init__(self, model: str, include_usage: bool, prefix: str):
        self.model, self.include_usage = model, include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def error_body(self, failure: HTTPFailure) -> dict[str, Any]:
        return error_body(failure)

    def stream_error(self, failure: HTTPFailure) -> bytes:
        return b"data: " + json_bytes(error_body(failure)) + b"\n\ndata: [DONE]\n\n"

    def _event(self, value: dict) -> bytes:
        return b"data: " + json_bytes(value) + b"\n\n"

    def _usage_event(self, outcome: Outcome) -> bytes:
        if not self.include_usage:
            return b""
        return self._event({**self._head(), "choices": [], "usage": _usage(outcome.usage)})


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def chat_logprobs_content(entries: list[dict]) -> list[dict[str, Any]]:
    """The daemon's logprobs entries in OpenAI's chat shape (``choices[].logprobs.content``)."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": _token_bytes(e["token"]),
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _token_bytes(t["token"])}
                              for t in e.get("top_logprobs", ())]} for e in entries]


def legacy_logprobs(entries: list[dict], offset: int = 0) -> dict[str, Any]:
    """The daemon's logprobs entries in the completions API's legacy shape."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", ())} for e in entries],
            "text_offset": offsets}


class ChatDialect(_OpenAIDialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage, "chatcmpl")

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def _chunk(self, delta: dict, finish: str | None, logprobs: list[dict] | None = None) -> bytes:
        lp = {"content": chat_logprobs_content(logprobs), "refusal": None} if logprobs else None
        chunk = {**self._head(), "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return self._event(chunk)

    def first(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str, logprobs: list[dict] | None = None) -> bytes:
        return self._chunk({"content": text}, None, logprobs)

    def end(self, outcome: Outcome) -> bytes:
        out = b""
        if outcome.logprobs_tail:  # tokens of held-back text (a tool call): their entries, no content
            out += self._chunk({}, None, outcome.logprobs_tail)
        for i, call in enumerate(outcome.tool_calls or ()):
            # one delta per call, whole (OpenAI's clients concatenate the arguments of each index)
            out += self._chunk({"tool_calls": [{"index": i, **call}]}, None)
        return (out + self._chunk({}, FINISH.get(outcome.finish_reason, "stop")) + self._usage_event(outcome)
                + b"data: [DONE]\n\n")

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": outcome.text, "refusal": None}
        if outcome.tool_calls:
            message["tool_calls"] = outcome.tool_calls
            message["content"] = outcome.text or None
        lp = ({"content": chat_logprobs_content(outcome.logprobs), "refusal": None}
              if outcome.logprobs is not None else None)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": message,
                             "logprobs": lp, "finish_reason": FINISH.get(outcome.finish_reason, "stop")}],
                "usage": _usage(outcome.usage)}


class CompletionDialect(_OpenAIDialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage, "cmpl")
        self.offset = 0  # text_offset of the next streamed token

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _chunk(self, text: str, finish: str | None, logprobs: list[dict] | None = None) -> bytes:
        lp = None
        if logprobs:
            lp = legacy_logprobs(logprobs, self.offset)
            self.offset += sum(len(e["token"]) for e in logprobs)
        chunk = {**self._head(), "choices": [{"index": 0, "text": text, "logprobs": lp,
                                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return self._event(chunk)

    def piece(self, text: str, logprobs: list[dict] | None = None) -> bytes:
        return self._chunk(text, None, logprobs)

    def end(self, outcome: Outcome) -> bytes:
        return (self._chunk("", FINISH.get(outcome.finish_reason, "stop"), outcome.logprobs_tail)
                + self._usage_event(outcome) + b"data: [DONE]\n\n")

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        lp = legacy_logprobs(outcome.logprobs) if outcome.logprobs is not None else None
        return {**self._head(),
                "choices": [{"index": 0, "text": outcome.text, "logprobs": lp,
                             "finish_reason": FINISH.get(outcome.finish_reason, "stop")}],
                "usage": _usage(outcome.usage)}


async def chat_completions(backend: Backend, body: dict, on_done=None) -> GenerationResponse:
    model = await resolve_model(backend, body)
    stream, include_usage = stream_flags(body)
    params = {"messages": chat_messages(body), **sampling(body), **tools(body), **chat_logprobs(body)}
    grammar = response_format(body)
    if grammar is not None:
        params["grammar"] = grammar
    return GenerationResponse(backend, params, ChatDialect(body["model"], include_usage), stream=stream,
                              on_done=on_done)


async def completions(backend: Backend, body: dict, on_done=None) -> GenerationResponse:
    model = await resolve_model(backend, body)
    stream, include_usage = stream_flags(body)
    params = {**sampling(body), **completion_logprobs(body)}
    grammar = response_format(body)  # not in OpenAI's completions API; llama-server's extension
    if grammar is not None:
        params["grammar"] = grammar
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("suffix must be a string", "suffix", "invalid_type")
    if isinstance(prompt, str):
        if suffix is not None:
            params.update(fim_params(model, prompt, suffix))
        else:
            # Raw completion text: special-token texts in it (chat markup) are control tokens, as
            # llama-server and Ollama's raw mode treat them.
            params.update(prompt=prompt, parse_special=True)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        if suffix is not None:
            raise bad_request("suffix needs a text prompt", "suffix")
        params["tokens"] = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("a batch of prompts is not supported: send one request per prompt", "prompt",
                          "unsupported_value")
    else:
        raise bad_request("prompt must be a string or an array of token ids", "prompt", "invalid_type")
    return GenerationResponse(backend, params, CompletionDialect(body["model"], include_usage),
                              stream=stream, on_done=on_done)


def models_list(model: ModelInfo) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(model)]}


def model_object(model: ModelInfo) -> dict[str, Any]:
    return {"id": model.id, "object": "model", "created": 0, "owned_by": "ktd",
            "context_length": model.n_ctx}
