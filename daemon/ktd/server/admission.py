"""Admission of a generate request: its prompt as tokens, checked once against the limits and
the model (docs/PROTOCOL.md, generate).

``parse_generate`` checks what the request says on its own (types, the configured bounds of
max_tokens, stop strings, messages); what needs the prompt's tokens or the model — prompt length,
token ids in the vocabulary, room in ``n_ctx`` — is checked here, in ``admit``, and nowhere else
in the daemon. The scheduler trusts an admitted job; the engine's own position check (native
``Context``: a position past ``n_ctx`` raises ``ContextOverflow``) stays as the KV cache's
memory-safety invariant, not as admission.
"""

from __future__ import annotations

from collections.abc import Sequence

from ktd.text.chat import RenderLimits
from ktd.server.engine_api import Tokenizer
from ktd.errors import BadRequest, ContextOverflow, TooLarge
from ktd.server.protocol import GenerateRequest, Limits, out_of_vocab
from ktd.text.tools import template_messages


def prompt_tokens(g: GenerateRequest, tok: Tokenizer, limits: Limits = Limits()) -> list[int]:
    """The prompt of ``g`` as token ids: given, rendered by the chat template (within the
    limits' chat_template bounds), or encoded text. Not checked (``admit`` does that). Runs in a
    worker thread: tokenizing can take a while."""
    if g.tokens is not None:
        return list(g.tokens)
    if g.messages is not None:
        # the template's markup becomes control tokens, the messages' content stays text
        try:
            # tools: given to the template unless tool_choice is none
            shown = g.tools is not None and g.tools.choice != "none"
            return tok.encode_chat(template_messages(g.messages), add_special=g.add_special,
                                   add_generation_prompt=True,
                                   limits=RenderLimits(limits.chat_template_max_chars,
                                                       limits.chat_template_timeout_s),
                                   tools=list(g.tools.tools) if shown else None)
        except ValueError as e:
            raise BadRequest(f"generate: chat template: {e}") from None
    assert g.prompt is not None
    if g.suffix is not None:
        return fim_prompt_tokens(g, tok)
    return tok.encode(g.prompt, add_special=g.add_special, parse_special=g.parse_special)


# The roles of the model's fill-in-the-middle tokens an infill prompt needs (Tokenizer.fim_ids).
FIM_ROLES = ("pre", "suf", "mid")


def fim_prompt_tokens(g: GenerateRequest, tok: Tokenizer) -> list[int]:
    """The fill-in-the-middle prompt of ``g``: [BOS] <fim_pre> prompt <fim_suf> suffix <fim_mid>
    (prefix-suffix-middle order, as llama.cpp's infill builds it), from the model's FIM tokens
    (GGUF tokenizer.ggml.fim_pre/suf/mid_token_id, else the vocabulary's <|fim_prefix|>-style
    tokens). BOS as ``add_special`` says; ``prompt`` and ``suffix`` tokenized as text unless
    ``parse_special``. BadRequest: the model has no FIM tokens."""
    fim = tok.fim_ids
    if not all(role in fim for role in FIM_ROLES):
        raise BadRequest("generate: suffix (fill-in-the-middle) needs the model's FIM tokens, and this model has "
                         "none (its GGUF metadata names no tokenizer.ggml.fim_pre/suf/mid_token_id and its "
                         "vocabulary has no <|fim_prefix|>-style tokens)")

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=g.parse_special) if s else []

    assert g.prompt is not None and g.suffix is not None
    return [*tok.encode("", add_special=g.add_special), fim["pre"], *text(g.prompt), fim["suf"], *text(g.suffix),
            fim["mid"]]


def admit(prompt: Sequence[int], max_tokens: int | None, *, n_vocab: int, n_ctx: int,
          limits: Limits) -> int:
    """The number of tokens to generate for ``prompt``: ``max_tokens`` when given, else as many as
    ``limits.max_tokens`` and the context allow. Raises the error the client sees: BadRequest
    (empty prompt, a token outside the vocabulary), TooLarge (more than
    ``limits.max_prompt_tokens``), ContextOverflow (no room in ``n_ctx``; data: prompt_tokens,
    n_ctx). Pure."""
    n = len(prompt)
    if not n:
        raise BadRequest("generate: the prompt is empty")
    if n > limits.max_prompt_tokens:
        raise TooLarge(f"generate: {n} prompt tokens, the limit is {limits.max_prompt_tokens}")
    bad = out_of_vocab(prompt, n_vocab)
    if bad is not None:
        raise BadRequest(f"generate: token {bad} is outside the vocabulary [0, {n_vocab})")
    if n >= n_ctx:
        raise ContextOverflow(f"generate: {n} prompt tokens leave no room in n_ctx {n_ctx}",
                              data={"prompt_tokens": n, "n_ctx": n_ctx})
    if max_tokens is None:
        return min(limits.max_tokens, n_ctx - n)
    if n + max_tokens > n_ctx:
        raise ContextOverflow(f"generate: {n} prompt tokens + max_tokens {max_tokens} exceed n_ctx {n_ctx}",
                              data={"prompt_tokens": n, "n_ctx": n_ctx})
    return max_tokens
