"""One API request as the server handles it: the body turned, once, at the route.

``GenerationRequest`` carries what the engine needs (the prompts as token ids with their
text, the sampling parameters, the ids, priority and SLO, the LoRA adapter, the trace
context) and what the reply needs (``ReplyOptions``); submitting, streaming and
formatting read it and nothing else of the body. ``generation_request`` builds it and
makes the checks that need no engine step: each prompt tokenized and held to the limits
(docs/serving.md): the context (prompt plus ``max_tokens``) and the number of logprob
entries the reply would carry. ``EncodeRequest`` is the same for the pooling routes.
Every id comes from ``triollm.request_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from fastapi import Request

from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.engine.tracing import trace_headers_from
from triollm.pooling_params import PoolingParams
from triollm.request_ids import engine_request_id, random_request_id
from triollm.sampling_params import SamplingParams, check_text
from triollm.server.access_log import TokenCounts, token_counts
from triollm.server.client_budget import note_engine_work
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    remember_request_id,
)
from triollm.server.protocol import CompletionRequest, PoolingFields, SamplingRequest

if TYPE_CHECKING:
    from triollm.lora.request import LoRARequest
    from triollm.server.state import ServerState

__all__ = ["EncodeRequest", "GenerationRequest", "ReplyOptions", "check_limits", "check_sizes",
           "encode_request", "generation_request", "logprob_entries", "request_id_for",
           "tokenized"]


@dataclass(frozen=True)
class ReplyOptions:
    """How the reply is written, besides the engine's outputs."""

    #: The model name the reply is under (the served model's or a LoRA adapter's).
    model: str
    created: int
    #: Samples per prompt (a choice's index is ``prompt index * n + sample index``).
    n: int = 1
    #: Log-probabilities per token with this many alternatives; None: none.
    logprobs: int | None = None
    #: Completions: the prompt starts each choice's text.
    echo: bool = False
    #: Chat with ``echo``: the continued assistant message, which the reply starts with.
    echoed_text: str = ""
    #: vLLM's ``prompt_logprobs`` field is filled in.
    prompt_logprobs: bool = False
    #: vLLM's ``return_token_ids``: the prompt's and each choice's token ids.
    return_token_ids: bool = False
    #: Logprob tokens as ``token_id:N``.
    tokens_as_ids: bool = False
    #: A stream ends with a usage event; with ``continuous_usage``, every event has one.
    include_usage: bool = False
    continuous_usage: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One API request's prompts, parameters and ids, as the engine and the reply need
    them."""

    #: The id the client sees (replies, logs, traces).
    request_id: str
    #: Each prompt's id inside the engine (``triollm.request_ids.engine_request_id``).
    engine_ids: tuple[str, ...]
    prompts: tuple[TokensPrompt, ...]
    params: SamplingParams
    stream: bool
    reply: ReplyOptions
    priority: int = 0
    is_latency_sensitive: bool = False
    slo: float | None = None
    ttft_slo: float | None = None
    lora_request: LoRARequest | None = None
    trace_headers: Mapping[str, str] | None = None
    #: The body field of the output's constraint, as the client wrote it (the engine's
    #: complaint about the constraint names it); None: no constraint.
    constraint_field: str | None = None
    #: Its tokens, counted as its outputs pass (the access log's line reads them).
    tokens: TokenCounts = field(default_factory=TokenCounts, compare=False)


@dataclass(frozen=True)
class EncodeRequest:
    """One pooling API request's prompts, parameters and ids, as the engine needs them."""

    request_id: str
    engine_ids: tuple[str, ...]
    prompts: tuple[PromptType, ...]
    params: PoolingParams
    priority: int = 0
    trace_headers: Mapping[str, str] | None = None
    #: Its prompts' tokens, counted as they finish (the access log's line reads them).
    tokens: TokenCounts = field(default_factory=TokenCounts, compare=False)


class _NamesItsId(Protocol):
    request_id: str | None


def request_id_for(request: Request, body: _NamesItsId, prefix: str) -> str:
    """The client's id (body, then ``X-Request-Id``), or a fresh one."""
    return remember_request_id(request, body.request_id or request.headers.get("x-request-id")
                               or random_request_id(prefix))


async def generation_request(state: ServerState, request: Request, body: SamplingRequest,
                             prompts: Sequence[PromptType], params: SamplingParams,
                             request_id: str, reply: ReplyOptions,
                             constraint_field: str | None = None) -> GenerationRequest:
    """The request ``body`` makes of ``prompts``: each tokenized (in a worker thread)
    and checked against the limits (400s naming the field); a 503 while the server
    shuts down. ``constraint_field`` names the body field of ``params``' structured
    output."""
    state.require_accepting()
    check_sizes(state, params)
    special = body.add_special_tokens if isinstance(body, CompletionRequest) else True
    ready = tuple([await tokenized(state, prompt, body.cache_salt, special,
                                   params.truncate_prompt_tokens) for prompt in prompts])
    for prompt in ready:
        check_limits(state, prompt, params)
    note_engine_work(request.scope)
    return GenerationRequest(
        request_id=request_id, engine_ids=tuple(engine_request_id(request_id) for _ in ready),
        prompts=ready, params=params, stream=body.stream, reply=reply,
        priority=body.priority, is_latency_sensitive=body.latency_sensitive, slo=body.slo,
        ttft_slo=body.ttft_slo, lora_request=state.lora_for(body.model),
        trace_headers=trace_headers_from(request.headers),
        constraint_field=constraint_field, tokens=token_counts(request.scope))


def encode_request(state: ServerState, request: Request, body: PoolingFields,
                   prompts: Sequence[PromptType], params: PoolingParams, request_id: str
                   ) -> EncodeRequest:
    """The pooling request ``body`` makes of ``prompts``; a 503 while the server shuts
    down."""
    state.require_accepting()
    note_engine_work(request.scope)
    return EncodeRequest(
        request_id=request_id, engine_ids=tuple(engine_request_id(request_id) for _ in prompts),
        prompts=tuple(prompts), params=params, priority=body.priority,
        trace_headers=trace_headers_from(request.headers), tokens=token_counts(request.scope))


async def tokenized(state: ServerState, prompt: PromptType, cache_salt: str | None,
                    add_special_tokens: bool = True, truncate_to: int | None = None
                    ) -> TokensPrompt:
    """A prompt as token ids (its text kept; tokenized in a worker thread), so its
    length can be checked here; ``add_special_tokens`` as vLLM's completions field (the
    tokenizer's BOS, for most). A long text is cut to the tokens the engine can use
    (``ServerState.encode``), with ``truncate_to`` as the request's
    ``truncate_prompt_tokens``."""
    if isinstance(prompt, str):
        try:
            check_text("prompt", prompt)
        except ValueError as error:
            raise bad_request(error) from error
        if not prompt:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        ready = TokensPrompt(prompt_token_ids=await state.encode(
            prompt, add_special_tokens, truncate_to=truncate_to), prompt=prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ready = TokensPrompt(prompt_token_ids=list(cast(TokensPrompt, prompt)["prompt_token_ids"]))
    else:
        raise OpenAIError(400, "prompt: expected a string or token ids", param="prompt")
    if cache_salt is not None:
        ready["cache_salt"] = cache_salt
    return ready


def check_sizes(state: ServerState, params: SamplingParams) -> None:
    """Refuse token-id lists longer than the vocabulary (400 naming the field): the
    engine checks and uses each entry on the event loop."""
    vocab = int(state.engine.config.model.hf_config.vocab_size)
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        size = len(getattr(params, name) or ())
        if size > vocab:
            raise OpenAIError(400, f"{name}: {size} entries; this model's vocabulary has "
                                   f"{vocab} tokens", param=name)


def logprob_entries(params: SamplingParams, prompt_len: int, max_new: int) -> int:
    """How many (token, logprob) entries a reply can carry: every sampled position and,
    for prompt logprobs (per choice, as echo repeats them), every prompt position."""
    entries = 0
    if params.logprobs is not None:
        entries += params.n * max_new * (params.logprobs + 1)
    if params.prompt_logprobs is not None:
        entries += params.n * prompt_len * (params.prompt_logprobs + 1)
    return entries


def check_limits(state: ServerState, prompt: TokensPrompt, params: SamplingParams) -> None:
    """Refuse a prompt that, with its ``max_tokens``, exceeds the context, or a reply
    that would carry more logprob entries than the server allows (400s naming the
    field)."""
    max_model_len = state.engine.config.model.max_model_len
    prompt_len = len(prompt["prompt_token_ids"])
    if params.truncate_prompt_tokens is not None:
        prompt_len = min(prompt_len, params.truncate_prompt_tokens)
    if prompt_len >= max_model_len:
        raise OpenAIError(400, f"prompt: {prompt_len} tokens leave no room to generate "
                               f"within this model's maximum context length of "
                               f"{max_model_len} tokens", param="prompt")
    if params.max_tokens is not None and prompt_len + params.max_tokens > max_model_len:
        raise OpenAIError(
            400, f"max_tokens: this model's maximum context length is {max_model_len} "
                 f"tokens; the request asks for {prompt_len + params.max_tokens} "
                 f"({prompt_len} in the prompt, {params.max_tokens} in the completion). "
                 f"Reduce the prompt or max_tokens.", param="max_tokens")
    max_new = (params.max_tokens if params.max_tokens is not None
               else max(max_model_len - prompt_len, 0))
    entries = logprob_entries(params, prompt_len, max_new)
    limit = state.settings.max_logprob_entries
    if entries > limit:
        raise OpenAIError(
            400, f"logprobs: the reply could carry {entries} logprob entries (n x tokens x "
                 f"(logprobs + 1), prompt tokens included); this server allows {limit}. "
                 f"Ask for fewer choices, tokens or logprobs.", param="logprobs")
