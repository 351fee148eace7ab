"""tool_choice "required" and named functions as JSON schemas (vLLM's shapes), the tool
calls their constrained outputs stand for, the tools' checks, and parser plugins."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.tool_parsers import ToolParserManager
from triollm.tool_parsers.constrained import NamedToolCallParser, RequiredToolCallParser
from triollm.tool_parsers.tool_choice import (
    tool_calls_from_output,
    tool_choice_schema,
    validate_tools,
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
            "where": {"$ref": "#/$defs/Place"}},
            "required": ["city"], "$defs": {"Place": {"type": "object", "properties": {
                "lat": {"type": "number"}}}}}}},
    {"type": "function", "function": {"name": "now"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_required_is_a_list_of_named_calls_with_their_parameters() -> None:
    schema = tool_choice_schema(TOOLS, "required")
    assert schema is not None
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert schema["$defs"] == TOOLS[0]["function"]["parameters"]["$defs"]
    assert "$defs" in TOOLS[0]["function"]["parameters"], "the request's tools stay as sent"
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "where": {"lat": 59.9}}},
            {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "c"}}],
                [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "x", "where": {"lat": "n"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    assert single is not None and single["maxItems"] == 1


def test_a_named_function_is_its_parameters() -> None:
    assert tool_choice_schema(TOOLS, NAMED) == TOOLS[0]["function"]["parameters"]
    assert tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "now"}}) == {
        "type": "object", "properties": {}}
    for choice in ("none", "auto", None):
        assert tool_choice_schema(TOOLS, choice) is None


DEEP: Any = {}
for _ in range(70):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ([{"type": "function", "function": {"name": ""}}], "auto", r"tools\[0\]\.function\.name"),
    ([TOOLS[1], {"type": "function", "function": {"name": 3}}], "auto",
     r"tools\[1\]\.function\.name"),
    ([TOOLS[1], TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "auto", r"tools\[2\]\.function\.parameters: expected a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": DEEP}}}}],
     "auto", r"tools\[0\]\.function\.parameters: nests objects and arrays more than 128"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\]\.type"),
    ([{"type": "function"}], "auto", r"tools\[0\]\.function: expected an object"),
    ({"type": "function"}, "auto", r"^tools: expected a list"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}},
     r"tool_choice\.function\.name: 'missing' is not one of the tools"),
    (TOOLS, "sometimes", r"^tool_choice: expected"),
    ([], "required", r"^tool_choice: .* needs tools"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"$defs": {"X": {}}}}},
      {"type": "function", "function": {"name": "b", "parameters": {
          "$defs": {"X": {"type": "string"}}}}}],
     "required", r"tools\[1\]\.function\.parameters\.\$defs\.X"),
])
def test_bad_tools_are_refused_naming_the_field(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tool_choice_schema(tools, choice)


def test_pydantic_tools_are_read_like_dicts() -> None:
    from pydantic import BaseModel

    class Function(BaseModel):
        name: str
        parameters: dict[str, Any] | None = None

    class Tool(BaseModel):
        type: str = "function"
        function: Function

    assert validate_tools([Tool(function=Function(name="f"))]) == [
        {"type": "function", "function": {"name": "f"}}]


def test_constrained_outputs_become_tool_calls() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
            '{"name": "now", "parameters": {}}]')
    calls = tool_calls_from_output(text, "required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich"}), ("now", {})]
    named = tool_calls_from_output('{"city": "Oslo"}', NAMED)
    assert [(c.function.name, c.function.arguments) for c in named] == [
        ("get_weather", '{"city": "Oslo"}')]
    # Cut by max_tokens: a named call keeps what was written; a list gives no calls.
    assert tool_calls_from_output('{"city": "Os', NAMED)[0].function.arguments == '{"city": "Os'
    assert tool_calls_from_output('[{"name": "now", "param', "required") == []


def _stream(parser: Any, text: str, cuts: list[int]) -> list[tuple[str, str]]:
    names: list[str] = []
    arguments: list[str] = []
    previous = ""
    for end in [*sorted(cuts), len(text)]:
        current = text[:max(end, len(previous))]
        deltas = [parser.extract_tool_calls_streaming(
            previous, current, current[len(previous):], [], [], [], None)]
        previous = current
        if end == len(text):
            deltas.append(parser.finish_streaming(text, None))
        for delta in deltas:
            for call in delta.tool_calls if delta else []:
                if call.index == len(names):
                    names.append(call.function.name)
                    arguments.append("")
                else:
                    arguments[call.index] += call.function.arguments
    return list(zip(names, arguments, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "now"]), st.dictionaries(
    st.text(max_size=4), st.integers() | st.text(max_size=5), max_size=3)), min_size=1,
    max_size=3), st.lists(st.integers(0, 200), max_size=15))
def test_constrained_outputs_stream_as_they_parse_whole(calls: list[tuple[str, dict[str, Any]]],
                                                        cuts: list[int]) -> None:
    text = json.dumps([{"name": name, "parameters": args} for name, args in calls])
    streamed = _stream(RequiredToolCallParser(None), text, cuts)
    assert [(name, json.loads(args)) for name, args in streamed] == calls
    whole = RequiredToolCallParser(None).extract_tool_calls(text, None).tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == calls
    arguments = json.dumps(calls[0][1])
    assert _stream(NamedToolCallParser(None, "get_weather"), arguments, cuts) == [
        ("get_weather", arguments)]


PLUGIN = '''
from triollm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from triollm.tool_parsers import ExtractedToolCallInformation


@ToolParserManager.register_module("{name}")
class EchoParser(ToolParser):
    def extract_tool_calls(self, model_output, request):
        return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                            content=model_output.upper())
'''


def test_a_plugin_file_registers_its_parser(tmp_path: Path) -> None:
    path = tmp_path / "my_tool_parser.py"
    path.write_text(textwrap.dedent(PLUGIN.format(name="echo_test")))
    ToolParserManager.import_tool_parser(str(path))
    try:
        parser = ToolParserManager.get_tool_parser("echo_test")(None)
        assert parser.extract_tool_calls("hi", None).content == "HI"
    finally:
        ToolParserManager.tool_parsers.pop("echo_test", None)
    with pytest.raises(KeyError, match="echo_test"):
        ToolParserManager.get_tool_parser("echo_test")


def test_the_built_in_parsers_are_registered_under_vllms_names() -> None:
    from triollm.reasoning import ReasoningParserManager

    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"} <= set(
        ToolParserManager.tool_parsers)
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.reasoning_parsers)
