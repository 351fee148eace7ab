"""``Admission``: the outermost ASGI layer, which bounds what connections may hold.

* **Concurrency:** at most ``limit_concurrency`` HTTP requests are in the app at once
  (uvicorn's ``--limit-concurrency``); one more is answered 503 in OpenAI's shape, with
  ``Connection: close``, before its body is read. ``/health``, ``/ping`` and
  ``/metrics`` are not counted and never refused, so a probe still reads the server's
  state when it is full.
* **Slow bodies:** a request's whole body must arrive within ``body_read_timeout``
  seconds of its headers; a slower one is cut with a 408 and the connection closed.
  (hypercorn's own ``read_timeout`` bounds each read, so a byte every few seconds would
  hold a connection for ever, and it would also cut a client that waits quietly on a
  long stream.)
* **Headers:** a request with more than ``max_header_count`` headers gets 431 (vLLM's
  ``--h11-max-header-count``; h11 bounds their bytes, not their number).

Idle keep-alive connections and unfinished headers are hypercorn's: it closes them
``keep_alive_timeout`` seconds after the connection opened or its last response ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from triollm.server.errors import error_json
from triollm.server.middleware import OPEN_PATHS, ASGIApp, Message, Receive, Scope, Send

__all__ = ["Admission", "AdmissionLimits"]

_CLOSE = (b"connection", b"close")


@dataclass(frozen=True)
class AdmissionLimits:
    """What ``Admission`` holds requests to."""

    #: HTTP requests in the app at once; None: no limit.
    limit_concurrency: int | None = None
    #: Seconds from a request's headers to the end of its body; None: no limit.
    body_read_timeout: float | None = None
    #: Headers one request may carry; None: no limit.
    max_header_count: int | None = None


class Admission:
    """Refuses requests beyond the limits (``AdmissionLimits``) before the app sees them."""

    def __init__(self, app: ASGIApp, limits: AdmissionLimits) -> None:
        self.app = app
        self.limits = limits
        #: Counted requests now in the app.
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        if (limits.max_header_count is not None
                and len(scope.get("headers") or ()) > limits.max_header_count):
            await _send_error(send, 431, f"More than {limits.max_header_count} request "
                              "headers", "RequestHeaderFieldsTooLargeError")
            return
        if scope.get("path") in OPEN_PATHS:
            await self._run(scope, receive, send)
            return
        if limits.limit_concurrency is not None and self.in_flight >= limits.limit_concurrency:
            await _send_error(send, 503, "The server is at its limit of "
                              f"{limits.limit_concurrency} concurrent requests; retry later",
                              "ServiceUnavailableError")
            return
        self.in_flight += 1
        try:
            await self._run(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.limits.body_read_timeout
        if timeout is None:
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + timeout
        body_done = False
        timed_out = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                body_done = (message["type"] != "http.request"
                             or not message.get("more_body", False))
                return message
            timed_out = True
            app_scope.cancel()
            await anyio.sleep_forever()  # the cancellation lands here
            raise AssertionError("unreachable")

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with anyio.CancelScope() as app_scope:
            await self.app(scope, timed_receive, tracking_send)
        if timed_out and not started:
            await _send_error(send, 408, f"The request body did not arrive within "
                              f"{timeout:g} s", "RequestTimeoutError")


async def _send_error(send: Send, status: int, message: str, type: str) -> None:
    """An error in OpenAI's shape, on a connection then closed."""
    body = error_json(status, message, type)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), _CLOSE]})
    await send({"type": "http.response.body", "body": body})
