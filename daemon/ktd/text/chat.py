"""Chat templates: messages -> prompt text, rendered like Hugging Face transformers does.

Templates come from the model file (``tokenizer.chat_template``), i.e. from a third party, so they
run in Jinja2's ImmutableSandboxedEnvironment: no access to dunder/internal attributes, no
mutation of the caller's objects. Every template failure (syntax, runtime, sandbox violation,
``raise_exception``) is a ChatTemplateError with a one-line message.

The sandbox bounds neither size nor time (``'x' * 10**9`` runs), so rendering has both bounds
(``RenderLimits``): a string, list or number a template builds in one operation (``*``, ``+``,
``**``, ``%``, a filter or method given a width or count) may not exceed the output bound, the
output is counted as it is produced, and a render still running at the time bound is
interrupted (an asynchronous exception raised in the rendering thread).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import operator
import re
import threading
from dataclasses import dataclass
from functools import lru_cache, wraps

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered for these messages."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # transformers overrides Jinja's tojson (which HTML-escapes) with plain json.dumps.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one rendering (config: limits.chat_template_max_chars, _timeout_s)."""

    max_chars: int = 1 << 22
    timeout_s: float = 2.0


class _RenderTimeout(Exception):
    """Raised inside the rendering thread when the time bound passes."""


_bound = threading.local()      # the max_chars of the rendering on this thread
_BIG_NUMBER = re.compile(r"\d{7,}")


def _check_size(n: int) -> None:
    if n > _bound.max_chars:
        raise SecurityError(f"the template builds a value of {n} items, more than the "
                            f"{_bound.max_chars} characters a rendering may produce")


def _check_format(text: str) -> None:
    # a width or precision in a format string ('%999999999s', '{:999999999}')
    for m in _BIG_NUMBER.finditer(text):
        _check_size(int(m.group()))


def _check_args(args) -> None:
    for a in args:
        if type(a) is int:
            _check_size(abs(a))


def _guard_filter(f):
    @wraps(f)
    def guarded(*args, **kwargs):
        _check_args(args)
        _check_args(kwargs.values())
        if args and isinstance(args[0], str) and f.__name__ == "do_format":
            _check_format(args[0])
        return f(*args, **kwargs)
    return guarded


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox returns an Undefined for an unsafe attribute, which prints as an empty
    string; a template probing internals is hostile or broken, so it fails at once instead.
    Operators, calls and filters that can build a large value in one step are checked against
    the rendering's output bound first."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")

    def call_binop(self, context, op, left, right):
        sized = (str, list, tuple)
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and type(n) is int:
                    _check_size(len(seq) * n)
        elif op == "+" and isinstance(left, sized) and isinstance(right, sized):
            _check_size(len(left) + len(right))
        elif op == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
            _check_size(int(right * math.log10(abs(left))))  # the result's decimal digits
        elif op == "%" and isinstance(left, str):
            _check_format(left)
        return _BINOPS[op](left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_args(args)
        _check_args(kwargs.values())
        if isinstance(getattr(__obj, "__self__", None), str):  # str.format, str.center ...
            _check_format(__obj.__self__)
        return super().call(__context, __obj, *args, **kwargs)


_BINOPS = {"*": operator.mul, "+": operator.add, "**": operator.pow, "%": operator.mod}


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    for name, f in list(env.filters.items()):
        env.filters[name] = _guard_filter(f)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "",
                         limits: RenderLimits = RenderLimits(), **extra) -> str:
    """Render ``source`` with ``messages`` ([{"role": ..., "content": ...}, ...]) within
    ``limits``.

    ``extra`` is passed to the template as further variables (``tools``, ``documents``, ...).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of objects with 'role' and 'content'")
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e
    try:
        return _render_bounded(template, limits, dict(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **extra))
    except ChatTemplateError:
        raise
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template rendering took longer than {limits.timeout_s} s") from None
    except MemoryError:
        raise ChatTemplateError("chat template rendering ran out of memory") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template rejected by the sandbox: {e}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _render_bounded(template: jinja2.Template, limits: RenderLimits, variables: dict) -> str:
    tid = threading.get_ident()
    lock = threading.Lock()
    rendering = [True]

    def expire() -> None:
        with lock:
            if rendering[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid),
                                                           ctypes.py_object(_RenderTimeout))

    timer = threading.Timer(limits.timeout_s, expire)
    timer.daemon = True
    _bound.max_chars = limits.max_chars
    timer.start()
    try:
        out, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            if n > limits.max_chars:
                raise ChatTemplateError(f"chat template output exceeds {limits.max_chars} characters")
            out.append(piece)
        return "".join(out)
    finally:
        with lock:
            rendering[0] = False
        timer.cancel()
        # the timer may have fired between the last piece and here: drop what it raised
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


# Gemma 3 GGUF files are often converted without tokenizer.chat_template; this is the template of
# google/gemma-3 (tokenizer_config.json), text parts only.
_GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

_BUILTIN = {"gemma3": _GEMMA3_TEMPLATE}


def builtin_template(architecture: str | None) -> str | None:
    """The template ktd uses for ``architecture`` when the model file carries none."""
    return _BUILTIN.get(architecture or "")
