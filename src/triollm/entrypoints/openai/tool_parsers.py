"""vLLM's import path for tool parsers, so a ``--tool-parser-plugin`` file written for
vLLM (``from vllm.entrypoints.openai.tool_parsers import ToolParser,
ToolParserManager``) runs with only the package name changed."""

from triollm.tool_parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
    ToolParserManager,
)

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation",
           "FunctionCall", "ToolCall", "ToolParser", "ToolParserManager"]
