"""hypercorn's own HTTP/1.1 error answers, in OpenAI's shape.

A request that h11 cannot parse (headers over ``h11_max_incomplete_size``: 431; a
malformed request line or header: 400) never reaches the ASGI app: hypercorn answers
it in ``H11Protocol._send_error_response`` with an empty body and closes the
connection. hypercorn has no hook for that answer, so ``install`` replaces that one
method with one that sends the same status, with an error body in OpenAI's shape. If
a hypercorn release renames it or changes its signature, nothing is replaced and the
bare answer stays (tests/test_server_errors.py notices).
"""

from __future__ import annotations

import inspect
from typing import Any

import h11
from hypercorn.protocol.h11 import H11Protocol

from triollm.server.errors import error_json

__all__ = ["install", "protocol_error_body"]

_ERRORS = {
    400: ("Malformed HTTP request", "BadRequestError"),
    431: ("Request headers too large ({limit} bytes at most)",
          "RequestHeaderFieldsTooLargeError"),
}


def protocol_error_body(status: int, header_limit: int) -> bytes:
    """The JSON body of hypercorn's answer ``status`` to a request h11 refused."""
    message, type_ = _ERRORS.get(status, ("HTTP protocol error", "HTTPError"))
    return error_json(status, message.format(limit=header_limit), type_)


async def _send_error_response(self: Any, status_code: int) -> None:
    body = protocol_error_body(status_code, self.config.h11_max_incomplete_size)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               *self.config.response_headers("h11")]
    await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


def install() -> bool:
    """Make hypercorn's HTTP/1.1 error answers JSON; whether it could be done."""
    current = getattr(H11Protocol, "_send_error_response", None)
    if current is _send_error_response:
        return True
    if current is None or list(inspect.signature(current).parameters) != [
            "self", "status_code"]:
        return False
    H11Protocol._send_error_response = _send_error_response  # type: ignore[method-assign]
    return True
