"""``/v1/responses``: OpenAI's Responses API for plain text in and out.

The input (a string, or messages whose content is text) goes through the chat
template as a chat request would; ``instructions`` become a system message. Streamed,
the reply is OpenAI's event sequence (``response.created`` ... ``response.output_text
.delta`` ... ``response.completed``). ``text.format`` (``json_schema``, ``json_object``)
constrains the output as chat's ``response_format`` does. What needs server-side state
or tools (``previous_response_id``, ``store``, ``tools``, reasoning) is refused by name.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from triollm.outputs import RequestOutput
from triollm.request_ids import random_request_id
from triollm.server.errors import OpenAIError, bad_request, remember_request_id
from triollm.server.generation import Submitted, outputs
from triollm.server.protocol import ChatCompletionRequest, ResponsesRequest
from triollm.server.request import GenerationRequest, ReplyOptions, generation_request
from triollm.server.state import ChatRendering, server_state
from triollm.server.streaming import Emit, respond, run_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    state.require_generation()
    try:
        body.check_supported()
        constraint = body.structured_output()
        chat = ChatCompletionRequest(model=body.model, messages=body.messages(),
                                     max_completion_tokens=body.max_output_tokens,
                                     temperature=body.temperature, top_p=body.top_p,
                                     stream=body.stream)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise OpenAIError(400, f"input: not a conversation ({where}: {problem['msg']})",
                          param="input") from None
    except ValueError as error:
        raise bad_request(error) from error
    state.check_fields(body)
    token_ids = await state.render_chat_or_400(chat.messages, ChatRendering())
    try:
        params = chat.sampling_params(max_tokens=body.max_output_tokens, logprobs=None,
                                      defaults=state.engine.config.model.generation_defaults,
                                      structured=constraint)
    except ValueError as error:
        raise bad_request(error) from error
    response_id = remember_request_id(request, random_request_id("resp"))
    work = await generation_request(state, request, chat, [{"prompt_token_ids": token_ids}],
                              params, response_id,
                              ReplyOptions(model=model, created=int(time.time())),
                              constraint.field if constraint else None)
    text_format = (body.text or {}).get("format") or {"type": "text"}
    shape = _Shape(random_request_id("msg"), body.instructions, body.metadata or {},
                   body.max_output_tokens, text_format)
    return await respond(state.engine, work, functools.partial(_events, shape),
                         functools.partial(_reply, shape))


@dataclass(frozen=True)
class _Shape:
    """What a Responses reply repeats of its request, besides the generation request."""

    message_id: str
    instructions: str | None
    metadata: dict[str, str]
    max_output_tokens: int | None
    #: The request's ``text.format``, repeated in the reply's ``text``.
    text_format: dict[str, Any]

    def response(self, request: GenerationRequest, status: str, text: str,
                 prompt_tokens: int, output_tokens: int, finish_reason: str | None
                 ) -> dict[str, Any]:
        truncated = finish_reason == "length"
        if status == "completed" and truncated:
            status = "incomplete"
        return {
            "id": request.request_id, "object": "response",
            "created_at": request.reply.created, "model": request.reply.model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "error": None, "instructions": self.instructions, "metadata": self.metadata,
            "max_output_tokens": self.max_output_tokens,
            "temperature": request.params.temperature, "top_p": request.params.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": self.text_format}, "truncation": "disabled",
            "output": [] if status == "in_progress" else [self.message(status, text)],
            "usage": None if status == "in_progress" else {
                "input_tokens": prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def message(self, status: str, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "role": "assistant",
                "status": status, "content": [] if text is None else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reply(shape: _Shape, request: GenerationRequest, finals: list[RequestOutput]
           ) -> JSONResponse:
    [final] = finals
    [completion] = final.outputs
    return JSONResponse(shape.response(request, "completed", completion.text,
                                       len(final.prompt_token_ids), len(completion.token_ids),
                                       completion.finish_reason))


async def _events(shape: _Shape, request: GenerationRequest, submitted: list[Submitted],
                  emit: Emit) -> None:
    [item] = submitted
    prompt_tokens = len(item.first.prompt_token_ids)
    sequence = iter(range(1 << 62))

    async def event(kind: str, **fields: Any) -> None:
        await emit({"type": kind, "sequence_number": next(sequence), **fields})

    where = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    started = shape.response(request, "in_progress", "", prompt_tokens, 0, None)

    async def deltas() -> None:
        texts: list[str] = []
        tokens = 0
        finish_reason = None
        await event("response.created", response=started)
        await event("response.in_progress", response=started)
        await event("response.output_item.added", output_index=0,
                    item=shape.message("in_progress", None))
        await event("response.content_part.added", **where, part=_text_part(""))
        async for output in outputs(item):
            [completion] = output.outputs
            tokens += len(completion.token_ids)
            finish_reason = completion.finish_reason or finish_reason
            if completion.text:
                texts.append(completion.text)
                await event("response.output_text.delta", **where, delta=completion.text,
                            logprobs=[])
        text = "".join(texts)
        done = shape.response(request, "completed", text, prompt_tokens, tokens,
                              finish_reason)
        await event("response.output_text.done", **where, text=text, logprobs=[])
        await event("response.content_part.done", **where, part=_text_part(text))
        await event("response.output_item.done", output_index=0, item=done["output"][0])
        # as vLLM: "completed" ends every stream; a reply cut at max_output_tokens says
        # "incomplete" in its status
        await event("response.completed", response=done)

    await run_stream(emit, [deltas])
