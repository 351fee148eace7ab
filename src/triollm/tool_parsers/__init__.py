"""Tool-call parsers: a model's text to OpenAI ``tool_calls``, whole or streamed.
Importing the package registers the built-in parsers under vLLM's names."""

# The built-in parsers register themselves.
from triollm.tool_parsers import (  # noqa: F401
    hermes,
    llama3_json,
    mistral,
    pythonic,
    qwen3_coder,
)
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
