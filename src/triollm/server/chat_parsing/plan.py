"""How one chat request's answers are read: which ``tool_choice`` applies, with which
tool-call and reasoning parsers, and the constraint a required or named tool choice
puts on the output (as vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triollm.reasoning import ReasoningParser, ReasoningParserManager
from triollm.server.protocol import ChatCompletionRequest
from triollm.structured_output.params import StructuredOutputsParams
from triollm.tool_parsers import ToolParser, ToolParserManager
from triollm.tool_parsers.tool_choice import tool_choice_schema, validate_tools

__all__ = ["AUTO_NEEDS_PARSER", "ChatParsing", "chat_parsing", "check_tool_flags"]

#: vLLM's message for ``tool_choice: "auto"`` on a server without a tool-call parser.
AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     '--tool-call-parser to be set')


@dataclass(frozen=True)
class ChatParsing:
    """What is read out of each choice's text: the reasoning (``reasoning_parser``), then
    tool calls by ``tool_choice``: ``none`` (text only), ``auto`` (``tool_parser`` finds
    them), ``required`` (a JSON array of calls) or ``named`` (the text is the arguments
    of ``named``)."""

    request: ChatCompletionRequest
    tokenizer: Any
    tool_choice: str = "none"
    named: str | None = None
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    #: The output's constraint: required and named tool choices (None: none added).
    constraint: StructuredOutputsParams | None = None

    @property
    def plain(self) -> bool:
        """Nothing to read: the text is the content."""
        return self.tool_choice == "none" and self.reasoning_parser is None

    @property
    def include_reasoning(self) -> bool:
        return self.request.include_reasoning

    @property
    def parallel_tool_calls(self) -> bool:
        return self.request.parallel_tool_calls is not False


def chat_parsing(body: ChatCompletionRequest, tokenizer: Any, *, tool_parser: str | None,
                 enable_auto_tool_choice: bool, reasoning_parser: str | None) -> ChatParsing:
    """The reading of ``body``'s answers on a server with these settings. Raises
    ``ValueError`` naming the field for a malformed tool, and ``tool_choice`` for
    ``auto`` without a tool-call parser, as vLLM does."""
    choice = body.effective_tool_choice
    if choice not in ("required", "named"):  # those check the tools building their schema
        validate_tools(body.tools)  # as vLLM's request model: each a function with a name
    reasoning = (ReasoningParserManager.get_reasoning_parser(reasoning_parser)
                 if reasoning_parser else None)
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_parser):
            raise ValueError(f"tool_choice: {AUTO_NEEDS_PARSER}")
        return ChatParsing(body, tokenizer, "auto",
                           tool_parser=ToolParserManager.get_tool_parser(tool_parser),
                           reasoning_parser=reasoning)
    if choice in ("required", "named"):
        schema = tool_choice_schema(body.tools, body.tool_choice, body.parallel_tool_calls)
        named = body.named_tool()
        if schema is None:
            raise ValueError(f"tool_choice: {body.tool_choice!r} constrains nothing")
        return ChatParsing(body, tokenizer, choice,
                           named=named.get("name") if named is not None else None,
                           reasoning_parser=reasoning,
                           constraint=StructuredOutputsParams(json=schema))
    return ChatParsing(body, tokenizer, reasoning_parser=reasoning)


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """Raise ``ValueError`` for a tool-call parser that is not registered, or
    --enable-auto-tool-choice without one (as vLLM)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if tool_call_parser:
        try:
            ToolParserManager.get_tool_parser(tool_call_parser)
        except KeyError as error:
            raise ValueError(f"--tool-call-parser: {error.args[0]}") from None
