"""What a tool parser produces (vLLM's class and field names, so a parser written for
vLLM ports by changing its imports)."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation",
           "FunctionCall", "ToolCall", "make_tool_call_id"]


def make_tool_call_id() -> str:
    """A fresh tool-call id in vLLM's shape (``chatcmpl-tool-<hex>``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    #: The arguments as JSON text.
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One fragment of a streamed tool call: the first fragment of call ``index``
    carries its ``id``, ``type`` and name; later ones carry argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What one streamed chunk adds to a message."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ExtractedToolCallInformation(BaseModel):
    """A whole output split into tool calls and the text around them."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None
