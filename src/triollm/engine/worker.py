"""The model thread: one OS thread that runs every call into the model runner.

torch and CUDA keep per-thread state, so the runner is built, stepped and shut down in
this one thread (``to_thread.run_sync`` would use any thread of a pool). The event loop
hands it a job and waits for the result without blocking; the thread wakes the waiting
task through the loop's thread-safe call-soon hand-off. A wait for a job in
progress is shielded from cancellation: the loop never leaves while the thread still
computes.

Handing a job to an idle thread also hands it the GIL. The thread wakes from its queue
in tens of microseconds, but then needs the GIL, which the event loop thread keeps for
as long as it runs Python (the request tasks sending the last step's tokens, say), so
under a server's load the next step would start late. So the loop blocks until the
thread has taken the job, for at most ``HANDOFF_SECONDS``; that wait releases the GIL,
the thread takes it, and the next step starts at once (figures in docs/benchmarks.md).
With asynchronous scheduling the next step is submitted while the previous one computes
(``submit``, then ``ModelJob.wait``), and the thread goes from one to the other without
a hand-off at all.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar, TypeVarTuple

import anyio
import anyio.from_thread
import anyio.lowlevel
import sniffio
import trio
import trio.lowlevel

__all__ = ["HANDOFF_SECONDS", "ModelJob", "ModelWorker", "open_model_worker"]

#: The longest the event loop blocks for an idle model thread to take a job.
HANDOFF_SECONDS = 0.001

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class ModelJob(Generic[T]):
    """One call submitted to the model thread: ``wait`` for its result."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        # Written by the model thread before ``_done`` is set: one value or one error.
        self._values: list[T] = []
        self._errors: list[BaseException] = []

    async def wait(self) -> T:
        """The call's result (or its exception). Cancellation waits for the call to
        finish first: the caller never leaves while the thread still runs it."""
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        if self._errors:
            raise self._errors[0]
        return self._values[0]


class ModelWorker:
    """Runs callables in a dedicated thread, one at a time, in submission order."""

    def __init__(self, name: str = "triollm-model") -> None:
        """Start the thread; call from the event loop that will wait on its jobs."""
        self._call_soon = _loop_call_soon()
        #: Jobs for the thread; None tells it to stop.
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        #: Jobs submitted whose completion the loop has not seen yet (event loop only).
        self._outstanding = 0
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    async def run_sync(self, function: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run ``function(*args)`` in the model thread and return its result (or raise
        its exception). Cancellation waits for the call to finish first."""
        return await self.submit(function, *args).wait()

    def submit(self, function: Callable[[*Ts], T], *args: *Ts) -> ModelJob[T]:
        """Queue ``function(*args)`` for the model thread, after the calls already
        queued. Call from the event loop; ``wait`` on the job for its result (every job
        should be waited on: that is how the loop knows the thread is done with it)."""
        result: ModelJob[T] = ModelJob()
        taken = threading.Event()

        def finished() -> None:  # on the event loop
            self._outstanding -= 1
            result._done.set()

        def job() -> None:
            taken.set()
            try:
                result._values.append(function(*args))
            except BaseException as error:  # handed to the waiting task
                result._errors.append(error)
            finally:
                self._call_soon(finished)

        idle = self._outstanding == 0
        self._outstanding += 1
        self._jobs.put(job)
        if idle:
            # Deliberately blocking, briefly: see the module's docstring.
            taken.wait(HANDOFF_SECONDS)
        return result

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    async def aclose(self) -> None:
        """Stop the thread once the jobs already queued have run, and join it."""
        self._jobs.put(None)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._thread.join)


def _loop_call_soon() -> Callable[[Callable[[], object]], object]:
    """A thread-safe "run this on the event loop soon" for the running loop.

    The model thread only needs to wake the waiting task, not wait for the loop to do
    it, so it uses the backend's own non-blocking hand-off (``call_soon_threadsafe``,
    ``TrioToken.run_sync_soon``); ``anyio.from_thread.run_sync`` is the fallback.
    """
    library = sniffio.current_async_library()
    if library == "asyncio":
        return asyncio.get_running_loop().call_soon_threadsafe
    if library == "trio":
        return trio.lowlevel.current_trio_token().run_sync_soon
    token = anyio.lowlevel.current_token()
    return lambda function: anyio.from_thread.run_sync(function, token=token)


@asynccontextmanager
async def open_model_worker(name: str = "triollm-model") -> AsyncIterator[ModelWorker]:
    """A model thread that lives exactly as long as the ``async with`` block."""
    worker = ModelWorker(name)
    try:
        yield worker
    finally:
        await worker.aclose()
