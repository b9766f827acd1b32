"""Chat templates: messages -> prompt text, rendered like Hugging Face transformers does.

Templates come from the model file (``tokenizer.chat_template``), i.e. from a third party, so they
run in Jinja2's ImmutableSandboxedEnvironment: no access to dunder/internal attributes, no
mutation of the caller's objects. Every template failure (syntax, runtime, sandbox violation,
``raise_exception``) is a ChatTemplateError with a one-line message.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache

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


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox returns an Undefined for an unsafe attribute, which prints as an empty
    string; a template probing internals is hostile or broken, so it fails at once instead."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", **extra) -> str:
    """Render ``source`` with ``messages`` ([{"role": ..., "content": ...}, ...]).

    ``extra`` is passed to the template as further variables (``tools``, ``documents``, ...).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of objects with 'role' and 'content'")
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template rejected by the sandbox: {e}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


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
