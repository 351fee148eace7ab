"""Every error a client sees, in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``:
raised as ``OpenAIError`` by the routes, written directly by the ASGI layer for 401 and
413, and sent as a final SSE event when a stream's engine dies or shuts down.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from triollm.errors import EngineDeadError, RequestFailedError
from triollm.log_text import clipped

__all__ = ["OpenAIError", "add_error_handlers", "bad_request", "engine_unavailable",
           "error_json", "remember_request_id", "request_id_of", "stream_error_event"]

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status)


class _ErrorResponse(JSONResponse):
    """An error's JSON: text that UTF-8 cannot encode (a lone surrogate a message
    quotes) is written as its JSON escape instead of failing."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


def bad_request(error: ValueError) -> OpenAIError:
    """A 400 naming the field when the message starts with ``field: ...`` (a field path
    such as ``messages[0].content[1].type`` too)."""
    message = str(error)
    head, sep, _ = message.partition(":")
    param = head if sep and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", head) else None
    return OpenAIError(400, message, param=param)


def raise_first_answer(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """A task group of a request's prompts failed: if every error is an answer for the
    client (one prompt's bad input, the engine gone), the first one answers; anything
    else (a bug) propagates as it is."""
    answers, _ = group.split(OpenAIError)
    if answers is None or len(answers.exceptions) != len(group.exceptions):
        raise group
    raise answers.exceptions[0] from None


def engine_unavailable(error: BaseException) -> OpenAIError:
    """The answer to a request the engine could not serve: 500 when its own part of a
    step failed, 503 when the engine is dead or shutting down."""
    if isinstance(error, RequestFailedError):
        return OpenAIError(500, str(error), type="RequestFailedError")
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, f"The engine is dead: {error}", type="EngineDeadError")
    return OpenAIError(503, "The server is shutting down.", type="ServiceUnavailableError")


def error_json(status: int, message: str, type: str, param: str | None = None) -> bytes:
    return json.dumps(OpenAIError(status, message, type=type, param=param).body()).encode()


def stream_error_event(error: BaseException) -> dict[str, Any]:
    """The last event of a stream whose request failed, or whose engine died or shut
    down."""
    if isinstance(error, RequestFailedError):
        return OpenAIError(500, str(error), type="RequestFailedError").body()
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"The engine died while generating: {error}",
                           type="EngineDeadError").body()
    return OpenAIError(503, "The server shut down while generating.",
                       type="ServiceUnavailableError").body()


async def _openai_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, OpenAIError)
    return error.response()


async def _validation_error(request: Request, error: Exception) -> JSONResponse:
    """pydantic's validation errors as a 400 naming the first bad field."""
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    first = problems[0] if problems else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
        f"{e.get('msg', 'invalid')}" for e in problems)
    if first.get("type") == "json_invalid":
        message, param = f"Invalid JSON body: {first.get('msg', '')}", None
    return OpenAIError(400, message, param=param).response()


_HTTP_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError",
                     404: "NotFoundError", 405: "MethodNotAllowedError"}


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method, a body that does not
    parse: invalid UTF-8, JSON nested too deeply) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    message = str(error.detail)
    if error.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
    elif error.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    elif error.status_code == 400 and error.__cause__ is not None:
        message = f"Invalid request body: {type(error.__cause__).__name__}: {error.__cause__}"
    response = OpenAIError(error.status_code, message,
                           type=_HTTP_ERROR_TYPES.get(error.status_code, "HTTPError")).response()
    for name, value in (error.headers or {}).items():
        response.headers[name] = value
    return response


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug's 500, in OpenAI's shape, logged with its traceback and the request's id.
    (Starlette calls this for any exception a route raises, also once a stream has
    started, when only the log is left to do.)"""
    logger.error("%s %s (request id %s) failed", request.method, clipped(request.url.path),
                 request_id_of(request.scope), exc_info=error)
    return OpenAIError(500, f"Internal server error: {type(error).__name__}",
                       type="InternalServerError").response()


def request_id_of(scope: Mapping[str, Any]) -> str:
    """The id an HTTP request is known by, for log lines: the one its route chose
    (``remember_request_id``), else the client's ``X-Request-Id``, else "-"."""
    chosen = (scope.get("state") or {}).get("request_id")
    if chosen:
        return clipped(chosen)
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            return clipped(value.decode("latin-1"))
    return "-"


def remember_request_id(request: Request, request_id: str) -> str:
    """Record the id a route answers under, so that error log lines name it."""
    request.state.request_id = request_id
    return request_id


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
