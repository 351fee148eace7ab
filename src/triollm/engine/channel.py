"""One request's path from the step loop to its consumer.

The step loop must never wait for a consumer, and a consumer that lags must not make
the engine hold one output per step for it. So a ``RequestChannel`` is a bounded anyio
memory object stream written with ``send_nowait``; behind a full buffer the newest
outputs fold into one pending output: DELTA outputs concatenate, CUMULATIVE ones
supersede sample by sample (an output carries only the samples that changed), FINAL_ONLY
ones supersede. Folding is in place (token ids and logprobs extended,
text pieces joined once when the consumer reads), so a stalled stream costs the loop
the size of each new output, not the size of its whole backlog.

A consumer with nothing to read waits on a one-shot wake-up that ``put`` sets: the
cheapest one the running backend has (anyio's blocking ``receive`` adds a checkpoint,
a task lookup and an ``Event`` per call; with thousands of streams that dominated
delivery).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import anyio
import sniffio
import trio
import trio.lowlevel

from triollm.outputs import (
    CompletionOutput,
    EngineOutput,
    PoolingRequestOutput,
    RequestOutput,
    SampleLogprobs,
)
from triollm.sampling_params import RequestOutputKind

__all__ = ["RequestChannel", "RequestChannels", "Wakeup", "wakeup_factory"]


class Wakeup(Protocol):
    """A one-shot wake-up: one waiter, set at most once (a cancellation point to wait)."""

    def set(self) -> None: ...

    async def wait(self) -> None: ...


class _FutureWakeup:
    """asyncio's cheapest wake-up: a bare future (anyio cancels a task by cancelling the
    future it awaits, exactly as with ``asyncio.Event``)."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def set(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        await self._future


class _TrioWakeup:
    """trio's cheapest wake-up: park the task with ``wait_task_rescheduled`` (how trio's
    own primitives are built), without an ``Event`` and its parking lot."""

    __slots__ = ("_is_set", "_task")

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None
        self._is_set = False

    def set(self) -> None:
        self._is_set = True
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        if self._is_set:
            await trio.lowlevel.checkpoint()
            return
        self._task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED


def wakeup_factory() -> Callable[[], Wakeup]:
    """The cheapest wake-up for the running backend; ``anyio.Event`` on any other.

    One is made per wait, so for thousands of streams the wrapper layers matter."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return _FutureWakeup
    if library == "trio":
        return _TrioWakeup
    return anyio.Event


class _CompletionBacklog:
    """One completion's unread DELTA outputs, folded."""

    __slots__ = ("cumulative_logprob", "finish_reason", "index", "logprobs", "stop_reason",
                 "text_parts", "token_ids")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(completion.logprobs)
        self.cumulative_logprob = completion.cumulative_logprob
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason

    def build(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text="".join(self.text_parts), token_ids=self.token_ids,
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class _DeltaBacklog:
    """A request's unread DELTA outputs, folded into one as they arrive: completions
    matched by index, the newest output's request fields, the first prompt logprobs."""

    __slots__ = ("_completions", "_latest", "_prompt_logprobs")

    def __init__(self, output: RequestOutput) -> None:
        self._completions: dict[int, _CompletionBacklog] = {}
        self._latest = output
        self._prompt_logprobs = output.prompt_logprobs
        self.add(output)

    def add(self, output: RequestOutput) -> None:
        self._latest = output
        if not self._prompt_logprobs:
            self._prompt_logprobs = output.prompt_logprobs
        for completion in output.outputs:
            backlog = self._completions.get(completion.index)
            if backlog is None:
                backlog = self._completions[completion.index] = _CompletionBacklog(
                    completion.index)
            backlog.add(completion)

    def build(self) -> RequestOutput:
        latest = self._latest
        return RequestOutput(
            request_id=latest.request_id,
            prompt=latest.prompt,
            prompt_token_ids=latest.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs,
            outputs=[self._completions[i].build() for i in sorted(self._completions)],
            finished=latest.finished,
            metrics=latest.metrics,
        )


def _superseded(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """``newer`` with the samples only ``older`` carried (CUMULATIVE outputs of ``n > 1``
    carry the samples that changed; each one's latest state wins)."""
    carried = {completion.index for completion in newer.outputs}
    kept = [completion for completion in older.outputs if completion.index not in carried]
    if not kept:
        return newer
    outputs = sorted([*kept, *newer.outputs], key=lambda completion: completion.index)
    return dataclasses.replace(newer, outputs=outputs,
                               prompt_logprobs=newer.prompt_logprobs or older.prompt_logprobs)


class RequestChannel:
    """The outputs of one request, from the step loop (``put``, ``fail``, ``close``,
    never blocking) to its one consumer (``get``)."""

    __slots__ = (
        "_buffered",
        "_make_wakeup",
        "_pending",
        "_wakeup",
        "closed",
        "engine_id",
        "error",
        "output_kind",
        "receive",
        "request_id",
        "send",
    )

    def __init__(self, request_id: str, output_kind: RequestOutputKind, buffer_size: int,
                 make_wakeup: Callable[[], Wakeup], engine_id: str = "") -> None:
        self.request_id = request_id
        #: The engine's id of the request (``EngineCore.add_request``'s result).
        self.engine_id = engine_id
        self.output_kind = output_kind
        self.send, self.receive = anyio.create_memory_object_stream[EngineOutput](buffer_size)
        self._pending: EngineOutput | _DeltaBacklog | None = None
        self.error: BaseException | None = None
        self.closed = False
        self._buffered = 0
        self._wakeup: Wakeup | None = None
        self._make_wakeup = make_wakeup

    def put(self, output: EngineOutput) -> None:
        """Deliver without blocking: behind a full buffer, fold into the pending output."""
        if self.closed:
            return
        pending = self._pending
        if pending is None:
            try:
                self.send.send_nowait(output)
                self._buffered += 1
            except anyio.WouldBlock:
                self._pending = output
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the consumer has gone; its request is aborted by generate()
        elif self.output_kind is not RequestOutputKind.DELTA:
            self._pending = (_superseded(pending, output)
                             if self.output_kind is RequestOutputKind.CUMULATIVE
                             and isinstance(pending, RequestOutput)
                             and isinstance(output, RequestOutput) else output)
        else:
            # only generation requests stream DELTA outputs
            assert isinstance(output, RequestOutput) and not isinstance(
                pending, PoolingRequestOutput)
            if not isinstance(pending, _DeltaBacklog):
                pending = self._pending = _DeltaBacklog(pending)
            pending.add(output)
        if output.finished:
            self.close()
        else:
            self._wake_consumer()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to the consumer after what it has not
        read yet)."""
        if not self.closed:
            self.error = error
            self.close()

    def close(self) -> None:
        self.closed = True
        self.send.close()
        self._wake_consumer()

    def _wake_consumer(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    @property
    def ready(self) -> bool:
        """Whether ``get`` returns (or raises) without waiting."""
        return bool(self._buffered or self._pending is not None or self.closed)

    async def get(self) -> EngineOutput:
        """The next output; ``StopAsyncIteration`` at the end, or the stream's error.

        Returns at once when an output is ready; otherwise waits (a cancellation point).
        """
        while not self.ready:
            wakeup = self._wakeup = self._make_wakeup()
            await wakeup.wait()
        if self._buffered:
            self._buffered -= 1
            return self.receive.receive_nowait()
        pending, self._pending = self._pending, None
        if isinstance(pending, _DeltaBacklog):
            return pending.build()
        if pending is not None:
            return pending
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    async def outputs(self, on_unfinished: Callable[[], None]
                      ) -> AsyncGenerator[EngineOutput, None]:
        """The outputs until the finished one; closing the generator before that calls
        ``on_unfinished`` (the request's abort). The channel is closed on every way out,
        so callers close the generator at once (``aclosing``)."""
        finished = False
        try:
            while True:
                try:
                    output = await self.get()
                except StopAsyncIteration:
                    finished = True
                    return
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self.receive.close()
            if not finished:
                on_unfinished()


class RequestChannels:
    """The open channels by request id: where the step loop delivers outputs."""

    def __init__(self, buffer_size: int) -> None:
        if buffer_size < 1:
            raise ValueError("stream_buffer_size: must be >= 1")
        self.buffer_size = buffer_size
        #: Set once the backend is known (the engine's ``run``).
        self.make_wakeup: Callable[[], Wakeup] = anyio.Event
        self._channels: dict[str, RequestChannel] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._channels

    def open(self, request_id: str, output_kind: RequestOutputKind, engine_id: str
             ) -> RequestChannel:
        if request_id in self._channels:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        channel = RequestChannel(request_id, output_kind, self.buffer_size, self.make_wakeup,
                                 engine_id)
        self._channels[request_id] = channel
        return channel

    def deliver(self, output: EngineOutput) -> bool:
        """Put ``output`` in its request's channel; True if it ended an open request
        (whose channel is then closed and dropped)."""
        channel = self._channels.get(output.request_id)
        if channel is None:
            return False
        channel.put(output)
        if output.finished:
            del self._channels[output.request_id]
        return output.finished

    def close(self, channel: RequestChannel, final_outputs: list[EngineOutput]) -> None:
        """Deliver ``final_outputs`` to ``channel`` and close it, if it is still the open
        channel of its request id."""
        if self._channels.get(channel.request_id) is channel:
            del self._channels[channel.request_id]
            for output in final_outputs:
                channel.put(output)
            channel.close()

    def fail(self, request_id: str, engine_id: str, error: BaseException) -> None:
        """End the open stream of one request (if it is still that request's) with
        ``error``."""
        channel = self._channels.get(request_id)
        if channel is not None and channel.engine_id == engine_id:
            del self._channels[request_id]
            channel.fail(error)

    def get(self, request_id: str) -> RequestChannel | None:
        return self._channels.get(request_id)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error``."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.fail(error)
