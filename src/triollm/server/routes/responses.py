"""``/v1/responses``: OpenAI's Responses API for plain text in and out.

The input (a string, or messages whose content is text) goes through the chat
template as a chat request would; ``instructions`` become a system message. Streamed,
the reply is OpenAI's event sequence (``response.created`` ... ``response.output_text
.delta`` ... ``response.completed``). What needs server-side state or tools
(``previous_response_id``, ``store``, ``tools``, reasoning) is refused by name.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from triollm.outputs import RequestOutput
from triollm.server.errors import OpenAIError, bad_request, remember_request_id
from triollm.server.generation import EngineStream, Submitted, outputs, trace_headers
from triollm.server.protocol import ChatCompletionRequest, ChatMessage, CheckedRequest, random_id
from triollm.server.state import ChatRendering, server_state
from triollm.server.streaming import Emit, StreamWriter, respond, run_stream

__all__ = ["ResponsesRequest", "router"]

router = APIRouter()


class ResponsesRequest(CheckedRequest):
    """The text subset of ``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        if self.store:
            raise ValueError("store: this server does not store responses")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server does not store responses")
        if self.tools:
            raise ValueError("tools: this server has no tool-call parser")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: this server has no tool-call parser")
        if self.reasoning:
            raise ValueError("reasoning: this server has no reasoning parser")
        kind = ((self.text or {}).get("format") or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"text.format: type {kind!r} is not supported (no structured "
                             f"output); only 'text' is")

    def messages(self) -> list[ChatMessage]:
        """The input as chat messages (``instructions`` first, as a system message)."""
        messages = []
        if self.instructions is not None:
            messages.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
            return messages
        for index, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind != "message" or "role" not in item:
                raise ValueError(f"input[{index}].type: {kind!r} items are not supported; "
                                 f"send messages with text content")
            messages.append(ChatMessage(role=item["role"], content=item.get("content")))
        return messages


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    state.require_generation()
    try:
        body.check_supported()
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
    token_ids = state.render_chat_or_400(chat.messages, ChatRendering())
    try:
        params = chat.sampling_params(max_tokens=body.max_output_tokens, logprobs=None,
                                      defaults=state.engine.config.model.generation_defaults)
    except ValueError as error:
        raise bad_request(error) from error
    response_id = remember_request_id(request, random_id("resp"))
    message_id = random_id("msg")
    created = int(time.time())

    def response(status: str, text: str, prompt_tokens: int, output_tokens: int,
                 finish_reason: str | None) -> dict[str, Any]:
        truncated = finish_reason == "length"
        if status == "completed" and truncated:
            status = "incomplete"
        return {
            "id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "error": None, "instructions": body.instructions, "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "output": [] if status == "in_progress" else [message(status, text)],
            "usage": None if status == "in_progress" else {
                "input_tokens": prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def message(status: str, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": message_id, "role": "assistant", "status": status,
                "content": [] if text is None else [text_part(text)]}

    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def build(finals: list[RequestOutput]) -> JSONResponse:
        [final] = finals
        [completion] = final.outputs
        return JSONResponse(response("completed", completion.text,
                                     len(final.prompt_token_ids), len(completion.token_ids),
                                     completion.finish_reason))

    def stream(submitted: list[Submitted], opened: list[EngineStream]) -> StreamWriter:
        [item] = submitted
        prompt_tokens = len(item.first.prompt_token_ids)

        async def write(emit: Emit) -> None:
            sequence = iter(range(1 << 62))

            async def event(kind: str, **fields: Any) -> None:
                await emit({"type": kind, "sequence_number": next(sequence), **fields})

            where = {"item_id": message_id, "output_index": 0, "content_index": 0}

            async def deltas() -> None:
                texts: list[str] = []
                tokens = 0
                finish_reason = None
                await event("response.created",
                            response=response("in_progress", "", prompt_tokens, 0, None))
                await event("response.in_progress",
                            response=response("in_progress", "", prompt_tokens, 0, None))
                await event("response.output_item.added", output_index=0,
                            item=message("in_progress", None))
                await event("response.content_part.added", **where, part=text_part(""))
                async for output in outputs(item):
                    [completion] = output.outputs
                    tokens += len(completion.token_ids)
                    finish_reason = completion.finish_reason or finish_reason
                    if completion.text:
                        texts.append(completion.text)
                        await event("response.output_text.delta", **where,
                                    delta=completion.text, logprobs=[])
                text = "".join(texts)
                done = response("completed", text, prompt_tokens, tokens, finish_reason)
                await event("response.output_text.done", **where, text=text, logprobs=[])
                await event("response.content_part.done", **where, part=text_part(text))
                await event("response.output_item.done", output_index=0,
                            item=done["output"][0])
                # as vLLM: "completed" ends every stream; a reply cut at
                # max_output_tokens says "incomplete" in its status
                await event("response.completed", response=done)

            await run_stream(opened, emit, [deltas])

        return write

    return await respond(state, [{"prompt_token_ids": token_ids}], params, response_id, chat,
                         stream, build, trace_headers(request))
