"""Chat answers read into reasoning, content and tool calls (vLLM's ``tool_choice``,
``--tool-call-parser`` and ``--reasoning-parser``), whole or while they stream."""

from triollm.server.chat_parsing.choice import ChoiceReader, ReadChoice
from triollm.server.chat_parsing.plan import (
    AUTO_NEEDS_PARSER,
    ChatParsing,
    chat_parsing,
    check_tool_flags,
)

__all__ = ["AUTO_NEEDS_PARSER", "ChatParsing", "ChoiceReader", "ReadChoice",
           "chat_parsing", "check_tool_flags"]
