"""The wire protocol, pure: message shapes, framing limits, parameter validation (docs/PROTOCOL.md).

msgpack-RPC shapes over a SOCK_STREAM Unix socket, one msgpack value per message, no extra framing:

    request       [0, msgid, method, params]     client → server, params = [] or [{named}]
    response      [1, msgid, error, result]      server → client, error = nil or {code, message}
    notification  [2, method, params]            server → client: "generate.chunk" [msgid, i, text]

Nothing here does I/O: the server feeds bytes to a ``FrameDecoder`` and hands the values to
``parse_request``; the validators turn params into typed request objects or raise a ``KtdError``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ktd.errors import BadRequest, KtdError, TooLarge
from ktd.text.grammar import GrammarSpec
from ktd.text.grammar import parse_spec as parse_grammar_spec
from ktd.text.tools import ToolsRequest, parse_tools
from ktd.text.sampling import SamplingParams

PROTOCOL_VERSION = 1
REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
CHUNK = "generate.chunk"       # server notification: [msgid, index, text] or [msgid, index, text, extra]
ERROR_NOTIFICATION = "error"   # server notification: [{code, message}] (no msgid to answer)
MAX_MSGID = (1 << 32) - 1      # msgpack-RPC msgid is a 32-bit unsigned integer
MAX_TOP_LOGPROBS = 20          # top_logprobs bound (the native sampler's, kMaxTopLogprobs)
METHODS = ("hello", "generate", "cancel", "tokenize", "detokenize", "health", "status", "metrics", "profile")


# Values quoted in error messages come from the peer: their repr is bounded in depth and length
# (a full repr of 1,000 nested arrays recurses past Python's limit; of a 1 MB array, costs 1 MB).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 2, 60, 60, 40
_QUOTE.maxlist = _QUOTE.maxdict = 4


def brief(value: Any) -> str:
    """A short repr of a peer's value for an error message."""
    return _QUOTE.repr(value)


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may contain (config sections server + limits)."""

    max_frame_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    max_tokens: int = 4096
    max_messages: int = 256
    max_nesting: int = 16
    max_stop: int = 16
    chat_template_max_chars: int = 1 << 22
    chat_template_timeout_s: float = 2.0


class FramingError(KtdError):
    """The byte stream cannot be decoded further: answer, then close the connection."""

    def __init__(self, error: KtdError):
        super().__init__(error.message)
        self.error = error


class FrameDecoder:
    """Incremental msgpack decoder with a frame-size bound.

    ``feed(data)`` yields complete values. Strings with invalid UTF-8 are decoded with
    ``surrogateescape`` so that framing survives; ``check_value`` turns them into a
    ``bad_request`` for that one message. Raises ``FramingError`` when the stream is lost
    (a value larger than ``max_frame_bytes``, malformed msgpack, nesting beyond msgpack's stack).

    A message is decoded only once all of its bytes are here. msgpack builds a list as soon as
    it reads an array header, sized by the header's count, so decoding a partial message lets a
    peer make the daemon hold what its headers claim (1,000 nested array32 headers, 5 KB, claimed
    64 MB); until then a skipping unpacker, which builds nothing, finds where the message ends
    and the decoder holds only the message's bytes. A complete message's counts are backed by
    its bytes.
    """

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._scanner = msgpack.Unpacker(max_buffer_size=max_frame_bytes)
        self._pending = bytearray()  # the bytes of the message being received
        self._fed = 0                # stream offset of the next byte fed
        self._boundary = 0           # stream offset where the message being received starts

    def feed(self, data: bytes) -> Iterator[Any]:
        view = memoryview(data)
        while view:
            # Feed at most what fits; a value that never completes within the buffer is too large.
            room = self.max_frame_bytes - len(self._pending)
            if room <= 0:
                raise FramingError(TooLarge(f"message larger than {self.max_frame_bytes} bytes"))
            chunk, view = view[:room], view[room:]
            try:
                self._scanner.feed(chunk)
            except msgpack.BufferFull:
                raise FramingError(TooLarge(f"message larger than {self.max_frame_bytes} bytes")) from None
            yield from self._drain(chunk)

    @property
    def partial(self) -> bool:
        """True while part of a message has been received (a close now truncates it)."""
        return self._boundary < self._fed

    def _drain(self, chunk: memoryview) -> Iterator[Any]:
        # chunk holds stream bytes [fed, fed + len); _pending holds [boundary, fed) when the
        # message started in an earlier chunk. tell() is exact only after a complete message.
        fed = self._fed
        while True:
            try:
                self._scanner.skip()
            except msgpack.OutOfData:
                self._pending += chunk[max(0, self._boundary - fed):]
                self._fed = fed + len(chunk)
                return
            except (msgpack.FormatError, msgpack.StackError, ValueError) as e:
                raise _malformed(e) from None
            end = self._scanner.tell()
            frame = bytes(self._pending) + bytes(chunk[max(0, self._boundary - fed):end - fed])
            self._pending = bytearray()
            self._boundary = end
            yield self._decode(frame)

    def _decode(self, frame: bytes) -> Any:
        try:
            return msgpack.unpackb(frame, raw=False, unicode_errors="surrogateescape",
                                   strict_map_key=False, use_list=True, timestamp=0)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError,
                TypeError) as e:
            raise _malformed(e) from None


def _malformed(e: Exception) -> FramingError:
    detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return FramingError(BadRequest(f"malformed msgpack ({detail})"))


@dataclass(frozen=True)
class Request:
    msgid: int
    method: str
    params: dict[str, Any]


def check_value(value: Any, max_depth: int) -> None:
    """Reject what msgpack can carry but the protocol never uses: nesting deeper than
    ``max_depth`` (too_large), invalid UTF-8 in strings, ext types, non-string map keys."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest("string is not valid UTF-8") from None
        elif isinstance(v, (list, dict)):
            if depth > max_depth:
                raise TooLarge(f"nesting deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    if not isinstance(k, str):
                        raise BadRequest(f"map key {brief(k)} is not a string")
                    stack.append((k, depth + 1))
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)
        elif not (v is None or isinstance(v, (bool, int, float, bytes))):
            raise BadRequest(f"unsupported msgpack type {type(v).__name__}")


def request_id(value: Any) -> int | None:
    """The msgid of something shaped like a request, to address an error to it (else None)."""
    if (isinstance(value, list) and len(value) >= 2 and value[0] == REQUEST
            and type(value[1]) is int and 0 <= value[1] <= MAX_MSGID):
        return value[1]
    return None


def parse_request(value: Any, limits: Limits) -> Request:
    """Validate the message shape. Raises BadRequest/TooLarge; ``request_id(value)`` tells
    whether the error can be sent as a response (else as an "error" notification)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("message must be an array [type, ...]")
    kind = value[0]
    if kind == NOTIFICATION and type(kind) is int:
        raise BadRequest("client notifications are not supported; send requests [0, msgid, method, params]")
    if kind != REQUEST or type(kind) is not int:
        raise BadRequest(f"message type must be 0 (request), got {brief(kind)}")
    if len(value) != 4:
        raise BadRequest("request must be [0, msgid, method, params]")
    _, msgid, method, params = value
    if type(msgid) is not int or not 0 <= msgid <= MAX_MSGID:
        raise BadRequest("msgid must be an integer in [0, 2**32)")
    check_value(value, limits.max_nesting + 2)  # + the message array and the params array
    if not isinstance(method, str):
        raise BadRequest("method must be a string")
    if method not in METHODS:
        raise BadRequest(f"unknown method {brief(method)}")
    if not isinstance(params, list):
        raise BadRequest("params must be an array: [] or [{name: value, ...}]")
    if len(params) > 1 or (params and not isinstance(params[0], dict)):
        raise BadRequest("params must be [] or [{name: value, ...}] (named parameters in one map)")
    return Request(msgid, method, dict(params[0]) if params else {})


# --- parameters -------------------------------------------------------------------------------

class _Params:
    """Typed access to a params map; every getter names the parameter in its error."""

    def __init__(self, method: str, params: dict[str, Any], known: tuple[str, ...]):
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise BadRequest(f"{method}: unknown parameter {brief(unknown[0])} (known: {', '.join(known)})")
        self.method, self.p = method, params

    def _fail(self, name: str, expected: str) -> BadRequest:
        return BadRequest(f"{self.method}: {name} must be {expected}, got {brief(self.p[name])}")

    def int(self, name: str, default: Any, lo: int, hi: int) -> Any:
        v = self.p.get(name, default)
        if v is None and default is None:
            return None
        if type(v) is not int or not lo <= v <= hi:
            raise self._fail(name, f"an integer in [{lo}, {hi}]")
        return v

    def float(self, name: str, default: float) -> float:
        v = self.p.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._fail(name, "a number")
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.p.get(name, default)
        if not isinstance(v, bool):
            raise self._fail(name, "true or false")
        return v

    def str(self, name: str, default: Any) -> Any:
        v = self.p.get(name, default)
        if v is None and default is None:
            return None
        if not isinstance(v, str):
            raise self._fail(name, "a string")
        return v


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None                   # raw text, tokenized with add_special
    messages: list[dict[str, Any]] | None  # chat, rendered by the model's chat template
    sampling: SamplingParams
    max_tokens: int | None               # None: until eos/stop or the context is full
    stop: tuple[str, ...] = ()
    stream: bool = True
    ignore_eos: bool = False
    add_special: bool = True
    parse_special: bool = False
    deadline_s: float | None = None      # client's own deadline, capped by the server's
    tokens: tuple[int, ...] | None = field(default=None)  # pre-tokenized prompt
    grammar: GrammarSpec | None = None   # structured output (ktd.text.grammar)
    tools: ToolsRequest | None = None    # tool calls (ktd.text.tools)
    top_logprobs: int | None = None      # logprobs: alternatives per token (None: no logprobs)
    cache_prompt: bool = True            # prefix cache: reuse a cached prefix, keep this KV
    suffix: str | None = None            # fill-in-the-middle: the text after the gap (prompt: before it)
    cache_owner: str | None = None       # prefix cache: the caller within the peer's uid (the gateway's key id)


_GENERATE_KEYS = ("prompt", "messages", "tokens", "max_tokens", "stop", "stream", "ignore_eos",
                  "add_special", "parse_special", "deadline_s", "temperature", "top_k", "top_p",
                  "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                  "penalty_last_n", "seed", "grammar", "logprobs", "top_logprobs", "tools", "tool_choice",
                  "cache_prompt", "suffix", "cache_owner")
MAX_CACHE_OWNER = 128                    # characters of generate's cache_owner


def parse_generate(params: dict[str, Any], limits: Limits) -> GenerateRequest:
    p = _Params("generate", params, _GENERATE_KEYS)
    given = [k for k in ("prompt", "messages", "tokens") if params.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("generate: give exactly one of prompt, messages, tokens")
    prompt = p.str("prompt", None)
    suffix = p.str("suffix", None)
    if suffix is not None and prompt is None:
        raise BadRequest("generate: suffix (fill-in-the-middle) needs prompt, the text before the gap")
    messages = None
    if params.get("messages") is not None:
        messages = params["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("generate: messages must be a non-empty array of maps")
        if len(messages) > limits.max_messages:
            raise TooLarge(f"generate: {len(messages)} messages, the limit is {limits.max_messages}")
        for i, m in enumerate(messages):
            check_message(i, m)
    tokens = None
    if params.get("tokens") is not None:
        t = params["tokens"]
        if not isinstance(t, list) or not t or not all(type(x) is int and x >= 0 for x in t):
            raise BadRequest("generate: tokens must be a non-empty array of non-negative integers")
        tokens = tuple(t)  # their count and range are checked with the model's (ktd.server.admission)
    max_tokens = params.get("max_tokens")
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest(f"generate: max_tokens must be a positive integer, got {brief(max_tokens)}")
        if max_tokens > limits.max_tokens:
            raise TooLarge(f"generate: max_tokens {max_tokens} exceeds the limit {limits.max_tokens}")
    stop = params.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("generate: stop must be a string or an array of non-empty strings")
    if len(stop) > limits.max_stop:
        raise TooLarge(f"generate: {len(stop)} stop strings, the limit is {limits.max_stop}")
    d = SamplingParams()
    sampling = SamplingParams(
        temperature=p.float("temperature", d.temperature), top_k=p.int("top_k", d.top_k, 0, 1 << 20),
        top_p=p.float("top_p", d.top_p), min_p=p.float("min_p", d.min_p),
        repeat_penalty=p.float("repeat_penalty", d.repeat_penalty),
        presence_penalty=p.float("presence_penalty", d.presence_penalty),
        frequency_penalty=p.float("frequency_penalty", d.frequency_penalty),
        penalty_last_n=p.int("penalty_last_n", d.penalty_last_n, 0, 1 << 20),
        seed=p.int("seed", None, 0, (1 << 64) - 1))
    try:
        sampling.validate()
    except ValueError as e:
        raise BadRequest(f"generate: {e}") from None
    deadline = params.get("deadline_s")
    if deadline is not None:
        deadline = p.float("deadline_s", 0.0)
        if not 0 < deadline < 1e9:
            raise BadRequest("generate: deadline_s must be a positive number of seconds")
    grammar = None
    if params.get("grammar") is not None:
        grammar = parse_grammar_spec(params["grammar"])
        if p.bool("ignore_eos", False):
            raise BadRequest("generate: grammar and ignore_eos exclude each other (the grammar decides where "
                             "the output may end)")
    top_logprobs = None
    if p.bool("logprobs", False):
        top_logprobs = p.int("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif params.get("top_logprobs") is not None:
        raise BadRequest("generate: top_logprobs needs logprobs: true")
    tools = parse_tools(params.get("tools"), params.get("tool_choice"))
    if tools is not None and tools.choice in ("required", "function") and grammar is not None:
        raise BadRequest("generate: grammar and a required or named tool_choice exclude each other "
                         "(the tool call's grammar is the constraint)")
    return GenerateRequest(prompt=prompt, messages=messages, tokens=tokens, sampling=sampling,
                           max_tokens=max_tokens, stop=tuple(stop), stream=p.bool("stream", True),
                           ignore_eos=p.bool("ignore_eos", False),
                           add_special=p.bool("add_special", True),
                           parse_special=p.bool("parse_special", False), deadline_s=deadline,
                           grammar=grammar, top_logprobs=top_logprobs, tools=tools,
                           cache_prompt=p.bool("cache_prompt", True), suffix=suffix,
                           cache_owner=_cache_owner(p))


def _cache_owner(p: _Params) -> str | None:
    owner = p.str("cache_owner", None)
    if owner is not None and not 0 < len(owner) <= MAX_CACHE_OWNER:
        raise BadRequest(f"generate: cache_owner must be a string of 1 to {MAX_CACHE_OWNER} characters")
    return owner


def check_message(i: int, m: Any) -> None:
    """One chat message: {role, content: str}; an assistant's may carry tool_calls (OpenAI's shape)
    with content null; a tool result is {role: "tool", content: str, tool_call_id?, name?}."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"generate: messages[{i}] must be a map with string role and content")
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant":
            raise BadRequest(f"generate: messages[{i}]: only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise BadRequest(f"generate: messages[{i}].tool_calls must be an array")
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or \
                    not isinstance(f.get("arguments", {}), (str, dict)):
                raise BadRequest(f"generate: messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                                 f"\"function\": {{\"name\": str, \"arguments\": str or map}}}}")
            if not isinstance(c.get("id", ""), str):
                raise BadRequest(f"generate: messages[{i}].tool_calls[{j}].id must be a string")
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise BadRequest(f"generate: messages[{i}] must be a map with string role and content "
                         "(null only for an assistant message with tool_calls)")
    for key in ("tool_call_id", "name"):
        if key in m and not isinstance(m[key], str):
            raise BadRequest(f"generate: messages[{i}].{key} must be a string")


def parse_cancel(params: dict[str, Any]) -> int:
    """The msgid (on the same connection) of the generate request to cancel."""
    p = _Params("cancel", params, ("id",))
    if "id" not in params:
        raise BadRequest("cancel: id (the msgid of the generate request) is required")
    return p.int("id", None, 0, MAX_MSGID)


def parse_tokenize(params: dict[str, Any]) -> tuple[str, bool, bool]:
    p = _Params("tokenize", params, ("text", "add_special", "parse_special"))
    if "text" not in params:
        raise BadRequest("tokenize: text is required")
    return p.str("text", ""), p.bool("add_special", True), p.bool("parse_special", False)


def parse_detokenize(params: dict[str, Any], n_vocab: int) -> list[int]:
    _Params("detokenize", params, ("tokens",))
    t = params.get("tokens")
    if not isinstance(t, list) or not all(type(x) is int for x in t):
        raise BadRequest("detokenize: tokens must be an array of integers")
    bad = out_of_vocab(t, n_vocab)
    if bad is not None:
        raise BadRequest(f"detokenize: token {bad} is outside the vocabulary [0, {n_vocab})")
    return t


def out_of_vocab(ids: Sequence[int], n_vocab: int) -> int | None:
    """The first id outside [0, n_vocab), None when all are inside."""
    if not ids or (min(ids) >= 0 and max(ids) < n_vocab):  # the common case, at C speed
        return None
    return next(x for x in ids if not 0 <= x < n_vocab)


def parse_profile(params: dict[str, Any]) -> bool:
    """profile: whether to reset the routing profile (privileged peers only) before answering."""
    return _Params("profile", params, ("reset",)).bool("reset", False)


def parse_empty(method: str, params: dict[str, Any]) -> None:
    _Params(method, params, ())


# --- encoding ---------------------------------------------------------------------------------

def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def response(msgid: int, result: Any = None, error: KtdError | None = None) -> bytes:
    return pack([RESPONSE, msgid, error.to_wire() if error else None, None if error else result])


def notification(method: str, params: list[Any]) -> bytes:
    return pack([NOTIFICATION, method, params])


def chunk(msgid: int, index: int, text: str, extra: dict[str, Any] | None = None) -> bytes:
    """A generate.chunk; ``extra`` (a 4th element, only when given): {"logprobs": [...]}."""
    return notification(CHUNK, [msgid, index, text] if extra is None else [msgid, index, text, extra])


def error_notification(error: KtdError) -> bytes:
    return notification(ERROR_NOTIFICATION, [error.to_wire()])
