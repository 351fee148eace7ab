"""``POST /v1/chat/completions``: the request, the reply and the streamed chunks."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from triollm.request_ids import random_request_id
from triollm.server.protocol.base import (
    ChatMessage,
    ChatTemplateFields,
    PromptLogprobs,
    UsageInfo,
)
from triollm.server.protocol.sampling import SamplingRequest

__all__ = ["ChatChoice", "ChatCompletionChunk", "ChatCompletionRequest",
           "ChatCompletionResponse", "ChatLogprobs", "ChatMessageOut", "ChatStreamChoice",
           "ChatTokenLogprob", "DeltaMessage", "TopLogprob"]


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_special_tokens: bool = False
    echo: bool = False
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        # As vLLM: tools without a tool_choice mean "auto". This server has no tool-call
        # parser (vLLM's --enable-auto-tool-choice) and no structured output, so only
        # "none" is served; the tools still reach the chat template.
        if self.tools == []:
            raise ValueError("tools: must not be an empty list (omit the field instead)")
        choice = self.tool_choice
        if choice is None and self.tools:
            choice = "auto"
        if choice is not None and choice != "none":
            if not self.tools:
                raise ValueError("tool_choice: given without tools")
            shown = choice if isinstance(choice, str) else "a named tool"
            raise ValueError(f"tool_choice: {shown!r} is not supported (this server has no "
                             f"tool-call parser); send tool_choice 'none' or no tools")

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_request_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
