"""Tool-call parsers: a model's text to OpenAI ``tool_calls``, whole or streamed."""

from triollm.tool_parsers.abstract import ToolParser, ToolParserManager
from triollm.tool_parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation",
           "FunctionCall", "ToolCall", "ToolParser", "ToolParserManager"]
