"""Work whose cost a client controls, off the event loop.

Tokenizing a prompt, rendering a chat template and detokenizing token ids take time in
proportion to the request. On the event loop that time would stall every other client
(``/health`` included); here it runs in a few worker threads. A chat template (pure
Python) hands the GIL back to the loop at every switch interval, and the tokenizers
release it while they encode, so a thread keeps the loop responsive. A long text is
encoded in a worker process instead (server/tokenizer_process.py): turning its tokens
into Python objects and freeing them would hold the GIL in proportion to its length.
Calls beyond the threads wait in a bounded queue; past it they are refused with a 503.
A worker process's call is paced to its client's share of a core once past the client's
allowance (server/worker_pace.py), and its time is charged to the client
(server/client_budget.py).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import weakref
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from triollm.server.client_budget import RequestWork, charge_work, current_work
from triollm.server.errors import OpenAIError
from triollm.server.limits import (
    LONG_TEXT_CHARS,
    MAX_OFFLOAD_WAITING,
    MAX_STRING_LIST_CHARS,
    MAX_STRING_LIST_ITEMS,
    MOST_CALLS_PER_CLIENT,
    OFFLOAD_PROCESSES,
    OFFLOAD_THREADS,
    PREFIX_CHARS_PER_TOKEN,
    PREFIX_MARGIN_TOKENS,
)
from triollm.server.tokenizer_process import TokenizerProcess, fast_tokenizer_json
from triollm.server.worker_pace import CallAbandoned, WorkerPace

if TYPE_CHECKING:
    from triollm.engine.detokenizer import Tokenizer

__all__ = ["Offload", "prefix_chars"]

T = TypeVar("T")


class Offload:
    """Runs client-sized work for one tokenizer: functions in ``threads`` worker
    threads, long texts' encoding in worker processes; at most ``max_waiting`` calls
    queued behind them."""

    def __init__(self, tokenizer: Tokenizer, *, threads: int = OFFLOAD_THREADS,
                 processes: int = OFFLOAD_PROCESSES, max_waiting: int = MAX_OFFLOAD_WAITING,
                 long_text: int = LONG_TEXT_CHARS) -> None:
        self.tokenizer = tokenizer
        self.long_text = long_text
        self._threads = anyio.CapacityLimiter(threads)
        self._processes = anyio.CapacityLimiter(processes)
        self._max_waiting = max_waiting
        self._pickled: bytes | None = None
        # checked here, before any thread encodes with the tokenizer at the same time
        self._fast_json = fast_tokenizer_json(tokenizer)
        self._lock = threading.Lock()
        self._workers: list[TokenizerProcess] = []
        self._idle: list[TokenizerProcess] = []
        self._pace = WorkerPace()
        self._turns: dict[str, _Turns] = {}
        # the processes end with this object (their stdin closes), or at exit
        weakref.finalize(self, _close_all, self._workers)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` in a worker thread; a 503 when the queue is full. A
        cancelled caller waits for a call already running (it cannot be stopped)."""
        self._check_queue(self._threads)
        return await anyio.to_thread.run_sync(function, *args, limiter=self._threads)

    async def encode_tail(self, text: str, add_special_tokens: bool, keep: int
                          ) -> tuple[int, list[int]]:
        """The number of tokens of ``text`` and its token ids: all of them for a text
        shorter than ``long_text`` characters, else (in a worker process) the last
        ``keep``."""
        if len(text) < self.long_text:
            ids = await self.run(self._encode, text, add_special_tokens)
            return len(ids), ids
        count, data = await self._in_process("encode_tail", text, add_special_tokens, keep)
        return count, array("q", data).tolist()

    async def tokens_at_least(self, text: str, add_special_tokens: bool, enough: int) -> int:
        """A lower bound of the number of tokens of ``text``, from encoding only the
        prefix that should hold ``enough`` of them (``prefix_chars``); 0 for a text not
        long enough to be worth it. The first so many characters of a text encode as
        they do in the whole text except near the cut (the pre-tokenizer's pieces and
        the merges inside one are local), so the prefix's count less
        ``PREFIX_MARGIN_TOKENS`` is at most the whole text's: a client's 8 MB prompt
        to a model of 32k tokens costs the encoding of 256 kB, not of 8 MB."""
        chars = prefix_chars(enough)
        if len(text) < max(self.long_text, 2 * chars):
            return 0
        count, _ = await self._in_process("encode_tail", text[:chars], add_special_tokens, 1)
        return max(0, count - PREFIX_MARGIN_TOKENS)

    async def encode_json(self, text: str, add_special_tokens: bool) -> tuple[int, bytes]:
        """The number of tokens of ``text`` and its ids as a JSON list (a long text in a
        worker process: no Python object per token here)."""
        if len(text) < self.long_text:
            ids = await self.run(self._encode, text, add_special_tokens)
            return len(ids), str(ids).replace(" ", "").encode()
        return await self._in_process("encode_json", text, add_special_tokens)

    async def render_in_process(self, conversation: list[dict[str, Any]],
                                arguments: dict[str, Any]) -> str:
        """A conversation through the chat template in a worker process (a template
        from the request, or a very large conversation): pure-Python rendering in a
        thread here would take the GIL from the event loop and the model thread for as
        long as it runs. ``CallFailed`` when the template raises."""
        _, data = await self._in_process("apply_chat_template", conversation, arguments)
        return data.decode("utf-8", "surrogatepass")

    async def check_body(self, body: bytes) -> tuple[str, str] | None:
        """server/body_text.py's ``body_problem`` of a large request body, in a worker
        process: decoding it holds the GIL for as long as it takes, in any thread."""
        _, data = await self._in_process("check_body", body, MAX_STRING_LIST_ITEMS,
                                         MAX_STRING_LIST_CHARS)
        problem = json.loads(data)
        return None if problem is None else (problem[0], problem[1])

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _in_process(self, name: str, *args: object) -> tuple[int, bytes]:
        """``name(*args)`` in a worker process, paced to the request's client's share
        once past its allowance (server/worker_pace.py); its time there is charged to
        the request (server/client_budget.py). A paced call gives up its place in the
        pool: a slow client's call does not keep others' waiting, and a client has at most
        ``MOST_CALLS_PER_CLIENT`` calls in worker processes at once. A cancelled caller
        does not wait: the process is killed (its work has no one to answer)."""
        self._check_queue(self._processes)
        work = current_work()
        client = work.client if work is not None and work.budget is not None else None
        async with self._client_turn(client):
            return await self._in_pool(work, name, *args)

    @asynccontextmanager
    async def _client_turn(self, client: str | None) -> AsyncIterator[None]:
        """One of ``MOST_CALLS_PER_CLIENT`` turns of ``client``'s in worker processes: a
        client's further calls wait here, not for (or in) the pool's places."""
        if client is None:
            yield
            return
        turns = self._turns.get(client)
        if turns is None:
            turns = self._turns[client] = _Turns(anyio.Semaphore(MOST_CALLS_PER_CLIENT))
        turns.users += 1
        try:
            async with turns.semaphore:
                yield
        finally:
            turns.users -= 1
            if not turns.users:
                del self._turns[client]

    async def _in_pool(self, work: RequestWork | None, name: str, *args: object
                       ) -> tuple[int, bytes]:
        place = object()
        await self._processes.acquire_on_behalf_of(place)
        holding = True

        def give_up_place() -> None:
            nonlocal holding
            if holding:
                holding = False
                self._processes.release_on_behalf_of(place)

        def give_up_place_from_thread() -> None:
            try:
                anyio.from_thread.run_sync(give_up_place)
            except RuntimeError:  # the event loop is gone: nothing waits for the place
                pass

        abandoned = threading.Event()
        took = [0.0]
        try:
            answer: tuple[int, bytes] = await anyio.to_thread.run_sync(
                self._call_process, took, abandoned, work,
                give_up_place_from_thread, name, args, abandon_on_cancel=True)
            return answer
        except anyio.get_cancelled_exc_class():
            abandoned.set()
            raise
        finally:
            charge_work(took[0])
            give_up_place()

    def _call_process(self, took: list[float], abandoned: threading.Event,
                      work: RequestWork | None, on_paced: Callable[[], None], name: str,
                      args: tuple[object, ...]) -> Any:
        """``name(*args)`` in an idle worker process (a new one if none is idle), paced
        for ``work``'s client; the CPU seconds of the call there go to ``took[0]``."""
        worker = self._take_worker()
        if abandoned.is_set():  # given up while a process was found: it stays idle
            self._give_back(worker)
            raise CallAbandoned
        try:
            wait = (partial(self._pace.wait, work=work, abandoned=abandoned,
                            on_paced=on_paced) if os.name == "posix" else None)
            if name == "apply_chat_template":
                worker.load_whole()  # once per worker, neither paced nor charged
            return worker.call(name, *args, wait=wait)
        finally:
            took[0] = worker.last_call_seconds
            if (abandoned.is_set() and work is not None and work.budget is not None
                    and took[0] > work.paced_seconds):
                # the request's own accounting ended with it: its client pays here
                work.budget.charge(work.client, took[0] - work.paced_seconds)
            self._give_back(worker)

    def _take_worker(self) -> TokenizerProcess:
        """An idle worker process (a new one if none is idle)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._pickled is None:
                self._pickled = pickle.dumps(self.tokenizer)
        worker = TokenizerProcess(self._pickled, self._fast_json)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _give_back(self, worker: TokenizerProcess) -> None:
        with self._lock:
            if worker.broken:
                self._workers.remove(worker)
            else:
                self._idle.append(worker)

    def _check_queue(self, limiter: anyio.CapacityLimiter) -> None:
        if limiter.statistics().tasks_waiting >= self._max_waiting:
            raise OpenAIError(503, "The server is busy preparing other requests; retry "
                                   "shortly.", type="ServiceUnavailableError")

    def statistics(self) -> anyio.CapacityLimiterStatistics:
        """The threads in use and the calls waiting for one."""
        return self._threads.statistics()


def prefix_chars(enough: int) -> int:
    """How many characters of a text ``tokens_at_least`` encodes to find ``enough``
    tokens."""
    return (enough + PREFIX_MARGIN_TOKENS) * PREFIX_CHARS_PER_TOKEN


@dataclass
class _Turns:
    semaphore: anyio.Semaphore
    #: Calls holding or waiting for a turn.
    users: int = 0


def _close_all(workers: list[TokenizerProcess]) -> None:
    for worker in list(workers):
        worker.close()
