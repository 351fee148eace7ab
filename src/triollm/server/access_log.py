"""One access-log line per HTTP request, written when the request ends.

``AccessLog`` is the outermost ASGI layer. It notes when a request began and the status
its response started with, and writes the line when the app is done with it: after a
stream's last byte, or once the server noticed that the client left (the line then says
``disconnected``). A generation request counts its tokens into the request's
``TokenCounts`` (``token_counts``) as its outputs pass, so the line carries them; a
request without tokens has none on its line (each is one line, wrapped here)::

    127.0.0.1:50320 "GET /health HTTP/1.1" 200 0.001s
    127.0.0.1:50312 "POST /v1/completions HTTP/1.1" 200 0.412s prompt_tokens=5
        completion_tokens=16
    127.0.0.1:50318 "POST /v1/chat/completions HTTP/1.1" 200 1.003s prompt_tokens=9
        completion_tokens=3 disconnected

The request target is written as it came on the wire (percent-escapes stay escaped,
so a client cannot start a line of its own) and cut as every client-given value in a
log line is (``triollm.log_text``). ``HypercornLog`` sends hypercorn's own messages
through Python's logging, so that every line the server writes has one format; its
"Running on" line goes to debug, as the server logs its own start-up line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hypercorn.logging import Logger as HypercornLogger

from triollm.log_text import clipped
from triollm.outputs import RequestOutput
from triollm.server.middleware import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessLog", "HypercornLog", "TokenCounts", "token_counts"]

logger = logging.getLogger(__name__)

#: Where a request's ``TokenCounts`` lives in its ASGI scope's ``state``.
_STATE_KEY = "token_counts"


@dataclass
class TokenCounts:
    """One HTTP request's tokens so far: its prompts', and what its samples generated."""

    prompt_tokens: int = 0
    #: Tokens generated, from outputs that carry only new ones.
    _new_tokens: int = 0
    #: Tokens generated so far by each sample, by (prompt index, sample index), from
    #: outputs that carry them all.
    _sample_tokens: dict[tuple[int, int], int] = field(default_factory=dict)
    _counted: bool = False

    @property
    def completion_tokens(self) -> int:
        return self._new_tokens + sum(self._sample_tokens.values())

    @property
    def counted(self) -> bool:
        """Whether the request had any tokens (a generation or pooling request)."""
        return self._counted or bool(self.prompt_tokens)

    def add_first(self, prompt_index: int, output: RequestOutput, delta: bool) -> None:
        """Count a prompt's first engine output, and its prompt."""
        self._counted = True
        self.prompt_tokens += len(output.prompt_token_ids)
        self.add(prompt_index, output, delta)

    def add(self, prompt_index: int, output: RequestOutput, delta: bool) -> None:
        """Count one engine output of prompt ``prompt_index``: ``delta`` outputs carry
        new tokens, others each changed sample's tokens so far."""
        if delta:
            for sample in output.outputs:
                self._new_tokens += len(sample.token_ids)
        else:
            for sample in output.outputs:
                self._sample_tokens[prompt_index, sample.index] = len(sample.token_ids)


def token_counts(scope: Mapping[str, Any]) -> TokenCounts:
    """The ``TokenCounts`` the access log reads for this request (a fresh one where no
    access log runs)."""
    counts = (scope.get("state") or {}).get(_STATE_KEY)
    return counts if isinstance(counts, TokenCounts) else TokenCounts()


class AccessLog:
    """Writes one line per HTTP request when it ends, leaving out ``excluded_paths``
    (vLLM's ``--disable-access-log-for-endpoints``: exact paths, as ``/health``)."""

    def __init__(self, app: ASGIApp, *, excluded_paths: Collection[str] = (),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.app = app
        self.excluded_paths = frozenset(excluded_paths)
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._excluded(scope):
            await self.app(scope, receive, send)
            return
        started = self.clock()
        counts = TokenCounts()
        scope.setdefault("state", {})[_STATE_KEY] = counts
        status: int | None = None
        complete = False
        disconnected = False

        async def watched_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        async def watched_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            # The server also says so after a response is complete: not a client gone.
            disconnected = disconnected or (message["type"] == "http.disconnect"
                                            and not complete)
            return message

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            ending = "" if complete else " disconnected" if disconnected else " incomplete"
            tokens = (f" prompt_tokens={counts.prompt_tokens} "
                      f"completion_tokens={counts.completion_tokens}"
                      if counts.counted else "")
            logger.info('%s "%s %s HTTP/%s" %s %.3fs%s%s', _client(scope),
                        clipped(scope.get("method", "-")), _target(scope),
                        clipped(scope.get("http_version", "1.1")),
                        "-" if status is None else status, self.clock() - started, tokens,
                        ending)

    def _excluded(self, scope: Scope) -> bool:
        if not self.excluded_paths:
            return False
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        return path in self.excluded_paths or (
            bool(root) and path.startswith(root) and path[len(root):] in self.excluded_paths)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    if not client or not client[0]:
        return "-"
    return clipped(f"{client[0]}:{client[1]}")


def _target(scope: Scope) -> str:
    """The path and query as the client sent them (escaped), cut to the log's limit."""
    raw = scope.get("raw_path")
    target = (raw.decode("latin-1") if isinstance(raw, bytes)
              else quote(str(scope.get("path", "")), safe="/:@!$&'()*+,;=-._~"))
    query = scope.get("query_string") or b""
    if query and "?" not in target:
        target += "?" + query.decode("latin-1")
    return clipped(target)


class HypercornLog(HypercornLogger):
    """hypercorn's log through Python's logging (``hypercorn.error``, in the server's
    format), without its access log (``AccessLog`` writes one line per request, at its
    end) and with its "Running on" line at debug (the server logs its own)."""

    def __init__(self, config: Any) -> None:  # no super(): it would add handlers
        self.access_log_format = config.access_log_format
        self.access_logger = None
        self.error_logger = logging.getLogger("hypercorn.error")

    async def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        await self.debug(message, *args, **kwargs)
