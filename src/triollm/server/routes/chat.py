"""``/v1/chat/completions``: messages through the chat template, ``n`` samples,
streamed or not."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triollm.entrypoints.chat_utils import normalize_messages
from triollm.outputs import RequestOutput
from triollm.server.chat_parsing import ChatParsing, ChoiceReader, chat_parsing
from triollm.server.errors import bad_request
from triollm.server.formatting import (
    chat_logprobs,
    prompt_logprobs,
    usage,
    usage_info,
    usage_options,
)
from triollm.server.generation import Submitted, outputs
from triollm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from triollm.server.protocol.structured import Constraint
from triollm.server.request import (
    GenerationRequest,
    ReplyOptions,
    generation_request,
    request_id_for,
)
from triollm.server.state import ChatRendering, server_state
from triollm.server.streaming import Emit, respond, run_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_request(body)
    try:
        plan = chat_parsing(
            body, state.engine.tokenizer, tool_parser=state.settings.tool_call_parser,
            enable_auto_tool_choice=state.settings.enable_auto_tool_choice,
            reasoning_parser=state.engine.config.structured_outputs.reasoning_parser)
    except ValueError as error:
        raise bad_request(error) from error
    if plan.tool_choice == "auto" and plan.tool_parser is not None:
        plan.tool_parser(plan.tokenizer).adjust_request(body)
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:  # as vLLM: the template reads it
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    token_ids = await state.render_chat_or_400(body.messages, ChatRendering(
        chat_template=body.chat_template, add_generation_prompt=body.generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens, tools=body.tools,
        documents=body.documents, chat_template_kwargs=template_kwargs))
    top = body.top_logprobs or 0
    try:
        constraint = body.structured_output(state.engine.config.structured_outputs.backend)
        params = body.sampling_params(
            max_tokens=body.max_completion_tokens or body.max_tokens,
            logprobs=top if body.logprobs else None,
            defaults=state.engine.config.model.generation_defaults, structured=constraint)
        if plan.constraint is not None:  # a required or named tool choice wins, as vLLM
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
    except ValueError as error:
        raise bad_request(error) from error
    include_usage, continuous_usage = usage_options(body)
    reply = ReplyOptions(
        model=model, created=int(time.time()), n=body.n,
        logprobs=top if body.logprobs else None, echoed_text=_echoed_text(body),
        prompt_logprobs=body.prompt_logprobs is not None,
        return_token_ids=body.return_token_ids, tokens_as_ids=state.tokens_as_ids(body),
        include_usage=include_usage, continuous_usage=continuous_usage)
    work = await generation_request(state, request, body, [{"prompt_token_ids": token_ids}], params,
                              request_id_for(request, body, "chatcmpl"), reply,
                              _constraint_field(plan, constraint))
    return await respond(state.engine, work, functools.partial(_events, plan),
                         functools.partial(_reply, plan))


def _constraint_field(plan: ChatParsing, constraint: Constraint | None) -> str | None:
    """The body field an engine's complaint about the output's constraint names: the
    tools' parameters for a required or named tool choice (which wins)."""
    if plan.constraint is not None:
        return "tools"
    return constraint.field if constraint else None


def _echoed_text(body: ChatCompletionRequest) -> str:
    """With ``echo``, as vLLM: the last message's text when it is the assistant's (the
    one ``continue_final_message`` continues), which the reply then starts with."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    [message] = normalize_messages([last.model_dump(exclude_none=True)], "string")
    return str(message["content"])


def _reply(plan: ChatParsing, request: GenerationRequest, finals: list[RequestOutput]
           ) -> JSONResponse:
    reply = request.reply
    [final] = finals
    choices = []
    for c in final.outputs:
        message = ChatMessageOut(content=reply.echoed_text + c.text)
        finish_reason = c.finish_reason
        if not plan.plain:
            read = ChoiceReader(plan, final.prompt_token_ids).read(c.text)
            message = ChatMessageOut(
                content=read.content if read.content is None
                else reply.echoed_text + read.content,
                reasoning=read.reasoning, reasoning_content=read.reasoning,
                tool_calls=read.tool_calls)
            if read.called and (plan.tool_choice == "auto" or finish_reason == "stop"):
                finish_reason = "tool_calls"
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(c, reply.logprobs, reply.tokens_as_ids)
            if reply.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if reply.return_token_ids else None))
    return JSONResponse(ChatCompletionResponse(
        id=request.request_id, created=reply.created, model=reply.model, choices=choices,
        usage=usage([final]), prompt_logprobs=prompt_logprobs(reply, final),
        prompt_token_ids=list(final.prompt_token_ids) if reply.return_token_ids
        else None).model_dump())


async def _events(plan: ChatParsing, request: GenerationRequest, submitted: list[Submitted],
                  emit: Emit) -> None:
    reply = request.reply
    [item] = submitted
    readers = None if plan.plain else [ChoiceReader(plan, item.first.prompt_token_ids)
                                       for _ in range(reply.n)]
    counts = {"prompt": len(item.first.prompt_token_ids), "completion": 0}

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
              prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
        if usage is None and reply.continuous_usage:
            usage = usage_info(counts["prompt"], counts["completion"])
        return ChatCompletionChunk(id=request.request_id, created=reply.created,
                                   model=reply.model, choices=choices, usage=usage,
                                   prompt_token_ids=prompt_token_ids
                                   ).model_dump(exclude_none=True)

    async def stream_choices() -> None:
        await emit(chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                        content=""))
                          for i in range(reply.n)],
                         prompt_token_ids=list(item.first.prompt_token_ids)
                         if reply.return_token_ids else None))
        if reply.echoed_text:
            await emit(chunk([ChatStreamChoice(index=i,
                                               delta=DeltaMessage(content=reply.echoed_text))
                              for i in range(reply.n)]))
        async for output in outputs(item):
            for completion in output.outputs:
                counts["completion"] += len(completion.token_ids)
                finish_reason = completion.finish_reason
                delta: DeltaMessage | None = DeltaMessage(content=completion.text)
                if readers is not None:
                    reader = readers[completion.index]
                    delta = reader.delta(completion.text, completion.token_ids)
                    if finish_reason is not None:
                        delta = _merged(delta, reader.finish())
                        if (reader.streamed_calls and plan.tool_choice != "named"
                                and finish_reason == "stop"):
                            finish_reason = "tool_calls"
                    if (delta is None and finish_reason is None and reply.logprobs is None
                            and not reply.return_token_ids):
                        continue  # nothing to send yet (a parser holds the text back)
                await emit(chunk([ChatStreamChoice(
                    index=completion.index, delta=delta or DeltaMessage(),
                    logprobs=chat_logprobs(completion, reply.logprobs, reply.tokens_as_ids)
                    if reply.logprobs is not None else None,
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                    token_ids=list(completion.token_ids) if reply.return_token_ids
                    else None)]))

    await run_stream(emit, [stream_choices])
    if reply.include_usage:
        await emit(chunk([], usage_info(counts["prompt"], counts["completion"])))
    await emit("[DONE]")


def _merged(delta: DeltaMessage | None, more: DeltaMessage | None) -> DeltaMessage | None:
    """``delta`` with the content and tool-call fragments of ``more`` after its own."""
    if more is None:
        return delta
    if delta is None:
        return more
    if more.content is not None:
        delta.content = (delta.content or "") + more.content
    if more.tool_calls:
        delta.tool_calls = [*(delta.tool_calls or []), *more.tool_calls]
    return delta
