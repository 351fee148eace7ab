"""Submitting an API request's prompts to the engine and collecting their outputs.

Before anything reaches the engine, each prompt is tokenized here and checked against
the limits (docs/serving.md): the context (prompt plus ``max_tokens``) and the number of
logprob entries the reply would carry. Every prompt then enters the engine and yields
its first output before a response starts, so bad input is a 400 and a dead engine a
503, never a broken stream. The engine gets ids of the server's own (the client's id,
or a fresh one, plus a random suffix): two clients that send the same ``X-Request-Id``
never meet inside the engine. The caller owns the engine streams (``opened``) and
closes them with ``close_all``, which aborts whatever is unfinished.
"""

from __future__ import annotations

import secrets
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Protocol, cast

import anyio
from fastapi import Request
from fastapi.responses import Response

from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.engine.tracing import trace_headers_from
from triollm.errors import EngineClosedError, EngineError
from triollm.outputs import RequestOutput
from triollm.sampling_params import SamplingParams, check_text
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
    raise_first_answer,
    remember_request_id,
)
from triollm.server.protocol import ChatCompletionRequest, CompletionRequest, random_id
from triollm.server.state import ServerState

__all__ = ["EngineStream", "Submitted", "check_limits", "close_all", "engine_request_id",
           "final_outputs",
           "first_output", "logprob_entries", "outputs", "reply", "request_id_for",
           "submit", "tokenized"]

#: Replies with more logprob entries than this are built and encoded in a worker
#: thread (a megabyte of JSON or so takes the loop tens of milliseconds).
OFF_LOOP_ENTRIES = 20_000

EngineStream = AsyncGenerator[RequestOutput, None]


@dataclass
class Submitted:
    """One engine request (one prompt of an API request) and its first output."""

    index: int
    stream: EngineStream
    first: RequestOutput


class _NamesItsId(Protocol):
    request_id: str | None


def request_id_for(request: Request, body: _NamesItsId, prefix: str) -> str:
    """The client's id (body, then ``X-Request-Id``), or a fresh one."""
    return remember_request_id(request, body.request_id or request.headers.get("x-request-id")
                               or random_id(prefix))


def trace_headers(request: Request) -> dict[str, str] | None:
    """The W3C trace context the client sent (``traceparent``, ``tracestate``), for the
    engine to parent the request's span with."""
    return trace_headers_from(request.headers)


def engine_request_id(request_id: str) -> str:
    """The id the engine knows a request by: the client's, made unique."""
    return f"{request_id}-{secrets.token_hex(6)}"


def tokenized(state: ServerState, prompt: PromptType, cache_salt: str | None,
              add_special_tokens: bool = True) -> TokensPrompt:
    """A prompt as token ids (its text kept), so its length can be checked here;
    ``add_special_tokens`` as vLLM's completions field (the tokenizer's BOS, for most)."""
    if isinstance(prompt, str):
        try:
            check_text("prompt", prompt)
        except ValueError as error:
            raise bad_request(error) from error
        if not prompt:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        ready = TokensPrompt(prompt_token_ids=state.engine.tokenizer.encode(
            prompt, add_special_tokens=add_special_tokens), prompt=prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ready = TokensPrompt(prompt_token_ids=list(cast(TokensPrompt, prompt)["prompt_token_ids"]))
    else:
        raise OpenAIError(400, "prompt: expected a string or token ids", param="prompt")
    if cache_salt is not None:
        ready["cache_salt"] = cache_salt
    return ready


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


async def submit(state: ServerState, prompts: Sequence[PromptType], params: SamplingParams,
                 request_id: str, body: CompletionRequest | ChatCompletionRequest,
                 opened: list[EngineStream],
                 trace: Mapping[str, str] | None = None) -> list[Submitted]:
    """Check every prompt against the limits, add them all to the engine at once and wait
    for each one's first output, so that bad input is a 400 before any response starts.
    Streams are appended to ``opened`` (the caller closes them, which aborts whatever is
    unfinished)."""
    if state.shutting_down:
        raise engine_unavailable(EngineClosedError("shutting down"))
    special = body.add_special_tokens if isinstance(body, CompletionRequest) else True
    ready = [tokenized(state, prompt, body.cache_salt, special) for prompt in prompts]
    for prompt in ready:
        check_limits(state, prompt, params)
    base_id = engine_request_id(request_id)
    streams = [state.engine.generate(
        prompt, params, base_id if len(ready) == 1 else f"{base_id}-{index}",
        priority=body.priority, is_latency_sensitive=body.latency_sensitive, slo=body.slo,
        ttft_slo=body.ttft_slo, lora_request=state.lora_for(body.model), trace_headers=trace)
        for index, prompt in enumerate(ready)]
    opened.extend(streams)
    if len(streams) == 1:
        return [Submitted(0, streams[0], await first_output(streams[0]))]
    submitted: list[Submitted | None] = [None] * len(streams)

    async def start(index: int) -> None:
        submitted[index] = Submitted(index, streams[index], await first_output(streams[index]))

    await for_each_prompt(len(streams), start)
    return [item for item in submitted if item is not None]


async def for_each_prompt(count: int,
                          one: Callable[[int], Coroutine[object, object, None]]) -> None:
    """``one(0) ... one(count - 1)`` concurrently, one task per prompt of a request; if
    any fails, the first error that is an answer for the client answers
    (``raise_first_answer``)."""
    try:
        async with anyio.create_task_group() as tasks:
            for index in range(count):
                tasks.start_soon(one, index)
    except BaseExceptionGroup as group:
        raise_first_answer(group)


async def first_output(stream: EngineStream) -> RequestOutput:
    """A new request's first output: adding it raises bad input as a 400, a dead or
    closed engine as a 503."""
    try:
        return await anext(stream)
    except ValueError as error:
        raise bad_request(error) from error
    except EngineError as error:
        raise engine_unavailable(error) from error
    except StopAsyncIteration:
        raise engine_unavailable(EngineClosedError("ended early")) from None


async def outputs(item: Submitted) -> AsyncIterator[RequestOutput]:
    """Every output of one submitted prompt, its first included."""
    yield item.first
    if not item.first.finished:
        async for output in item.stream:
            yield output


async def close_all(streams: list[EngineStream]) -> None:
    """Close engine streams (aborting what is unfinished), even inside a cancelled scope."""
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()


async def final_outputs(submitted: list[Submitted]) -> list[RequestOutput]:
    """Each prompt's last output, in prompt order (the prompts run concurrently)."""
    finals: list[RequestOutput | None] = [None] * len(submitted)

    async def drain(item: Submitted) -> None:
        async for output in outputs(item):
            finals[item.index] = output

    try:
        async with anyio.create_task_group() as tasks:
            for item in submitted:
                tasks.start_soon(drain, item)
    except BaseExceptionGroup as group:
        # The request failed, or the engine died or shut down under it: as before it
        # started (500 or 503).
        stopped, _ = group.split(EngineError)
        if stopped is None or len(stopped.exceptions) != len(group.exceptions):
            raise
        raise engine_unavailable(stopped.exceptions[0]) from group
    return [f for f in finals if f is not None]


async def reply(build: Callable[[], Response], finals: Sequence[RequestOutput]) -> Response:
    """Build and encode a non-streaming reply: one that carries many logprob entries in
    a worker thread, so the event loop never stalls on it."""
    entries = sum(len(position) for o in finals for c in o.outputs
                  for position in c.logprobs or ())
    entries += sum(len(position or ()) * len(o.outputs) for o in finals
                   for position in o.prompt_logprobs or ())
    if entries <= OFF_LOOP_ENTRIES:
        return build()
    return await anyio.to_thread.run_sync(build)
