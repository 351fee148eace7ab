"""The tool calls of a ``tool_choice: "required"`` answer while it streams.

The answer is constrained to a JSON array of ``{"name": ..., "parameters": {...}}``
objects (``triollm.tool_parsers.tool_choice``). ``RequiredCallStream`` reads it one
character at a time, never twice: a call's name is sent once its string is complete,
then the raw text of its ``parameters`` object in fragments, so the fragments of one
call join into its arguments' JSON text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from triollm.tool_parsers.types import DeltaFunctionCall, DeltaToolCall, make_tool_call_id

__all__ = ["RequiredCallStream"]

_ARGUMENT_KEYS = ("parameters", "arguments")


@dataclass
class _Call:
    name: str | None = None
    arguments: str = ""
    #: How much of ``arguments`` has been sent.
    sent: int = 0
    announced: bool = False


class RequiredCallStream:
    """Feeds on the answer's text and returns what each new piece adds to the calls."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = False
        self._key: str | None = None
        #: The raw text of the string being read, when it is a key or a name.
        self._collecting: list[str] | None = None
        self._collecting_name = False
        #: The depth at which the arguments being captured close (0: not capturing).
        self._capture_depth = 0

    def feed(self, text: str) -> list[DeltaToolCall]:
        """Read ``text`` (the answer's next characters); the tool-call fragments it
        completes, at most one per call."""
        for char in text:
            self._read(char)
        return self._pending()

    def _read(self, char: str) -> None:
        if self._capture_depth:
            self.calls[-1].arguments += char
        if self._in_string:
            self._read_in_string(char)
            return
        if char == '"':
            self._in_string = True
            if self._depth == 2 and not self._capture_depth:
                if self._expect_key:
                    self._collecting, self._collecting_name = [], False
                elif self._key == "name":
                    self._collecting, self._collecting_name = [], True
        elif char in "{[":
            self._depth += 1
            if self._depth == 2 and char == "{":
                self.calls.append(_Call())
                self._expect_key, self._key = True, None
            elif (self._depth == 3 and not self._capture_depth and not self._expect_key
                  and self._key in _ARGUMENT_KEYS and self.calls):
                self._capture_depth = 3
                self.calls[-1].arguments = char
        elif char in "}]":
            if self._capture_depth == self._depth:
                self._capture_depth = 0
            self._depth -= 1
        elif self._depth == 2 and not self._capture_depth:
            if char == ":":
                self._expect_key = False
            elif char == ",":
                self._expect_key, self._key = True, None

    def _read_in_string(self, char: str) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            if self._collecting is not None:
                text = json.loads('"' + "".join(self._collecting) + '"')
                if self._collecting_name and self.calls:
                    self.calls[-1].name = text
                else:
                    self._key = text
                self._collecting = None
            return
        if self._collecting is not None:
            self._collecting.append(char)

    def _pending(self) -> list[DeltaToolCall]:
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            fragment = call.arguments[call.sent:]
            call.sent = len(call.arguments)
            if not call.announced:
                call.announced = True
                deltas.append(DeltaToolCall(
                    index=index, id=make_tool_call_id(), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=fragment)))
            elif fragment:
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=fragment)))
        return deltas
