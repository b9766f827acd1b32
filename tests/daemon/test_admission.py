"""ktd.server.admission: a generate request's prompt, checked once against the limits and the model."""

from __future__ import annotations

import pytest

import fake_engine
from ktd.server import admission, protocol
from ktd.errors import BadRequest, ContextOverflow, TooLarge

LIMITS = protocol.Limits(max_prompt_tokens=100, max_tokens=50)


def admit(prompt, max_tokens=None, n_ctx=64):
    return admission.admit(prompt, max_tokens, n_vocab=fake_engine.N_VOCAB, n_ctx=n_ctx, limits=LIMITS)


def test_max_tokens_is_kept_or_capped_by_the_limit_and_the_context():
    assert admit([1, 2, 3], 10) == 10
    assert admit([1, 2, 3], 61) == 61                  # prompt + max_tokens == n_ctx fits
    assert admit([1, 2, 3]) == 50                      # limits.max_tokens
    assert admit([1] * 40) == 24                       # what is left of n_ctx
    assert admit([0, fake_engine.N_VOCAB - 1], 1) == 1


@pytest.mark.parametrize("prompt, max_tokens, n_ctx, error, message", [
    ([], None, 64, BadRequest, "generate: the prompt is empty"),
    ([1] * 101, None, 1000, TooLarge, "generate: 101 prompt tokens, the limit is 100"),
    ([1, 260, 5, 999], None, 64, BadRequest, "generate: token 260 is outside the vocabulary [0, 260)"),
    ([1] * 64, None, 64, ContextOverflow, "generate: 64 prompt tokens leave no room in n_ctx 64"),
    ([1] * 10, 55, 64, ContextOverflow, "generate: 10 prompt tokens + max_tokens 55 exceed n_ctx 64"),
])
def test_each_refusal_has_the_code_and_message_clients_see(prompt, max_tokens, n_ctx, error, message):
    with pytest.raises(error) as e:
        admit(prompt, max_tokens, n_ctx)
    assert type(e.value) is error and e.value.message == message
    if error is ContextOverflow:
        assert e.value.data == {"prompt_tokens": len(prompt), "n_ctx": n_ctx}


def test_the_size_limit_is_checked_before_the_vocabulary_and_the_context():
    with pytest.raises(TooLarge):
        admit([999] * 101, None, 64)


def test_out_of_vocab_finds_the_first_bad_id():
    assert protocol.out_of_vocab([], 10) is None
    assert protocol.out_of_vocab([0, 9, 3], 10) is None
    assert protocol.out_of_vocab([0, 12, -1, 10], 10) == 12
    assert protocol.out_of_vocab([3, -1], 10) == -1


def test_pre_tokenized_prompts_are_admitted_not_parsed_for_their_length():
    # parse_generate checks the shape only; the count is admission's (one check, one message)
    g = protocol.parse_generate({"tokens": [65] * 101}, LIMITS)
    tok = fake_engine.ByteTokenizer()
    assert admission.prompt_tokens(g, tok) == [65] * 101
    with pytest.raises(TooLarge, match="101 prompt tokens"):
        admit(admission.prompt_tokens(g, tok), n_ctx=1000)


def test_prompt_tokens_of_text_and_chat():
    tok = fake_engine.ByteTokenizer()
    g = protocol.parse_generate({"prompt": "hi"}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [fake_engine.BOS, 104, 105]
    g = protocol.parse_generate({"prompt": "hi", "add_special": False}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [104, 105]
    g = protocol.parse_generate({"messages": [{"role": "user", "content": "x"}]}, LIMITS)
    ids = admission.prompt_tokens(g, tok)
    assert ids[:2] == [fake_engine.BOS, fake_engine.IM_START] and fake_engine.IM_END in ids
    g = protocol.parse_generate({"messages": [{"role": "robot", "content": "x"}]}, LIMITS)
    with pytest.raises(BadRequest, match="generate: chat template: .*unsupported role"):
        admission.prompt_tokens(g, tok)


# --- fill-in-the-middle: generate's suffix -------------------------------------------------------

def _fim_tokenizer() -> fake_engine.ByteTokenizer:
    tok = fake_engine.ByteTokenizer()
    tok.fim_ids = dict(fake_engine.FIM_IDS)
    return tok


def test_fim_prompt_is_prefix_suffix_middle_with_the_models_tokens():
    tok, fim = _fim_tokenizer(), fake_engine.FIM_IDS
    g = protocol.parse_generate({"prompt": "ab", "suffix": "c"}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [fake_engine.BOS, fim["pre"], 97, 98, fim["suf"], 99, fim["mid"]]
    # no BOS with add_special false; empty texts leave their part empty
    g = protocol.parse_generate({"prompt": "", "suffix": "", "add_special": False}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [fim["pre"], fim["suf"], fim["mid"]]
    # the texts are text: a special token's text in them stays bytes unless parse_special
    g = protocol.parse_generate({"prompt": "<s>", "suffix": "</s>"}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [fake_engine.BOS, fim["pre"], *b"<s>", fim["suf"], *b"</s>", fim["mid"]]
    g = protocol.parse_generate({"prompt": "<s>", "suffix": "</s>", "parse_special": True}, LIMITS)
    assert admission.prompt_tokens(g, tok) == [fake_engine.BOS, fim["pre"], fake_engine.BOS, fim["suf"],
                                               fake_engine.EOS, fim["mid"]]


def test_fim_prompt_is_held_to_the_prompt_limit_as_a_whole():
    """max_prompt_tokens (100) counts the assembled prompt: BOS and three FIM tokens beside the
    texts' 48 + 48 bytes is 100, one byte more is too large."""
    tok = _fim_tokenizer()
    g = protocol.parse_generate({"prompt": "p" * 48, "suffix": "s" * 48}, LIMITS)
    assert admit(admission.prompt_tokens(g, tok), 1, n_ctx=1000) == 1
    g = protocol.parse_generate({"prompt": "p" * 48, "suffix": "s" * 49}, LIMITS)
    with pytest.raises(TooLarge, match="101 prompt tokens, the limit is 100"):
        admit(admission.prompt_tokens(g, tok), n_ctx=1000)


def test_fim_without_the_models_fim_tokens_is_a_bad_request():
    tok = fake_engine.ByteTokenizer()  # fim_ids {}
    g = protocol.parse_generate({"prompt": "a", "suffix": "b"}, LIMITS)
    with pytest.raises(BadRequest, match="generate: suffix .*fill-in-the-middle.* this model has none"):
        admission.prompt_tokens(g, tok)
    tok.fim_ids = {"pre": 258, "suf": 259}  # one role missing is none as well
    with pytest.raises(BadRequest, match="this model has none"):
        admission.prompt_tokens(g, tok)


def _gateway_fim_before(tok, prefix: str, suffix: str) -> list[int]:
    """The prompt ktd-http assembled before generate took suffix: hello's fim ids and three
    ``tokenize`` calls (the daemon's tokenize: encode with add_special as given, parse_special
    false), [BOS] <fim_pre> prefix <fim_suf> suffix <fim_mid>."""
    fim = {"prefix": tok.fim_ids["pre"], "suffix": tok.fim_ids["suf"], "middle": tok.fim_ids["mid"]}
    bos = tok.encode("", add_special=True, parse_special=False)
    pre = tok.encode(prefix, add_special=False, parse_special=False) if prefix else []
    suf = tok.encode(suffix, add_special=False, parse_special=False) if suffix else []
    return [*bos, fim["prefix"], *pre, fim["suffix"], *suf, fim["middle"]]


@pytest.mark.realmodel
@pytest.mark.parametrize("prefix, suffix", [("def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"),
                                            ("", "x = 1\n"), ("import os\n", ""),
                                            ("s = '<|fim_suffix|>'  # ", " <|endoftext|>")])
def test_fim_prompt_of_qwen_coder_equals_the_gateways_and_the_documented_form(real_model, prefix, suffix):
    """Qwen2.5-Coder's FIM tokens (from its GGUF): the daemon's prompt equals, id for id, what the
    gateway built with three tokenize round trips, and Qwen's documented text form
    ``<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`` (texts without special-token texts)."""
    from ktd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(real_model("qwen2.5-coder-0.5b"))
    g = protocol.parse_generate({"prompt": prefix, "suffix": suffix}, LIMITS)
    got = admission.prompt_tokens(g, tok)
    assert got == _gateway_fim_before(tok, prefix, suffix)
    if "<|" not in prefix + suffix:
        text = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
        assert got == tok.encode(text, add_special=True, parse_special=True)
