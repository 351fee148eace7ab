"""``qwen3_coder``: Qwen3-Coder and Qwen3.5 write each call in XML-style tags,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

and each parameter's text becomes a JSON value by the type the request's tool gives it,
as vLLM converts it."""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from triollm.tool_parsers.abstract import ToolParserManager
from triollm.tool_parsers.incremental import (
    CallScan,
    IncrementalToolParser,
    Scan,
    join_content,
    tagged_regions,
)

__all__ = ["Qwen3CoderToolParser", "convert_parameter", "tool_properties"]

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_BAD_NAME = set(" \t\r\n{}<>\"'")


def tool_properties(request: Any, name: str) -> dict[str, Any]:
    """The ``properties`` of the parameters of the request's tool ``name`` ({} if none)."""
    for tool in getattr(request, "tools", None) or []:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return dict(properties) if isinstance(properties, Mapping) else {}
    return {}


def _schema_type(schema: Any) -> tuple[str, bool]:
    """The type a parameter's schema names (the first non-null one of an ``anyOf``) and
    whether it admits null."""
    if not isinstance(schema, Mapping):
        return "string", False
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            names = [str(k).lower() for k in kind]
            rest = [k for k in names if k != "null"]
            return (rest[0] if rest else "null"), "null" in names
        return str(kind).strip().lower(), str(kind).lower() == "null"
    options = [o for o in schema.get("anyOf", []) if isinstance(o, Mapping) and "type" in o]
    kinds = [str(o["type"]).strip().lower() for o in options]
    rest = [k for k in kinds if k != "null"]
    return (rest[0] if rest else "string"), "null" in kinds


def convert_parameter(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for; the text itself
    when it does not read as one."""
    kind, nullable = _schema_type(schema)
    if text.lower() in ("null", "none") and (nullable or kind not in (
            "string", "str", "text", "varchar", "char", "enum")):
        return None
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return text
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(text)
        if kind.startswith(("num", "float", "double")):
            number = float(text)
            if not math.isfinite(number):
                return text
            return int(number) if number.is_integer() and "." not in text and "e" not in \
                text.lower() else number
    except ValueError:
        return text
    if kind in ("boolean", "bool", "binary"):
        return text.strip().lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return text
    return value


def _value_end(body: str, start: int, whole: bool) -> tuple[int, int] | None:
    """Where the value that starts at ``body[start]`` ends and where reading goes on;
    None while the text cannot tell yet. A ``</parameter>`` ends it when the next tag
    follows (a literal one inside the value does not)."""
    search = start
    while (close := body.find(PARAMETER_END, search)) != -1:
        rest = body[close + len(PARAMETER_END):].lstrip()
        if rest.startswith((PARAMETER, FUNCTION_END)) or (whole and not rest):
            return close, close + len(PARAMETER_END)
        if not whole and (not rest or PARAMETER.startswith(rest)
                          or FUNCTION_END.startswith(rest)):
            return None
        search = close + len(PARAMETER_END)
    if not whole:
        return None
    # No closing tag: the next parameter or the function's end closes the value.
    ends = [i for i in (body.find(PARAMETER, start), body.find(FUNCTION_END, start)) if i != -1]
    end = min(ends, default=len(body))
    return end, end


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _function(body: str, whole: bool, properties_of: Callable[[str], dict[str, Any]]
              ) -> CallScan | None:
    """The call in one ``<tool_call>`` region (None: it is not one)."""
    opened = body.find(FUNCTION)
    head_end = body.find(">", opened + len(FUNCTION)) if opened != -1 else -1
    if head_end == -1:
        return None if whole else CallScan()
    name = body[opened + len(FUNCTION):head_end]
    if not name or _BAD_NAME & set(name):
        return None
    properties = properties_of(name)
    pairs: list[str] = []
    pos, closed = head_end + 1, whole
    while True:
        parameter = body.find(PARAMETER, pos)
        function_end = body.find(FUNCTION_END, pos)
        if function_end != -1 and (parameter == -1 or function_end < parameter):
            closed = True
            break
        name_end = body.find(">", parameter + len(PARAMETER)) if parameter != -1 else -1
        if name_end == -1:
            break
        value_at = name_end + 1
        found = _value_end(body, value_at, whole)
        if found is None:
            closed = False
            break
        key = body[parameter + len(PARAMETER):name_end]
        value = convert_parameter(_strip_newline(body[value_at:found[0]]), properties.get(key))
        pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                     f"{json.dumps(value, ensure_ascii=False)}")
        pos = found[1]
    arguments = "{" + ", ".join(pairs) + ("}" if closed else "")
    return CallScan(name, arguments, closed)


@ToolParserManager.register_module(["qwen3_coder", "qwen3_xml"])
class Qwen3CoderToolParser(IncrementalToolParser):
    """Calls in ``<tool_call>`` tags; the text outside them is content. A parameter
    streams once the next tag shows where its value ends."""

    keep_special_tokens = True

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._properties: dict[tuple[int, str], dict[str, Any]] = {}

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        def properties_of(name: str) -> dict[str, Any]:
            key = (id(request), name)
            if key not in self._properties:  # read the tools once per stream, not per delta
                self._properties[key] = tool_properties(request, name)
            return self._properties[key]

        reads = self.memo.reads_of(text, request)
        before, regions, after = tagged_regions(text, START, END, final=final, reads=reads)
        calls: list[CallScan] = []
        malformed = False
        for index, (body, closed) in enumerate(regions):
            if closed and index in reads:  # a closed region reads the same in any longer text
                call = reads[index]
            else:
                call = _function(body, closed or final, properties_of)
                if closed:
                    reads[index] = call
            malformed = malformed or call is None
            calls.append(call or CallScan())
        content = join_content(before, after, any_call=bool(calls), final=final,
                               tags=(START,))
        return Scan(content, calls, malformed)
