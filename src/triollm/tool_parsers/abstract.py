"""The tool-parser interface and its registry (vLLM's ``ToolParser`` and
``ToolParserManager``): a parser turns a model's text into OpenAI tool calls, whole or
while it streams. Pure text work: no torch, no event loop."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

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


class ToolParserManager:
    """Parsers by name (``--tool-call-parser NAME``); ``--tool-parser-plugin FILE`` loads
    a file that registers more with ``register_module``."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            known = ", ".join(sorted(cls.tool_parsers))
            raise KeyError(f"tool parser {name!r} is not registered (known: {known})") from None

    @classmethod
    def register_module(cls, name: str | Sequence[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None
                        ) -> Callable[[_Parser], _Parser] | type[ToolParser]:
        """Register a parser class under ``name`` (or its class name), as a decorator or
        directly with ``module``."""

        def register(parser: _Parser) -> _Parser:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"{parser!r} is not a ToolParser subclass")
            names = [parser.__name__] if name is None else (
                [name] if isinstance(name, str) else list(name))
            for each in names:
                if not force and each in cls.tool_parsers:
                    raise KeyError(f"tool parser {each!r} is already registered")
                cls.tool_parsers[each] = parser
            return parser

        if module is not None:
            return register(module)
        return register

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path``, whose ``register_module`` calls add its
        parsers."""
        path = Path(plugin_path)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin: cannot load {plugin_path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
