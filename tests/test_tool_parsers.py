"""The tool-call parsers on recorded model texts, whole and streamed: the same calls and
content either way, however the text is cut, and never an exception on any text."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triollm.tool_parsers import DeltaMessage, ToolParser, ToolParserManager

SPECIAL = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
           "<think>", "</think>"]

WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "threshold": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "options": {"type": "object"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}}}}},
]


class Request:
    """The fields of a chat request a parser reads."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = WEATHER_TOOLS if tools is None else tools
        self.tool_choice = "auto"
        self.skip_special_tokens = True


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(SPECIAL)
    return tok


def make(name: str, tok: Any) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(tok)


def whole(name: str, tok: Any, text: str) -> tuple[list[tuple[str, Any]], str | None]:
    info = make(name, tok).extract_tool_calls(text, Request())
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert info.tools_called == bool(calls)
    return calls, info.content


def stream_chunks(name: str, tok: Any, chunks: list[str]) -> tuple[list[tuple[str, str]], str]:
    """Feed ``chunks`` as the serving layer would, then the end of the output; check
    the shape of every delta (name first with id and type, then argument text)."""
    p = make(name, tok)
    request = Request()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content = ""
    previous = ""

    def take(delta: DeltaMessage | None) -> None:
        nonlocal content
        if delta is None:
            return
        content += delta.content or ""
        for call in delta.tool_calls:
            function = call.function
            assert function is not None
            if call.index not in names:
                assert call.index == len(names), "calls open in order"
                assert call.id and call.type == "function" and function.name
                assert not function.arguments
                names[call.index] = function.name
                arguments[call.index] = ""
            else:
                assert call.id is None and function.name is None
                arguments[call.index] += function.arguments or ""

    for chunk in chunks:
        current = previous + chunk
        ids = tok.encode(current, add_special_tokens=False)
        take(p.extract_tool_calls_streaming(previous, current, chunk, [], ids, [], request))
        previous = current
    take(p.finish_streaming(previous, request))
    return [(names[i], arguments[i]) for i in sorted(names)], content


def parsed(streamed: tuple[list[tuple[str, str]], str]) -> tuple[list[tuple[str, Any]], str]:
    return [(name, json.loads(arguments)) for name, arguments in streamed[0]], streamed[1]


def by_tokens(tok: Any, text: str) -> list[str]:
    """``text`` cut at its token boundaries (whole characters only, as detokenized)."""
    chunks, previous, pending = [], "", []
    for token in tok.encode(text, add_special_tokens=False):
        pending.append(token)
        piece = tok.decode(pending)
        if "\ufffd" in piece:
            continue
        chunks.append(piece)
        previous += piece
        pending = []
    assert previous == text
    return chunks


def check(name: str, tok: Any, text: str, calls: list[tuple[str, Any]],
          content: str | None, *, malformed: bool = False) -> None:
    """Whole, ``text`` gives ``calls`` and ``content``; streamed by tokens or by
    characters, the same (a malformed call may have streamed before it broke: then
    streaming need only not raise)."""
    assert whole(name, tok, text) == (calls, content)
    expected = (calls, content or "") if calls else ([], text)
    for chunks in (by_tokens(tok, text), list(text)):
        streamed = stream_chunks(name, tok, chunks)
        if not malformed:
            assert parsed(streamed) == expected


WEATHER = ("get_weather", {"city": "San Francisco", "days": 3})
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}'
     '\n</tool_call>', [WEATHER], None),
    ("I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"東京\", \"options\": {\"units\": [\"c\", {\"deep\": null}]}}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a \\\"quoted\\\" }\"}}"
     "\n</tool_call>",
     [("get_weather", {"city": "東京", "options": {"units": ["c", {"deep": None}]}}),
      ("search", {"query": 'a "quoted" }'})], "I'll check both.\n"),
    # Arguments as a JSON string, and no end tag before the end of the output.
    ('<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}',
     [("search", {"query": "x"})], None),
    ("The weather is sunny.", [], "The weather is sunny."),
    ("Use <tool_call> tags", [], "Use <tool_call> tags"),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"query": "cut by max_tok',
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
]


@pytest.mark.parametrize(("text", "calls", "content"), HERMES)
def test_hermes_recorded_outputs(tool_tokenizer: Any, text: str, calls: list[Any],
                                 content: str | None) -> None:
    check("hermes", tool_tokenizer, text, calls, content)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_calls_stay_content(tool_tokenizer: Any, text: str) -> None:
    check("hermes", tool_tokenizer, text, [], text, malformed=True)


def test_hermes_keeps_special_tokens_in_the_text(tool_tokenizer: Any) -> None:
    request = make("hermes", tool_tokenizer).adjust_request(Request())
    assert request.skip_special_tokens is False


PARSERS = sorted(["hermes"])


PIECES = [*'{}[]":,;()=<>/ \nab1', *SPECIAL, "<function=", "<parameter=", "</parameter>",
          "</function>", '"name"', '"arguments"', '{"name": "search", "arguments": ']


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PARSERS), st.lists(st.sampled_from(PIECES), max_size=40),
       st.lists(st.integers(1, 8), max_size=30))
def test_no_text_makes_a_parser_raise(name: str, pieces: list[str], sizes: list[int]) -> None:
    tok, text = _TOKENIZER[0], "".join(pieces)
    make(name, tok).extract_tool_calls(text, Request())
    p, previous, pos = make(name, tok), "", 0
    for size in [*sizes, len(text)]:
        current = text[:pos + size]
        p.extract_tool_calls_streaming(previous, current, current[len(previous):], [], [], [],
                                       Request())
        previous, pos = current, pos + size
    p.finish_streaming(text, Request())


_TOKENIZER: list[Any] = []


@pytest.fixture(autouse=True, scope="module")
def _share_tokenizer(tool_tokenizer: Any) -> None:
    _TOKENIZER[:] = [tool_tokenizer]
