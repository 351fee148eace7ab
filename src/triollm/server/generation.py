"""A generation request's engine streams, owned by one ``async with``.

``open_streams`` adds every prompt of a ``GenerationRequest`` to the engine at once and
waits for each one's first output before the caller answers, so that bad input is a
400 and a dead engine a 503, never a broken stream. Whoever enters it owns the streams:
the route for a reply, the response's body for a stream; on exit it closes them, which
aborts whatever is unfinished (a client that left, an error, a cancelled scope).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from fastapi.responses import Response

from triollm.errors import EngineClosedError, EngineError
from triollm.outputs import RequestOutput
from triollm.sampling_params import RequestOutputKind
from triollm.server.access_log import TokenCounts
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
    raise_first_answer,
)
from triollm.server.protocol.structured import renamed
from triollm.server.request import GenerationRequest

if TYPE_CHECKING:
    from triollm.server.engine_kind import ServedEngine

__all__ = ["EngineStream", "Submitted", "final_outputs", "first_output", "for_each_prompt",
           "open_streams", "outputs", "reply"]

#: Replies with more logprob entries than this are built and encoded in a worker
#: thread (a megabyte of JSON or so takes the loop tens of milliseconds).
OFF_LOOP_ENTRIES = 20_000

EngineStream = AsyncGenerator[RequestOutput, None]


@dataclass
class Submitted:
    """One engine request (one prompt of an API request) and its first output."""

    index: int
    stream: EngineStream
    first: RequestOutput
    #: The API request's token counts, which ``count`` adds this prompt's outputs to.
    tokens: TokenCounts = field(default_factory=TokenCounts)
    #: Whether outputs carry only new tokens (``RequestOutputKind.DELTA``).
    delta: bool = False

    def __post_init__(self) -> None:
        self.tokens.add_first(self.index, self.first, self.delta)

    def count(self, output: RequestOutput) -> RequestOutput:
        """``output``, counted in the request's tokens (every one after the first)."""
        self.tokens.add(self.index, output, self.delta)
        return output


@asynccontextmanager
async def open_streams(engine: ServedEngine, request: GenerationRequest
                       ) -> AsyncIterator[list[Submitted]]:
    """Every prompt of ``request`` in the engine, each with its first output, in prompt
    order; on exit every stream is closed (what is unfinished is aborted), even inside
    a cancelled scope."""
    streams = [engine.generate(
        prompt, request.params, engine_id, priority=request.priority,
        is_latency_sensitive=request.is_latency_sensitive, slo=request.slo,
        ttft_slo=request.ttft_slo, lora_request=request.lora_request,
        trace_headers=request.trace_headers)
        for prompt, engine_id in zip(request.prompts, request.engine_ids, strict=True)]
    try:
        try:
            firsts = await _first_outputs(streams, request)
        except OpenAIError as error:
            raise _naming_constraint(error, request.constraint_field) from error
        yield firsts
    finally:
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()


def _naming_constraint(error: OpenAIError, field: str | None) -> OpenAIError:
    """The engine's 400 about a request's constraint (it names ``structured_outputs``)
    naming the body's field instead, as the client wrote it."""
    if field is None or error.status != 400 or error.param is None \
            or error.param.split(".")[0] != "structured_outputs":
        return error
    return bad_request(renamed(ValueError(error.message), field))


async def _first_outputs(streams: list[EngineStream], request: GenerationRequest
                         ) -> list[Submitted]:
    delta = request.params.output_kind is RequestOutputKind.DELTA
    if len(streams) == 1:
        return [Submitted(0, streams[0], await first_output(streams[0]), request.tokens,
                          delta)]
    submitted: list[Submitted | None] = [None] * len(streams)

    async def start(index: int) -> None:
        submitted[index] = Submitted(index, streams[index], await first_output(streams[index]),
                                     request.tokens, delta)

    await for_each_prompt(len(streams), start)
    return [item for item in submitted if item is not None]


async def for_each_prompt(count: int,
                          one: Callable[[int], Coroutine[object, object, None]]) -> None:
    """``one(0) ... one(count - 1)`` concurrently, one task per prompt of a request; if
    any fails, the first error that is an answer for the client answers
    (``raise_first_answer``)."""
    try:
        async with anyio.create_task_group() as tasks:
            for index in range(count):
                tasks.start_soon(one, index)
    except BaseExceptionGroup as group:
        raise_first_answer(group)


async def first_output(stream: EngineStream) -> RequestOutput:
    """A new request's first output: adding it raises bad input as a 400, a dead or
    closed engine as a 503."""
    try:
        return await anext(stream)
    except ValueError as error:
        raise bad_request(error) from error
    except EngineError as error:
        raise engine_unavailable(error) from error
    except StopAsyncIteration:
        raise engine_unavailable(EngineClosedError("ended early")) from None


async def outputs(item: Submitted) -> AsyncIterator[RequestOutput]:
    """Every output of one submitted prompt, its first included."""
    yield item.first
    if not item.first.finished:
        async for output in item.stream:
            yield item.count(output)


async def final_outputs(submitted: list[Submitted]) -> list[RequestOutput]:
    """Each prompt's last output, in prompt order (the prompts run concurrently)."""
    finals: list[RequestOutput | None] = [None] * len(submitted)

    async def drain(item: Submitted) -> None:
        async for output in outputs(item):
            finals[item.index] = output

    try:
        async with anyio.create_task_group() as tasks:
            for item in submitted:
                tasks.start_soon(drain, item)
    except BaseExceptionGroup as group:
        # The request failed, or the engine died or shut down under it: as before it
        # started (500 or 503).
        stopped, _ = group.split(EngineError)
        if stopped is None or len(stopped.exceptions) != len(group.exceptions):
            raise
        raise engine_unavailable(stopped.exceptions[0]) from group
    return [f for f in finals if f is not None]


async def reply(build: Callable[[], Response], finals: Sequence[RequestOutput]) -> Response:
    """Build and encode a non-streaming reply: one that carries many logprob entries in
    a worker thread, so the event loop never stalls on it."""
    entries = sum(len(position) for o in finals for c in o.outputs
                  for position in c.logprobs or ())
    entries += sum(len(position or ()) * len(o.outputs) for o in finals
                   for position in o.prompt_logprobs or ())
    if entries <= OFF_LOOP_ENTRIES:
        return build()
    return await anyio.to_thread.run_sync(build)
