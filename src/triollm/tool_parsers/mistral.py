"""``mistral``: Mistral and Mixtral instruct models, Mistral Small/Large/NeMo. Older
tokenizers write ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``; v11 and
later ``[TOOL_CALLS]name[ARGS]{...}``, once per call. Tool-call ids are 9 letters and
digits, as Mistral's chat templates require."""

from __future__ import annotations

import secrets
import string
from typing import Any

from triollm.tool_parsers.abstract import ToolParserManager
from triollm.tool_parsers.incremental import CallScan, IncrementalToolParser, Scan, join_content
from triollm.tool_parsers.json_calls import CallList, decode_json, scan_call_list, skip_space

__all__ = ["MistralToolParser", "mistral_tool_call_id"]

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_BAD_NAME = set(" \t\r\n{}[]\"'<>")


def mistral_tool_call_id() -> str:
    """A tool-call id Mistral's templates accept: 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _named_calls(text: str, pos: int, final: bool) -> CallList:
    found = CallList()
    while True:
        arguments_at = text.find(ARGS, pos)
        if arguments_at == -1:
            found.calls.append(CallScan())
            found.malformed = final
            return found
        name = text[pos:arguments_at].strip()
        if not name or _BAD_NAME & set(name):
            found.malformed = True
            return found
        start = skip_space(text, arguments_at + len(ARGS))
        decoded = decode_json(text, start)
        if decoded is None:
            partial = text[start:] if text.startswith(("{", "["), start) else ""
            found.calls.append(CallScan(name, partial))
            found.malformed = final
            return found
        value, end = decoded
        if not isinstance(value, dict | list):
            found.malformed = True
            return found
        found.calls.append(CallScan(name, text[start:end], True))
        after = skip_space(text, end)
        if not text.startswith(BOT, after):
            found.tail = end
            return found
        pos = after + len(BOT)


@ToolParserManager.register_module("mistral")
class MistralToolParser(IncrementalToolParser):
    """Calls after ``[TOOL_CALLS]``; the text before it, and after the calls, is
    content."""

    keep_special_tokens = True

    def new_call_id(self) -> str:
        return mistral_tool_call_id()

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        first = text.find(BOT)
        if first == -1:
            return Scan(join_content([], text, any_call=False, final=final, tags=(BOT,)))
        before = [text[:first]]
        pos = skip_space(text, first + len(BOT))
        if pos == len(text):
            return Scan(join_content(before, "", any_call=True, final=final, tags=()),
                        malformed=final)
        if text[pos] == "[":
            found = scan_call_list(text, pos, final, self.memo.reads_of(text, request))
        else:
            found = _named_calls(text, pos, final)
        tail = "" if found.tail is None else text[found.tail:]
        content = join_content(before, tail, any_call=True, final=final, tags=(BOT,))
        return Scan(content, found.calls, found.malformed)
