"""Chat template rendering: the real models' templates against the formats written out by hand,
and the sandbox."""

from __future__ import annotations

import pytest

from ktd.text.chat import ChatTemplateError, render_chat_template
from ktd.text.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def qwen(real_model):
    return Tokenizer.from_gguf(real_model("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="module")
def gemma(real_model):
    return Tokenizer.from_gguf(real_model("gemma-3-270m"))


@pytest.mark.realmodel
def test_qwen_chatml(qwen):
    assert qwen.chat_template is not None
    assert qwen.render_chat(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message the template supplies Qwen's default one.
    assert qwen.render_chat(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
    )
    # The turn terminator ends generation.
    im_end = qwen.encode("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and im_end[0] in qwen.eos_ids


@pytest.mark.realmodel
def test_gemma3_turns(gemma):
    # The GGUF carries no template; ktd's built-in Gemma 3 template is used.
    assert gemma.render_chat(CONVERSATION) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        gemma.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    eot = gemma.encode("<end_of_turn>", add_special=False, parse_special=True)
    assert len(eot) == 1 and eot[0] in gemma.eos_ids


def _llama_cpp_builtin_chat(name: str, messages: list[dict]) -> str:
    """llama.cpp's own C++ chat formatter (llama_chat_apply_template with a built-in name)."""
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python (the llama.cpp oracle) is not installed: {e}")
    import ctypes

    msgs = (llama_cpp.llama_chat_message * len(messages))()
    keep = []  # the C structs point into these bytes objects
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        msgs[i].role, msgs[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(name.encode(), msgs, len(messages), True, buf, len(buf))
    assert 0 < n <= len(buf)
    return buf.raw[:n].decode()


@pytest.mark.realmodel
def test_templates_match_llama_cpp_builtin_formats(qwen, gemma):
    """An independent implementation of the same formats: llama.cpp's hard-coded chatml and
    gemma formatters (which leave the BOS token to the tokenizer)."""
    assert qwen.render_chat(CONVERSATION) == _llama_cpp_builtin_chat("chatml", CONVERSATION)
    assert gemma.render_chat(CONVERSATION) == "<bos>" + _llama_cpp_builtin_chat("gemma", CONVERSATION)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__ }}",
    "{% if ''.__class__ %}x{% endif %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_escape_is_a_clear_error(template):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(template, msgs)
    assert "chat template" in str(e.value)
    if "__" in template:
        assert "sandbox" in str(e.value) and "unsafe" in str(e.value)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_template_errors():
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="no way"):
        render_chat_template("{{ raise_exception('no way') }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages[5]['content'] + 1 }}", [])
    with pytest.raises(ChatTemplateError, match="list of objects"):
        render_chat_template("{{ messages }}", "not a list")
    assert issubclass(ChatTemplateError, ValueError)


def test_template_helpers():
    msgs = [{"role": "user", "content": "caf\u00e9 \u4f60\u597d \"q\""}]
    # tojson as transformers defines it: no ASCII escaping, no HTML escaping.
    assert render_chat_template("{{ messages[0] | tojson }}", msgs) == \
        '{"role": "user", "content": "caf\u00e9 \u4f60\u597d \\"q\\""}'
    assert render_chat_template("{{ messages | tojson(indent=2) }}", msgs).startswith("[\n  {")
    year = render_chat_template("{{ strftime_now('%Y') }}", [])
    assert year.isdigit() and len(year) == 4
    # trim_blocks / lstrip_blocks as transformers sets them
    assert render_chat_template("  {% if true %}\nx\n  {% endif %}\ny", []) == "x\ny"
    # loop controls extension
    assert render_chat_template("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", []) == "1"
    assert render_chat_template("{{ bos_token }}|{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>|</s>"


def test_no_template_is_a_clear_error():
    tok = Tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [b"<unk>", b"<s>", b"</s>"],
                     "tokenizer.ggml.scores": __import__("numpy").zeros(3, dtype="float32")})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])
