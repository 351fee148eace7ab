"""Work whose cost a client controls, off the event loop.

Tokenizing a prompt, rendering a chat template and detokenizing token ids take time in
proportion to the request. On the event loop that time would stall every other client
(``/health`` included); here it runs in a few worker threads. The tokenizers release the
GIL while they encode, and a chat template (pure Python) hands the GIL back to the loop
at every switch interval, so a thread keeps the loop responsive. Requests beyond the
threads wait in a bounded queue; past it they are refused with a 503.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from triollm.server.errors import OpenAIError
from triollm.server.limits import MAX_OFFLOAD_WAITING, OFFLOAD_THREADS

__all__ = ["Offload"]

T = TypeVar("T")


class Offload:
    """Runs client-sized functions in ``threads`` worker threads, at most
    ``max_waiting`` calls queued behind them."""

    def __init__(self, threads: int = OFFLOAD_THREADS,
                 max_waiting: int = MAX_OFFLOAD_WAITING) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self._max_waiting = max_waiting

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` in a worker thread; a 503 when the queue is full. A
        cancelled caller waits for a call already running (it cannot be stopped)."""
        if self._limiter.statistics().tasks_waiting >= self._max_waiting:
            raise OpenAIError(503, "The server is busy preparing other requests; retry "
                                   "shortly.", type="ServiceUnavailableError")
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)

    def statistics(self) -> anyio.CapacityLimiterStatistics:
        """The threads in use and the calls waiting for one."""
        return self._limiter.statistics()
