"""``tools`` and ``tool_choice`` as a grammar: the JSON schema that constrains the output
for ``tool_choice`` ``"required"`` or a named function (vLLM's shapes), and the tool
calls that constrained output stands for. Checks the request's tools on the way, with
errors that name the field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from triollm.structured_output.params import check_json_depth
from triollm.tool_parsers.constrained import NamedToolCallParser, RequiredToolCallParser
from triollm.tool_parsers.types import FunctionCall, ToolCall

__all__ = ["named_tool", "tool_calls_from_output", "tool_choice_schema", "validate_tools"]

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _plain(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def validate_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The request's ``tools`` as plain dicts, each checked: a ``"function"`` with a
    non-empty string name and parameters that are a JSON schema object. ValueError
    naming the field (``tools[2].function.name: ...``)."""
    if tools is None:
        return []
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ValueError("tools: expected a list of tools")
    checked = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        tool = _plain(tool)
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}: expected an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported, got "
                             f"{tool.get('type')!r}")
        function = _plain(tool.get("function"))
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function: expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.function.name: expected a non-empty string, got "
                             f"{name!r}")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_schema(parameters, f"{where}.function.parameters")
        checked.append({"type": "function", "function": dict(function)})
    return checked


def _check_schema(schema: Any, where: str) -> None:
    # Not a full JSON Schema meta-validation (vLLM makes none either): that is pure
    # Python, seconds for a schema of a few thousand properties, on the event loop. A
    # required or named tool choice compiles the parameters, which refuses a bad schema.
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: expected a JSON schema object, got "
                         f"{type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type: a function's parameters are an object, got "
                         f"{schema.get('type')!r}")
    check_json_depth(schema, where)


def named_tool(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` asks for; None for the string choices."""
    tool_choice = _plain(tool_choice)
    if tool_choice is None or isinstance(tool_choice, str):
        if tool_choice not in (None, "none", "auto", "required"):
            raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or a named "
                             f"function, got {tool_choice!r}")
        return None
    function = _plain(tool_choice.get("function")) if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name: expected the name of one of the tools")
    return name


def tool_choice_schema(tools: Sequence[Any] | None, tool_choice: Any,
                       parallel_tool_calls: bool | None = True) -> dict[str, Any] | None:
    """The JSON schema the output must follow for ``tool_choice``, or None when the
    choice constrains nothing (``"none"``, ``"auto"``, no choice).

    ``"required"``: a list (at least one call; at most one when ``parallel_tool_calls``
    is False) of ``{"name": <a tool's name>, "parameters": <its parameters>}``, one
    ``anyOf`` alternative per tool (no other keys), the tools' ``$defs`` gathered at the
    top. A named
    function: that function's parameters schema."""
    checked = validate_tools(tools)
    name = named_tool(tool_choice)
    if name is None and _plain(tool_choice) != "required":
        return None
    if not checked:
        raise ValueError("tool_choice: a required or named tool choice needs tools")
    if name is not None:
        for tool in checked:
            if tool["function"]["name"] == name:
                return dict(tool["function"].get("parameters") or _EMPTY_PARAMETERS)
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
    alternatives = []
    definitions: dict[str, Any] = {}
    for index, tool in enumerate(checked):
        parameters = dict(tool["function"].get("parameters") or _EMPTY_PARAMETERS)
        for key, definition in (parameters.pop("$defs", None) or {}).items():
            if definitions.setdefault(key, definition) != definition:
                raise ValueError(f"tools[{index}].function.parameters.$defs.{key}: another "
                                 "tool defines it differently")
        # closed: under a backend that allows unlisted keys by default (llguidance), a
        # call could otherwise carry keys that no tool call has
        alternatives.append({"properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": parameters}, "required": ["name", "parameters"],
            "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def tool_calls_from_output(text: str, tool_choice: Any) -> list[ToolCall]:
    """The tool calls an output constrained by ``tool_choice_schema`` stands for. A named
    function's arguments are the output itself (as written when it does not parse, cut
    by ``max_tokens``); a ``"required"`` list that does not parse gives no calls."""
    name = named_tool(tool_choice)
    if name is not None:
        info = NamedToolCallParser(None, name).extract_tool_calls(text, None)
        if info.tool_calls:
            return info.tool_calls
        return [ToolCall(function=FunctionCall(name=name, arguments=text))]
    return RequiredToolCallParser(None).extract_tool_calls(text, None).tool_calls
