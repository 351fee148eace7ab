"""Structured outputs over HTTP: the body's fields that constrain the output, and the
one ``StructuredOutputsParams`` they make.

A request names its constraint in one of three ways, as vLLM reads them: OpenAI's
``response_format`` (``json_object``, ``json_schema``, vLLM's ``structural_tag``),
vLLM's ``structured_outputs`` object, or vLLM's older top-level ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structural_tag``. At most
one constraint is allowed; the options (``guided_whitespace_pattern``, the
``structured_outputs`` object's ``disable_*`` keys) join it. Every problem is a
``ValueError`` naming the body's field as the client wrote it (``Constraint.field``),
which also renames the engine's own complaint about the grammar (``renamed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["Constraint", "JsonSchemaFormat", "ResponseFormat",
           "StructuredOutputFields", "StructuredOutputsObject", "check_backend", "renamed",
           "text_format_constraint"]

#: A JSON schema as an object or its text: typed ``Any`` so that a wrong type is named
#: by the conversion as the field itself (a union's error names each member).
_SCHEMA_FIELD: Any = {"anyOf": [{"type": "object"}, {"type": "null"}, {"type": "string"}]}

#: The constraint keys of ``structured_outputs`` (``StructuredOutputsParams``' kinds).
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: The older top-level fields, each the ``StructuredOutputsParams`` field it sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the body field that asked for it."""

    params: StructuredOutputsParams
    #: The field as the client wrote it (``response_format.json_schema.schema``,
    #: ``guided_regex``, ``structured_outputs.grammar``...).
    field: str


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted;
    the output always follows the schema)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``; ``structural_tag`` is vLLM's (its ``structures``
    and ``triggers``, or ``format``, as extra keys)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsObject(BaseModel):
    """vLLM's ``structured_outputs`` body object: one constraint and its options."""

    model_config = ConfigDict(extra="forbid")

    json_: Any = Field(default=None, alias="json", json_schema_extra=_SCHEMA_FIELD)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class StructuredOutputFields(BaseModel):
    """The request fields that ask for structured output (completions and chat)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsObject | None = None
    guided_json: Any = Field(default=None, json_schema_extra=_SCHEMA_FIELD)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_output(self, backend: str) -> Constraint | None:
        """The constraint this body asks for (None: free text), for a server whose
        grammar backend is ``backend``; ``ValueError`` naming the field for two
        constraints, a missing schema, or a backend other than the server's."""
        found: dict[str, tuple[str, Any]] = {}  # field -> (kind, value)
        options: dict[str, Any] = {}
        box = self.structured_outputs
        if box is not None:
            for kind in _KINDS:
                value = getattr(box, "json_" if kind == "json" else kind)
                if value is not None and value is not False:
                    found[f"structured_outputs.{kind}"] = (kind, value)
            options = box.model_dump(include={"disable_fallback", "disable_any_whitespace",
                                              "disable_additional_properties",
                                              "whitespace_pattern"}, exclude_defaults=True)
        for name, kind in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found[name] = (kind, value)
        if self.response_format is not None:
            found.update(_response_format(self.response_format))
        if self.guided_whitespace_pattern is not None:
            options["whitespace_pattern"] = self.guided_whitespace_pattern
        if self.guided_decoding_backend is not None:
            check_backend(self.guided_decoding_backend, backend)
        return _one(found, options, "structured_outputs")


def _response_format(response_format: ResponseFormat) -> dict[str, tuple[str, Any]]:
    kind = response_format.type
    if kind == "json_object":
        return {"response_format": ("json_object", True)}
    if kind == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise ValueError("response_format.json_schema: required when type is "
                             "'json_schema'")
        if spec.json_schema is None:
            raise ValueError("response_format.json_schema.schema: required")
        return {"response_format.json_schema.schema": ("json", spec.json_schema)}
    if kind == "structural_tag":
        tag = response_format.model_dump(exclude_none=True)
        if tag.keys() <= {"type"}:
            raise ValueError("response_format: a structural_tag needs its 'structures' "
                             "and 'triggers', or its 'format'")
        return {"response_format": ("structural_tag", json.dumps(tag))}
    return {}


def _one(found: dict[str, tuple[str, Any]], options: dict[str, Any],
         options_field: str) -> Constraint | None:
    if len(found) > 1:
        names = ", ".join(found)
        raise ValueError(f"{next(iter(found))}: only one structured-output constraint "
                         f"may be given; this request has {len(found)} ({names})")
    if not found:
        if options:
            raise ValueError(f"{options_field}: {', '.join(options)} given without a "
                             f"constraint (json, regex, choice, grammar, json_object or "
                             f"structural_tag)")
        return None
    [(field, (kind, value))] = found.items()
    try:
        params = StructuredOutputsParams(**{kind: value}, **options)
    except ValueError as error:
        raise renamed(error, field) from None
    return Constraint(params, field)


def text_format_constraint(text: dict[str, Any] | None) -> Constraint | None:
    """The Responses API's ``text.format`` (``json_schema``, ``json_object`` or
    ``text``) as a constraint; ``ValueError`` naming the field."""
    shape = (text or {}).get("format")
    if shape is None:
        return None
    if not isinstance(shape, dict):
        raise ValueError("text.format: must be an object")
    kind = shape.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _one({"text.format": ("json_object", True)}, {}, "text.format")
    if kind == "json_schema":
        schema = shape.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("text.format.schema: a JSON schema (an object) is required")
        if not isinstance(shape.get("name"), str):
            raise ValueError("text.format.name: required (a string)")
        return _one({"text.format.schema": ("json", schema)}, {}, "text.format")
    raise ValueError(f"text.format.type: {kind!r} is not one of 'text', 'json_object', "
                     f"'json_schema'")


def check_backend(requested: str, backend: str) -> None:
    """vLLM's rule for a request's ``guided_decoding_backend``: the server's backend is
    accepted (with vLLM's ``:option`` suffixes ignored), any other is refused."""
    name = requested.partition(":")[0].strip()
    if name != backend:
        raise ValueError(f"guided_decoding_backend: request-level backend selection is not "
                         f"supported; the request asked for {requested!r} but this server "
                         f"runs {backend!r} (--structured-outputs-config); remove the field")


def renamed(error: ValueError, field: str) -> ValueError:
    """``error`` (which names ``structured_outputs`` or one of its fields, as the engine
    and ``StructuredOutputsParams`` do) naming ``field`` instead."""
    message = str(error)
    head, sep, rest = message.partition(":")
    if sep and head.split(".")[0] == "structured_outputs":
        return ValueError(f"{field}:{rest}")
    return ValueError(f"{field}: {message}")
