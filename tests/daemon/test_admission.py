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
