"""``StructuredOutputsParams``: the one constraint a request's output must satisfy
(vLLM's class and field names). Pure data: no torch, no grammar library."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "StructuredOutputsParams", "check_json_depth", "load_json"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

#: How deeply a schema (or a structural tag) may nest its objects and arrays: what
#: llguidance parses (serde_json's limit). Deeper ones would exhaust the stack of the
#: Python that copies them, or of a backend's C++ that compiles them.
MAX_JSON_DEPTH = 128


def check_json_depth(value: Any, field: str) -> None:
    """``ValueError`` naming ``field`` when ``value`` nests deeper than
    ``MAX_JSON_DEPTH`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{field}: nests objects and arrays more than "
                             f"{MAX_JSON_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)


def load_json(text: str, field: str) -> Any:
    """``text`` parsed; ``ValueError`` naming ``field`` when it is no JSON or nests
    too deeply."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{field}: nests objects and arrays more than {MAX_JSON_DEPTH} "
                         f"deep") from None
    except ValueError as error:
        raise ValueError(f"{field}: not valid JSON ({error})") from None
    check_json_depth(value, field)
    return value


@dataclass
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or its text), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (EBNF/GBNF or Lark),
    ``json_object=True`` (any JSON object) or ``structural_tag`` (vLLM's structural-tag
    JSON) is set. The options follow vLLM: ``disable_any_whitespace`` keeps JSON compact,
    ``disable_additional_properties`` closes objects that do not say otherwise,
    ``whitespace_pattern`` is a regex for the whitespace JSON may contain, and
    ``disable_fallback`` refuses a request the chosen backend cannot compile instead of
    trying the other one.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            shown = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_KINDS)} must "
                             f"be set, got {shown}")
        if isinstance(self.json, str):
            parsed = load_json(self.json, "structured_outputs.json")
            if not isinstance(parsed, dict | bool):
                raise ValueError("structured_outputs.json: a JSON schema must be an object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json: must be a JSON schema (an object or "
                             "its text)")
        elif self.json is not None:
            check_json_depth(self.json, "structured_outputs.json")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of "
                                 "strings")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if isinstance(self.structural_tag, str):
            load_json(self.structural_tag, "structured_outputs.structural_tag")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object: must be true when given")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object,
        structural_tag."""
        return next(name for name in _KINDS if getattr(self, name) is not None)

    def cache_key(self) -> str:
        """The text that identifies this constraint and its options: two requests with
        the same key share one compiled grammar."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def copy(self) -> StructuredOutputsParams:
        """A copy that shares no mutable state with this one."""
        return StructuredOutputsParams(**json.loads(self.cache_key()))
