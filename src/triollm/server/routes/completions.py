"""``/v1/completions``: one or several prompts, each with ``n`` samples, streamed or not."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triollm.engine.detokenizer import decode_text
from triollm.engine.inputs import PromptType
from triollm.outputs import RequestOutput
from triollm.server.errors import OpenAIError, bad_request
from triollm.server.formatting import (
    completion_logprobs,
    prompt_logprobs,
    usage,
    usage_info,
    usage_options,
)
from triollm.server.generation import (
    EngineStream,
    Submitted,
    outputs,
    request_id_for,
    trace_headers,
)
from triollm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from triollm.server.state import ServerState, server_state
from triollm.server.streaming import Emit, StreamWriter, respond, run_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_request(body)
    tokenizer = state.engine.tokenizer
    prompts = _prompts_of(body.prompt)
    try:
        params = body.sampling_params(
            max_tokens=body.max_tokens, logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None
            else None, defaults=state.engine.config.model.generation_defaults)
    except ValueError as error:
        raise bad_request(error) from error
    request_id = request_id_for(request, body, "cmpl")
    created = int(time.time())
    as_token_ids = state.tokens_as_ids(body)

    def build(finals: list[RequestOutput]) -> JSONResponse:
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                text = completion.text
                prompt_text = output.prompt or decode_text(tokenizer, output.prompt_token_ids)
                logprobs = None
                if body.logprobs is not None:
                    echoed = None
                    if body.echo:
                        echoed = (output.prompt_token_ids, list(output.prompt_logprobs or []))
                    logprobs = completion_logprobs(completion, 0, echoed, tokenizer,
                                                   as_token_ids)
                if body.echo:
                    text = prompt_text + text
                choices.append(CompletionChoice(
                    index=prompt_index * body.n + completion.index, text=text,
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=prompt_logprobs(body, output),
                    prompt_token_ids=_ids(body, output.prompt_token_ids),
                    token_ids=_ids(body, completion.token_ids)))
        return JSONResponse(CompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=usage(finals)).model_dump())

    def stream(submitted: list[Submitted], opened: list[EngineStream]) -> StreamWriter:
        return _stream_writer(state, body, submitted, opened, request_id, created, model,
                              as_token_ids)

    return await respond(state, prompts, params, request_id, body, stream, build,
                         trace_headers(request))


def _prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(cast(list[int], prompt))}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(cast(list[int], p))}
            for p in prompt]


def _ids(body: CompletionRequest, tokens: Sequence[int]) -> list[int] | None:
    """Token ids for vLLM's ``return_token_ids`` fields, when the request asked."""
    return list(tokens) if body.return_token_ids else None


def _stream_writer(state: ServerState, body: CompletionRequest, submitted: list[Submitted],
                   opened: list[EngineStream], request_id: str, created: int,
                   model: str, as_token_ids: bool) -> StreamWriter:
    include_usage, continuous_usage = usage_options(body)
    tokenizer = state.engine.tokenizer

    async def write(emit: Emit) -> None:
        prompt_tokens = 0
        completion_tokens = 0
        offsets: dict[int, int] = {}

        async def one_prompt(item: Submitted) -> None:
            nonlocal prompt_tokens, completion_tokens
            first = True
            async for output in outputs(item):
                if first:
                    prompt_tokens += len(output.prompt_token_ids)
                for completion in output.outputs:
                    index = item.index * body.n + completion.index
                    text = completion.text
                    # Each choice's first event carries the prompt, and with logprobs
                    # the prompt tokens' log-probabilities, as in the non-streaming reply.
                    echo_prompt = index not in offsets  # the choice's first event
                    echo = body.echo and echo_prompt
                    if echo:
                        text = (output.prompt
                                or decode_text(tokenizer, output.prompt_token_ids)) + text
                    completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if body.logprobs is not None:
                        echoed = ((output.prompt_token_ids, list(output.prompt_logprobs or []))
                                  if echo else None)
                        logprobs = completion_logprobs(completion, offsets.get(index, 0),
                                                       echoed, tokenizer, as_token_ids)
                    offsets[index] = offsets.get(index, 0) + len(text)
                    event: dict[str, Any] = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": model,
                        "choices": [CompletionChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                            prompt_token_ids=_ids(body, output.prompt_token_ids)
                            if echo_prompt else None,
                            token_ids=_ids(body, completion.token_ids)).model_dump()]}
                    if continuous_usage:
                        event["usage"] = usage_info(prompt_tokens, completion_tokens
                                                    ).model_dump()
                    await emit(event)
                first = False

        await run_stream(opened, emit,
                         [functools.partial(one_prompt, item) for item in submitted])
        if include_usage:
            await emit({"id": request_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [],
                        "usage": usage_info(prompt_tokens, completion_tokens).model_dump()})
        await emit("[DONE]")

    return write
