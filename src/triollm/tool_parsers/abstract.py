"""The tool-parser interface and its registry (vLLM's ``ToolParser`` and
``ToolParserManager``): a parser turns a model's text into OpenAI tool calls, whole or
while it streams. Pure text work: no torch, no event loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from triollm.parser_registry import ParserRegistry, run_plugin_file
from triollm.tool_parsers.types import DeltaMessage, ExtractedToolCallInformation

__all__ = ["ToolParser", "ToolParserManager"]


class ToolParser:
    """Base class. ``tokenizer`` is the served model's Hugging Face tokenizer;
    ``request`` is the chat completion request (its ``tools`` and ``tool_choice``).

    A streaming parser keeps its state on the instance: one instance serves one choice
    of one request.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        #: Tool calls parsed so far while streaming, as dicts (name, arguments).
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        #: The argument text already streamed for each tool call.
        self.streamed_args_for_tool: list[str] = []

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.model_tokenizer.get_vocab())

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation where the format needs it (for example
        keep special tokens in the text). Returns the request."""
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """Split a whole output into tool calls and content."""
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """What the newest text adds: content, tool-call fragments, or None (nothing to
        send yet)."""
        raise NotImplementedError

    def finish_streaming(self, current_text: str, request: Any) -> DeltaMessage | None:
        """What the parser still holds when the output ends (``current_text`` is all of
        it): text kept back because it could have opened a tool call, a parameter that
        only the end of the text closes. The built-in parsers then have sent exactly what
        ``extract_tool_calls`` returns. None: nothing more."""
        return None


_Parser = TypeVar("_Parser", bound=type[ToolParser])
_REGISTRY = ParserRegistry("tool parser", ToolParser)


class ToolParserManager:
    """Parsers by name (``--tool-call-parser NAME``); ``--tool-parser-plugin FILE`` loads
    a file that registers more with ``register_module``."""

    tool_parsers: dict[str, type[ToolParser]] = _REGISTRY.parsers

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return _REGISTRY.get(name)

    @classmethod
    def register_module(cls, name: str | Sequence[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None
                        ) -> Callable[[_Parser], _Parser] | type[ToolParser]:
        """Register a parser class under ``name`` (or its class name), as a decorator or
        directly with ``module``."""
        register = _REGISTRY.register(name, force)
        return register if module is None else register(module)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path``, whose ``register_module`` calls add its
        parsers."""
        run_plugin_file(plugin_path)
