"""``/v1/completions``: one or several prompts, each with ``n`` samples, streamed or not."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triollm.engine.detokenizer import Tokenizer, decode_text
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
from triollm.server.generation import Submitted, outputs
from triollm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from triollm.server.request import (
    GenerationRequest,
    ReplyOptions,
    generation_request,
    request_id_for,
)
from triollm.server.state import server_state
from triollm.server.streaming import Emit, respond, run_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_request(body)
    prompts = _prompts_of(body.prompt)
    try:
        constraint = body.structured_output(state.engine.config.structured_outputs.backend)
        params = body.sampling_params(
            max_tokens=body.max_tokens, logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None
            else None, defaults=state.engine.config.model.generation_defaults,
            structured=constraint)
    except ValueError as error:
        raise bad_request(error) from error
    include_usage, continuous_usage = usage_options(body)
    reply = ReplyOptions(
        model=model, created=int(time.time()), n=body.n, logprobs=body.logprobs,
        echo=body.echo, prompt_logprobs=body.prompt_logprobs is not None,
        return_token_ids=body.return_token_ids, tokens_as_ids=state.tokens_as_ids(body),
        include_usage=include_usage, continuous_usage=continuous_usage)
    work = await generation_request(state, request, body, prompts, params,
                              request_id_for(request, body, "cmpl"), reply,
                              constraint.field if constraint else None)
    tokenizer = state.engine.tokenizer
    return await respond(state.engine, work, functools.partial(_events, tokenizer),
                         functools.partial(_reply, tokenizer))


def _prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(cast(list[int], prompt))}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(cast(list[int], p))}
            for p in prompt]


def _ids(reply: ReplyOptions, tokens: Sequence[int]) -> list[int] | None:
    """Token ids for vLLM's ``return_token_ids`` fields, when the request asked."""
    return list(tokens) if reply.return_token_ids else None


def _reply(tokenizer: Tokenizer, request: GenerationRequest,
           finals: list[RequestOutput]) -> JSONResponse:
    reply = request.reply
    choices = []
    for prompt_index, output in enumerate(finals):
        for completion in output.outputs:
            text = completion.text
            prompt_text = output.prompt or decode_text(tokenizer, output.prompt_token_ids)
            logprobs = None
            if reply.logprobs is not None:
                echoed = None
                if reply.echo:
                    echoed = (output.prompt_token_ids, list(output.prompt_logprobs or []))
                logprobs = completion_logprobs(completion, 0, echoed, tokenizer,
                                               reply.tokens_as_ids)
            if reply.echo:
                text = prompt_text + text
            choices.append(CompletionChoice(
                index=prompt_index * reply.n + completion.index, text=text,
                logprobs=logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                prompt_logprobs=prompt_logprobs(reply, output),
                prompt_token_ids=_ids(reply, output.prompt_token_ids),
                token_ids=_ids(reply, completion.token_ids)))
    return JSONResponse(CompletionResponse(
        id=request.request_id, created=reply.created, model=reply.model, choices=choices,
        usage=usage(finals)).model_dump())


async def _events(tokenizer: Tokenizer, request: GenerationRequest,
                  submitted: list[Submitted], emit: Emit) -> None:
    reply = request.reply
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
                index = item.index * reply.n + completion.index
                text = completion.text
                # Each choice's first event carries the prompt, and with logprobs the
                # prompt tokens' log-probabilities, as in the non-streaming reply.
                echo_prompt = index not in offsets  # the choice's first event
                echo = reply.echo and echo_prompt
                if echo:
                    text = (output.prompt
                            or decode_text(tokenizer, output.prompt_token_ids)) + text
                completion_tokens += len(completion.token_ids)
                logprobs = None
                if reply.logprobs is not None:
                    echoed = ((output.prompt_token_ids, list(output.prompt_logprobs or []))
                              if echo else None)
                    logprobs = completion_logprobs(completion, offsets.get(index, 0),
                                                   echoed, tokenizer, reply.tokens_as_ids)
                offsets[index] = offsets.get(index, 0) + len(text)
                event: dict[str, Any] = {
                    "id": request.request_id, "object": "text_completion",
                    "created": reply.created, "model": reply.model,
                    "choices": [CompletionChoice(
                        index=index, text=text, logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_token_ids=_ids(reply, output.prompt_token_ids)
                        if echo_prompt else None,
                        token_ids=_ids(reply, completion.token_ids)).model_dump()]}
                if reply.continuous_usage:
                    event["usage"] = usage_info(prompt_tokens, completion_tokens).model_dump()
                await emit(event)
            first = False

    await run_stream(emit, [functools.partial(one_prompt, item) for item in submitted])
    if reply.include_usage:
        await emit({"id": request.request_id, "object": "text_completion",
                    "created": reply.created, "model": reply.model, "choices": [],
                    "usage": usage_info(prompt_tokens, completion_tokens).model_dump()})
    await emit("[DONE]")
