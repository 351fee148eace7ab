"""The OpenAPI document, saying what the server answers.

FastAPI writes each route's success from its declaration; ``openapi_document`` adds
what it cannot know: the errors, every one in OpenAI's shape (``ErrorResponse``), on
the routes that can answer them; the SSE streams of the routes that stream; and none
of FastAPI's 422 ``HTTPValidationError``, since a body that does not validate is a 400
here (errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from triollm.server.middleware import OPEN_PATHS
from triollm.server.protocol import ErrorResponse
from triollm.server.streaming import NULL_DELIMITED_MEDIA_TYPE

__all__ = ["install_openapi", "openapi_document"]

_ERRORS = {
    400: "The request is not valid: a field, the JSON, or its text",
    401: "No valid API key (the server was started with one)",
    404: "The model (or adapter) named does not exist",
    409: "The prefix cache is in use by running requests",
    413: "The request body is larger than the server allows",
    500: "The request's own part of an engine step failed; the server carries on",
    503: "The engine is dead, or the server is shutting down",
}

#: Routes that generate or pool through the engine (a step can fail for one request).
_ENGINE_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations",
    "/generate", "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank"})
#: Routes whose reply is a server-sent event stream when the body asks for one.
_STREAMING_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


#: One server-sent event of a stream (OpenAPI 3.1: the schema of a stream is its events').
_SSE_EVENT = {
    "type": "object", "required": ["data"],
    "description": "With `stream: true`, the reply is server-sent events",
    "properties": {"data": {"type": "string", "description": "A JSON chunk in OpenAI's "
                            "shape (an error too), or `[DONE]` last"},
                   "event": {"type": "string"}}}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """``app``'s OpenAPI document, with the responses the server really gives."""
    document = get_openapi(title=app.title, version=app.version,
                           description=app.description, routes=app.routes)
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            _document_responses(path, operation)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["ErrorResponse"] = error
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve ``openapi_document`` (built once, on the first request for it)."""
    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def _document_responses(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    responses.pop("422", None)
    success = responses.setdefault("200", {"description": "Successful Response"})
    if path in _STREAMING_ROUTES:
        success.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
    elif path == "/generate":
        success.setdefault("content", {})[NULL_DELIMITED_MEDIA_TYPE] = {
            "schema": {"type": "string", "format": "binary", "description": "With "
                       "`stream: true`: JSON objects, each followed by a NUL byte"}}
    for status in _error_statuses(path, operation):
        responses.setdefault(str(status), {
            "description": _ERRORS[status],
            "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})


def _error_statuses(path: str, operation: dict[str, Any]) -> list[int]:
    statuses = [] if path in OPEN_PATHS else [401]
    if path == "/reset_prefix_cache":
        statuses.append(409)
    if "requestBody" in operation or path == "/invocations":
        statuses += [400, 404, 413, 503]
        if path in _ENGINE_ROUTES:
            statuses.append(500)
    elif operation.get("parameters"):
        statuses.append(404)
    return sorted(statuses)
