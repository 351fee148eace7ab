"""What every grammar backend offers the compiler, and what they share: the options a
constraint compiles under, and the schema rewrites both backends need. Pure: no torch,
no grammar library."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Protocol

from triollm.structured_output.grammar import CompiledGrammar
from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["GrammarBackend", "GrammarOptions", "UnsupportedConstraint", "close_objects",
           "looks_like_lark", "schema_of", "structural_tag_of"]


class UnsupportedConstraint(ValueError):
    """The backend cannot take this constraint at all (another backend may)."""


@dataclass(frozen=True)
class GrammarOptions:
    """A request's options with the engine's defaults folded in."""

    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer (built once per engine)."""

    name: str

    def compile(self, params: StructuredOutputsParams, options: GrammarOptions
                ) -> CompiledGrammar:
        """Compile ``params``; ``UnsupportedConstraint`` when this backend cannot take
        it, ``ValueError`` when it is invalid."""
        ...


def schema_of(params: StructuredOutputsParams) -> dict[str, Any] | bool:
    """The JSON schema of a ``json`` or ``json_object`` constraint."""
    if params.json_object:
        return {"type": "object"}
    value = params.json
    schema: dict[str, Any] | bool = (json.loads(value) if isinstance(value, str)
                                     else copy.deepcopy(value or {}))
    return schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "contains", "not", "if",
               "then", "else", "allOf", "anyOf", "oneOf", "unevaluatedProperties",
               "unevaluatedItems", "propertyNames")


def close_objects(schema: Any) -> None:
    """``disable_additional_properties``: every object schema that lists properties and
    says nothing of others allows none, in place."""
    if isinstance(schema, list):
        for item in schema:
            close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                close_objects(sub)
    for key in _SUBSCHEMAS:
        close_objects(schema.get(key))
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def looks_like_lark(grammar: str) -> bool:
    """A Lark grammar (``rule: ...``) rather than EBNF/GBNF (``rule ::= ...``)."""
    return "::=" not in grammar


def structural_tag_of(params: StructuredOutputsParams) -> dict[str, Any]:
    """vLLM's structural tag: ``{"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}`` (or xgrammar's newer ``{"format": ...}``)."""
    assert params.structural_tag is not None
    try:
        tag = json.loads(params.structural_tag)
    except ValueError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(tag, dict):
        raise ValueError("must be a JSON object")
    if "format" in tag:
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise ValueError('needs "structures" (a non-empty list) and "triggers" (a list)')
    for item in structures:
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str)
                and isinstance(item.get("end"), str) and "schema" in item):
            raise ValueError('each structure needs "begin", "schema" and "end"')
        if not any(item["begin"].startswith(t) for t in triggers if isinstance(t, str)):
            raise ValueError(f"begin {item['begin']!r} starts with none of the triggers")
    return tag
