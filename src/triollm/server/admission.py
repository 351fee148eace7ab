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
* **CPU per client:** with a ``ClientBudget`` (client_budget.py), each answer that cost
  the server's own CPU is charged to its client's address when its response starts,
  and held there while the address is past its share of a core; a request from an
  address further behind waits before its body is read.

Idle keep-alive connections and unfinished headers are hypercorn's: it closes them
``keep_alive_timeout`` seconds after the connection opened or its last response ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from triollm.server.client_budget import (
    ClientBudget,
    RequestWork,
    client_of,
    estimated_cost,
    served_by_engine,
    track_work,
)
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
    """Refuses requests beyond the limits (``AdmissionLimits``) before the app sees them,
    and paces each client's answers to its ``budget`` (None: not paced)."""

    def __init__(self, app: ASGIApp, limits: AdmissionLimits,
                 budget: ClientBudget | None = None) -> None:
        self.app = app
        self.limits = limits
        self.budget = budget
        #: Counted requests now in the app.
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metered = _Metered(self.budget, scope, receive, send)
        if self.budget is not None:
            await anyio.sleep(self.budget.start_wait(metered.client))
        limits = self.limits
        if (limits.max_header_count is not None
                and len(scope.get("headers") or ()) > limits.max_header_count):
            await _send_error(metered.send, 431, f"More than {limits.max_header_count} "
                              "request headers", "RequestHeaderFieldsTooLargeError")
            return
        if scope.get("path") in OPEN_PATHS:
            await self._run(scope, metered)
            return
        if limits.limit_concurrency is not None and self.in_flight >= limits.limit_concurrency:
            await _send_error(metered.send, 503, "The server is at its limit of "
                              f"{limits.limit_concurrency} concurrent requests; retry later",
                              "ServiceUnavailableError")
            return
        self.in_flight += 1
        try:
            await self._run(scope, metered)
        finally:
            self.in_flight -= 1

    async def _run(self, scope: Scope, metered: _Metered) -> None:
        timeout = self.limits.body_read_timeout
        if timeout is None:
            await self.app(scope, metered.receive, metered.send)
            return
        deadline = anyio.current_time() + timeout
        timed_out = False

        async def timed_receive() -> Message:
            nonlocal timed_out
            if metered.body_done:
                return await metered.receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                return await metered.receive()
            timed_out = True
            app_scope.cancel()
            await anyio.sleep_forever()  # the cancellation lands here
            raise AssertionError("unreachable")

        with anyio.CancelScope() as app_scope:
            await self.app(scope, timed_receive, metered.send)
        if timed_out and not metered.started:
            await _send_error(metered.send, 408, f"The request body did not arrive "
                              f"within {timeout:g} s", "RequestTimeoutError")


class _Metered:
    """One request's receive and send, measured for its client's budget: the bytes and
    end of its body; at its response's start, the charge, and the hold."""

    def __init__(self, budget: ClientBudget | None, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.budget = budget
        self.scope = scope
        self.client = client_of(scope)
        self._receive = receive
        self._send = send
        self.body_bytes = 0
        #: Whether the body's last part arrived (or the client left).
        self.body_done = False
        self.started = False
        self.work = RequestWork(budget=budget, client=self.client)
        track_work(self.work)

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.body_bytes += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
        else:
            self.body_done = True  # a disconnect ends it too
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.started:
            self.started = True
            await self._charge(int(message["status"]))
        await self._send(message)

    async def _charge(self, status: int) -> None:
        if self.budget is None:
            return
        cost = estimated_cost(served_by_engine=served_by_engine(self.scope),
                              failed=status >= 400, body_bytes=self.body_bytes,
                              worker_seconds=max(0.0, self.work.worker_seconds
                                                 - self.work.paced_seconds))
        if cost <= 0:
            return
        hold = self.budget.charge(self.client, cost)
        if hold > 0:
            self.budget.note_held(hold)
            await anyio.sleep(hold)


async def _send_error(send: Send, status: int, message: str, type: str) -> None:
    """An error in OpenAI's shape, on a connection then closed."""
    body = error_json(status, message, type)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), _CLOSE]})
    await send({"type": "http.response.body", "body": body})
