"""``POST /v1/responses``: the text subset of OpenAI's Responses API request (the reply
is written by the route, as plain dicts)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from triollm.server.protocol.base import ChatMessage, CheckedRequest
from triollm.server.protocol.structured import Constraint, text_format_constraint

__all__ = ["ResponsesRequest"]


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
            raise ValueError("tools: not supported on /v1/responses; /v1/chat/completions "
                             "serves tool calls")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: not supported on /v1/responses; "
                             "/v1/chat/completions serves tool calls")
        if self.reasoning:
            raise ValueError("reasoning: not supported on /v1/responses; "
                             "/v1/chat/completions splits reasoning (--reasoning-parser)")

    def structured_output(self) -> Constraint | None:
        """The constraint ``text.format`` asks for (None: free text); ``ValueError``
        naming the field."""
        return text_format_constraint(self.text)

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
