"""Prompts in, token ids out: parse vLLM's prompt forms and reject bad ones early.

A prompt is a string, a list of token ids, ``{"prompt": str}`` (TextPrompt) or
``{"prompt_token_ids": [...]}`` (TokensPrompt). With ``truncate_to`` (the request's
``truncate_prompt_tokens``) only the prompt's last tokens are kept, as in vLLM. Empty
prompts, prompts that still leave no room to generate within ``max_model_len`` and
token ids outside the vocabulary are refused with a ``ValueError`` before anything
reaches the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from triollm.engine.detokenizer import Tokenizer
from triollm.sampling_params import check_text

__all__ = ["ProcessedPrompt", "PromptType", "TextPrompt", "TokensPrompt", "bad_words_token_ids",
           "process_prompt"]


class TextPrompt(TypedDict):
    prompt: str
    #: Only requests with the same salt share prefix-cache blocks (vLLM's field).
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
    #: Segment ids for a cross-encoder's text pair (BERT's), one per token.
    token_type_ids: NotRequired[list[int]]


PromptType = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    token_type_ids: list[int] | None = None


def process_prompt(prompt: object, tokenizer: Tokenizer | None, *, max_model_len: int,
                   vocab_size: int, truncate_to: int | None = None,
                   generating: bool = True) -> ProcessedPrompt:
    """Parse and check one prompt. A prompt to generate from must leave room for a token
    within ``max_model_len``; one to pool (``generating=False``) may fill it."""
    text: str | None
    if isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str | bytes | bytearray):
                raise ValueError("prompt_token_ids: must be a list of token ids")
            if text is not None and not isinstance(text, str):
                raise ValueError("prompt: the 'prompt' field must be a string")
            token_ids = list(ids)
        elif "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError("prompt: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        text, token_ids = None, list(prompt)
    else:
        raise ValueError(f"prompt: expected a string, token ids or a prompt dict, got "
                         f"{type(prompt).__name__}")
    if token_ids is None:
        if not isinstance(text, str):
            raise ValueError("prompt: the 'prompt' field must be a string")
        if not text:
            raise ValueError("prompt: must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this engine has no tokenizer; give prompt_token_ids")
        check_text("prompt", text)
        token_ids = tokenizer.encode(text)
    if not token_ids:
        raise ValueError("prompt: must contain at least one token")
    token_type_ids = _token_type_ids(prompt, len(token_ids))
    if truncate_to is not None and len(token_ids) > truncate_to:
        # The text no longer matches the tokens; outputs then carry only the tokens.
        text, token_ids = None, token_ids[-truncate_to:]
        if token_type_ids is not None:
            token_type_ids = token_type_ids[-truncate_to:]
    for token in token_ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(f"prompt_token_ids: {token!r} is not a token id of this model "
                             f"(vocabulary size {vocab_size})")
    if generating and len(token_ids) >= max_model_len:
        raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                         f"max_model_len={max_model_len}")
    if not generating and len(token_ids) > max_model_len:
        raise ValueError(f"prompt: {len(token_ids)} tokens are more than this model takes "
                         f"(max_model_len={max_model_len}); shorten it or set "
                         f"truncate_prompt_tokens")
    cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt: must be a non-empty string")
    if cache_salt is not None:
        check_text("cache_salt", cache_salt)
    return ProcessedPrompt(text=text, token_ids=token_ids, cache_salt=cache_salt,
                           token_type_ids=token_type_ids)


def _token_type_ids(prompt: object, num_tokens: int) -> list[int] | None:
    if not isinstance(prompt, Mapping) or prompt.get("token_type_ids") is None:
        return None
    ids = prompt["token_type_ids"]
    if (not isinstance(ids, Sequence) or isinstance(ids, str | bytes | bytearray)
            or len(ids) != num_tokens
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ValueError("token_type_ids: must be one non-negative integer per prompt token")
    return list(ids)


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each bad word as token ids, as vLLM tokenizes them: the word itself and, when it
    tokenizes differently, the word after a space (how it appears mid-sentence)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        # vLLM keeps the spaced form only when it is the same length with another first
        # token, i.e. the space merged into the word's first token.
        if spaced and bare and len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences
