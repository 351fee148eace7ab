"""``triollm serve``'s tool-calling flags, as vLLM spells them: ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--tool-parser-plugin`` and the older ``--enable-reasoning``
(``--reasoning-parser`` is an engine flag)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_tool_arguments", "tool_options"]

logger = logging.getLogger(__name__)


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the tool-calling flags to ``triollm serve``, in their own group."""
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                       default=False, help='read tool calls out of answers for tool_choice '
                       '"auto" (needs --tool-call-parser)')
    tools.add_argument("--tool-call-parser", default=None,
                       help="hermes, llama3_json, mistral, pythonic, qwen3_coder, ... or one "
                            "a --tool-parser-plugin registers")
    tools.add_argument("--tool-parser-plugin", default=None,
                       help="a Python file that registers more tool parsers")
    tools.add_argument("--enable-reasoning", action=argparse.BooleanOptionalAction,
                       default=False, help=argparse.SUPPRESS)


def tool_options(namespace: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerOptions`` fields of the tool-calling flags, after running the plugin
    file; ``ValueError`` naming the flag for a parser that is not registered, a plugin
    that cannot be loaded, or a flag missing the one it needs."""
    from triollm.server.chat_parsing import check_tool_flags
    from triollm.tool_parsers import ToolParserManager

    if namespace.tool_parser_plugin:
        try:
            ToolParserManager.import_tool_parser(namespace.tool_parser_plugin)
        except (OSError, ValueError) as error:
            raise ValueError(f"--tool-parser-plugin: {error}") from None
    check_tool_flags(namespace.enable_auto_tool_choice, namespace.tool_call_parser)
    if namespace.enable_reasoning:
        if not getattr(namespace, "reasoning_parser", None):
            raise ValueError("--enable-reasoning requires --reasoning-parser")
        logger.warning("--enable-reasoning is deprecated: reasoning is split whenever "
                       "--reasoning-parser is given")
    return {"enable_auto_tool_choice": namespace.enable_auto_tool_choice,
            "tool_call_parser": namespace.tool_call_parser}
