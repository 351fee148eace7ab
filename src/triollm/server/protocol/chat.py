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
from triollm.tool_parsers.types import DeltaToolCall, ToolCall

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
    #: vLLM's field: false leaves the reasoning (under --reasoning-parser) out of the reply.
    include_reasoning: bool = True
    #: Passed to the chat template as ``reasoning_effort``, as vLLM does (its values).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.tools == []:
            raise ValueError("tools: must not be an empty list (omit the field instead)")
        self.named_tool()  # a named tool_choice is well formed and names one of the tools
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                             f"{choice!r}")
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: when using `tool_choice`, `tools` must be set")

    @property
    def effective_tool_choice(self) -> str:
        """``none``, ``auto``, ``required`` or ``named``; as in vLLM, tools without a
        tool_choice mean ``auto`` and no tools mean ``none``."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return choice if isinstance(choice, str) else "named"

    def named_tool(self) -> dict[str, Any] | None:
        """The tool a named ``tool_choice`` picks (its ``function`` object), or None for
        a string choice. Raises ``ValueError`` for a malformed one or a name not in
        ``tools``."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: a named tool choice is {'type': 'function', "
                             "'function': {'name': NAME}}")
        for tool in self.tools or []:
            described = tool.get("function")
            if isinstance(described, dict) and described.get("name") == name:
                return described
        raise ValueError(f"tool_choice: tool {name!r} has not been passed in `tools`")


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
    #: The reasoning under --reasoning-parser, under both of vLLM's names.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
