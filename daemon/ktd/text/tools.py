"""Tool calls (docs/PROTOCOL.md, generate ``tools``/``tool_choice``): the request's tools, the
template family that says how a model writes a call, the grammar that forces one, and the
parser that takes calls out of the generated text.

The tools are rendered by the model's own chat template (``tools`` is a template variable; the
template decides the prompt's wording). How a model writes a call depends on its family, told
from the template's text:

- ``hermes`` (Qwen2/2.5/3, Hermes, many others): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``, one block per call, possibly after some text;
- ``llama3`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: the whole reply is ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
  (``[TOOL_CALLS]`` is a control token, absent from the decoded text).

``ToolCallParser`` is fed the streamed text: it passes ordinary text through and holds back what may
be a call until it can tell; a call that does not parse is given back as text (never an error).
``required`` and a named ``tool_choice`` are enforced by a grammar (``forced_grammar``): the family's
call syntax around a JSON Schema of the tool's name and parameters.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ktd.errors import BadRequest
from ktd.text.grammar import GrammarSpec

FAMILIES = ("hermes", "llama3", "mistral")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_WS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,8}"}


@dataclass(frozen=True)
class ToolsRequest:
    tools: tuple[dict[str, Any], ...]  # [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    choice: str = "auto"               # "auto" | "none" | "required" | "function" (a named one)
    name: str | None = None            # choice "function": the tool to call

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def parse_tools(tools: Any, tool_choice: Any) -> ToolsRequest | None:
    """The ``tools`` and ``tool_choice`` parameters (OpenAI's shapes), or BadRequest."""
    if tools is None:
        if tool_choice is not None:
            raise BadRequest("generate: tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadRequest("generate: tools must be a non-empty array of {type: function, function: {...}}")
    seen = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise BadRequest(f"generate: tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise BadRequest(f"generate: tools[{i}].function.name must be a non-empty string")
        if name in seen:
            raise BadRequest(f"generate: tools: the name {name!r} is given twice")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise BadRequest(f"generate: tools[{i}].function.description must be a string")
        if not isinstance(f.get("parameters", {}), dict):
            raise BadRequest(f"generate: tools[{i}].function.parameters must be a map (a JSON Schema)")
    tools = tuple({"type": "function", "function": t["function"]} for t in tools)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequest(f"generate: tool_choice must be auto, none, required or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        return ToolsRequest(tools, choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise BadRequest("generate: tool_choice must be auto, none, required or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in seen:
        raise BadRequest(f"generate: tool_choice names {name!r}, which is not among the tools")
    return ToolsRequest(tools, "function", name)


def family(template: str | None) -> str | None:
    """How a model with this chat template writes tool calls (None: its template has no tools)."""
    if not template or "tools" not in template:
        return None
    if _OPEN in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template or "<|python_tag|>" in template:
        return "llama3"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a tool call's ``arguments`` given as JSON text
    (OpenAI's shape) parsed into a map, as the templates write it with ``tojson``."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                f = dict(c.get("function", {}))
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        pass  # not JSON: the template gets the text
                fixed.append({**c, "function": f})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             args_key: f.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def forced_grammar(req: ToolsRequest, fam: str) -> GrammarSpec:
    """A grammar allowing exactly one call, in the family's syntax, of the named tool
    (``function``) or of any of the tools (``required``), its arguments valid for the tool's
    parameter schema."""
    tools = [t for t in req.tools if req.name is None or t["function"]["name"] == req.name]
    args_key = "parameters" if fam == "llama3" else "arguments"
    options = [_call_schema(t, args_key) for t in tools]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": _WS}
    if fam == "hermes":
        lark = f'start: "{_OPEN}\\n" call "\\n{_CLOSE}"\ncall: %json {json.dumps(schema)}'
        return GrammarSpec("lark", lark)
    if fam == "mistral":  # the [TOOL_CALLS] control token cannot be forced: the array alone
        return GrammarSpec("json_schema", {"type": "array", "items": schema, "minItems": 1, "maxItems": 1,
                                           "x-guidance": _WS})
    return GrammarSpec("json_schema", schema)


def _call(name: Any, arguments: Any, call_id: Any = None) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"id": call_id if isinstance(call_id, str) and call_id else f"call_{secrets.token_hex(8)}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _json_calls(text: str, fam: str) -> list[dict[str, Any]] | None:
    """The calls of a whole-reply family (llama3, mistral), or None when ``text`` is not one."""
    s = text.strip()
    if fam == "llama3":
        s = s.removeprefix("<|python_tag|>").strip()
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while True:  # objects separated by ";"
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except ValueError:
                return None
            c = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
            if c is None:
                return None
            calls.append(c)
            rest = s[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            pos = len(s) - len(rest) + 1
            while pos < len(s) and s[pos].isspace():
                pos += 1
    s = s.removeprefix("[TOOL_CALLS]").strip()
    if not s.startswith("["):
        return None
    try:
        arr = json.loads(s)
    except ValueError:
        return None
    if not isinstance(arr, list) or not arr:
        return None
    calls = []
    for obj in arr:
        c = _call(obj.get("name"), obj.get("arguments"), obj.get("id")) if isinstance(obj, dict) else None
        if c is None:
            return None
        calls.append(c)
    return calls


class ToolCallParser:
    """Separates tool calls from text in a streamed reply. ``feed(text)`` returns the text that can
    be streamed now; ``finish()`` the rest of the text and the calls, OpenAI's shape:
    ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``."""

    def __init__(self, fam: str):
        if fam not in FAMILIES:
            raise ValueError(f"unknown tool call family {fam!r}")
        self.fam = fam
        self.calls: list[dict[str, Any]] = []
        self._held = ""
        self._mode = "start"  # whole-reply families: "start" (undecided), "text", "call"
        self._after_call = False

    def feed(self, text: str) -> str:
        if self.fam == "hermes":
            return self._feed_hermes(text)
        if self._mode == "text":
            return text
        self._held += text
        s = self._held.lstrip()
        if not s:
            return ""
        opener = ("{", "<|python_tag|>") if self.fam == "llama3" else ("[", "[TOOL_CALLS]")
        if any(s.startswith(o) or o.startswith(s) for o in opener):
            self._mode = "call"  # held to the end: the whole reply is a call, or text after all
            return ""
        self._mode = "text"
        out, self._held = self._held, ""
        return out

    def _feed_hermes(self, text: str) -> str:
        buf = self._held + text
        out = []
        while True:
            if self._after_call:  # the whitespace after a call (the line break between calls) is dropped
                buf = buf.lstrip()
                if not buf:
                    self._held = ""
                    return "".join(out)
                self._after_call = False
            start = buf.find(_OPEN)
            if start < 0:
                # hold back a suffix that may be the start of <tool_call>
                keep = next((j for j in range(max(0, len(buf) - len(_OPEN) + 1), len(buf))
                             if _OPEN.startswith(buf[j:])), len(buf))
                out.append(buf[:keep])
                self._held = buf[keep:]
                return "".join(out)
            out.append(buf[:start])
            end = buf.find(_CLOSE, start)
            if end < 0:
                self._held = buf[start:]
                return "".join(out)
            block = buf[start:end + len(_CLOSE)]
            call = self._hermes_call(buf[start + len(_OPEN):end])
            if call is None:
                out.append(block)  # malformed: it stays text
            else:
                self.calls.append(call)
            buf = buf[end + len(_CLOSE):]
            self._after_call = call is not None

    @staticmethod
    def _hermes_call(body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return _call(obj.get("name"), args)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        if self.fam == "hermes":
            return held, self.calls  # an unterminated <tool_call> stays text
        if self._mode == "call":
            calls = _json_calls(held, self.fam)
            if calls is not None:
                self.calls = calls
                return "", calls
        return held, self.calls


def parse_reply(text: str, fam: str) -> tuple[str, list[dict[str, Any]]]:
    """``ToolCallParser`` over a whole reply: (text without the calls, calls)."""
    p = ToolCallParser(fam)
    head = p.feed(text)
    rest, calls = p.finish()
    return head + rest, calls
