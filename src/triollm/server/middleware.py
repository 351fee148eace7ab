"""The ASGI layer outside FastAPI: ``RequestLifetime`` owns each HTTP request's lifetime.

It checks the API key (401; every route but ``/health``, ``/ping`` and ``/metrics``),
reads the whole body (413 over the limit; 400 for a JSON body with a lone surrogate,
body_text.py), hands it to the app, and meanwhile watches
for ``http.disconnect``: a client that goes away cancels the request's scope, so
``engine.generate`` aborts the request within one engine step, streaming or not.
(Hypercorn drops sends after a close silently and does not cancel handlers, so nothing
else would notice.) A route's exception is a logged 500 in OpenAI's shape (errors.py);
one that escapes the app before any response started gets the same here. It also
counts open requests for a graceful shutdown.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from triollm.log_text import clipped
from triollm.server.body_text import LARGE_BODY_BYTES, body_problem
from triollm.server.errors import error_json, request_id_of
from triollm.server.limits import MAX_STRING_LIST_CHARS, MAX_STRING_LIST_ITEMS
from triollm.server.state import ServerState

__all__ = ["OPEN_PATHS", "ASGIApp", "Message", "Receive", "RequestLifetime", "Scope", "Send",
           "send_json"]

# ASGI's own types: its messages are plain dicts of any values.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)

#: Routes a load balancer or scraper reads without a key (as vLLM leaves them open).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nobody to answer."""


class RequestLifetime:
    """Owns each HTTP request's lifetime: its body, its scope, its client's presence."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await send_json(send, 401, error_json(401, "Unauthorized: a valid API key is "
                                                  "required", "AuthenticationError"))
            return
        try:
            body = await self._read_body(scope, receive)
        except _ClientGone:
            return
        if body is None:
            await send_json(send, 413, error_json(
                413, f"Request body larger than {self.state.settings.max_request_body_bytes}"
                " bytes", "RequestTooLargeError"))
            return
        problem = (await self.state.offload.check_body(body) if len(body) >= LARGE_BODY_BYTES
                   else body_problem(body, MAX_STRING_LIST_ITEMS, MAX_STRING_LIST_CHARS))
        if problem is not None:
            field, message = problem
            await send_json(send, 400, error_json(
                400, clipped(message), "BadRequestError", param=clipped(field)))
            return
        self.state.request_started()
        try:
            await self._serve(scope, receive, send, body)
        finally:
            self.state.request_ended()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        disconnected = anyio.Event()
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async with anyio.create_task_group() as request_scope:
            async def watch_for_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected.set()
                        request_scope.cancel_scope.cancel()
                        return

            request_scope.start_soon(watch_for_disconnect)
            await self._run_app(scope, replay, send)
            request_scope.cancel_scope.cancel()

    async def _run_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; a stray exception is logged and, if no response started yet,
        answered with a 500 (the server and the other requests carry on)."""
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            if started:
                return  # the app's own 500 handler answered and logged it (errors.py)
            logger.error("%s %s (request id %s) failed", scope.get("method"),
                         clipped(scope.get("path")), request_id_of(scope), exc_info=error)
            await send_json(send, 500, error_json(
                500, f"Internal server error: {type(error).__name__}", "InternalServerError"))

    def _authorized(self, scope: Scope) -> bool:
        """Whether the request may pass: no key is set, its path (under ``--root-path``)
        is one of ``OPEN_PATHS``, or it carries ``Authorization: Bearer KEY`` (the
        scheme in any case) with one of the keys."""
        keys = self.state.settings.api_keys
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if not keys or path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Digests have one length, and every key is compared, so the time taken tells
        # neither a key's length nor which one was close.
        given = hashlib.sha256(token).digest()
        matches = [hmac.compare_digest(given, hashlib.sha256(key.encode()).digest())
                   for key in keys]
        return any(matches)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.state.settings.max_request_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
