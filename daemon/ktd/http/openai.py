"""The OpenAI dialect: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Request fields are checked for type here (a wrong type is a 400 naming the field); ranges are
the daemon's (``docs/PROTOCOL.md`` generate options), whose ``bad_request`` becomes a 400 too.
Refused with 400 rather than silently ignored: ``n``/``best_of`` > 1, ``logprobs``, ``echo``,
``tools``/``functions``, non-text content parts, ``response_format`` other than text. Accepted and
ignored: ``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls`` and
``logit_bias`` when empty. Extensions (llama-server has them too): ``top_k``, ``min_p``,
``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ktd.http.backend import Backend, HTTPFailure, ModelInfo, bad_request, fim_prompt_tokens
from ktd.http.generation import Dialect, GenerationResponse, Outcome, json_bytes

FINISH = {"stop": "stop", "length": "length"}


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
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported by ktd", "logprobs", "unsupported_parameter")
    if body.get("echo"):
        raise bad_request("echo is not supported by ktd", "echo", "unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_request(f"{name} (function calling) is not supported by ktd", name,
                              "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by ktd", "logit_bias", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("response_format other than {\"type\": \"text\"} is not supported by ktd",
                          "response_format", "unsupported_parameter")


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


def chat_messages(body: dict) -> list[dict[str, str]]:
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
        if content is None:
            if m.get("tool_calls") or m.get("function_call"):
                raise bad_request(f"{where}: tool calls are not supported by ktd", where,
                                  "unsupported_parameter")
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
        out.append({"role": role, "content": content})
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


class ChatDialect(_OpenAIDialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage, "chatcmpl")

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def _chunk(self, delta: dict, finish: str | None) -> bytes:
        chunk = {**self._head(), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return self._event(chunk)

    def first(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def piece(self, text: str) -> bytes:
        return self._chunk({"content": text}, None)

    def end(self, outcome: Outcome) -> bytes:
        return (self._chunk({}, FINISH.get(outcome.finish_reason, "stop")) + self._usage_event(outcome)
                + b"data: [DONE]\n\n")

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text,
                                                     "refusal": None},
                             "logprobs": None, "finish_reason": FINISH.get(outcome.finish_reason, "stop")}],
                "usage": _usage(outcome.usage)}


class CompletionDialect(_OpenAIDialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage, "cmpl")

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _chunk(self, text: str, finish: str | None) -> bytes:
        chunk = {**self._head(), "choices": [{"index": 0, "text": text, "logprobs": None,
                                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return self._event(chunk)

    def piece(self, text: str) -> bytes:
        return self._chunk(text, None)

    def end(self, outcome: Outcome) -> bytes:
        return (self._chunk("", FINISH.get(outcome.finish_reason, "stop")) + self._usage_event(outcome)
                + b"data: [DONE]\n\n")

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return {**self._head(),
                "choices": [{"index": 0, "text": outcome.text, "logprobs": None,
                             "finish_reason": FINISH.get(outcome.finish_reason, "stop")}],
                "usage": _usage(outcome.usage)}


async def chat_completions(backend: Backend, body: dict, on_done=None) -> GenerationResponse:
    model = await resolve_model(backend, body)
    stream, include_usage = stream_flags(body)
    params = {"messages": chat_messages(body), **sampling(body)}
    return GenerationResponse(backend, params, ChatDialect(body["model"], include_usage), stream=stream,
                              on_done=on_done)


async def completions(backend: Backend, body: dict, on_done=None) -> GenerationResponse:
    model = await resolve_model(backend, body)
    stream, include_usage = stream_flags(body)
    params = sampling(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("suffix must be a string", "suffix", "invalid_type")
    if isinstance(prompt, str):
        if suffix is not None:
            params["tokens"] = await fim_prompt_tokens(backend, model, prompt, suffix)
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
