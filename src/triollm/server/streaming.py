"""Responses to a generation request: OpenAI's server-sent events, the seed's
NUL-delimited ``/generate`` stream, or one reply.

A streamed response owns its engine streams from its own body: it enters
``open_streams`` before it sends anything (bad input still gets a 400) and leaves it
when the last event is out or the client is gone, which aborts what is unfinished. Its
writer reads engine outputs and ``emit``s events; ``run_stream`` turns a request that
fails, or an engine that dies or shuts down, under them into a final error event.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.responses import Response

from triollm.errors import EngineError
from triollm.outputs import RequestOutput
from triollm.server.errors import stream_error_event
from triollm.server.generation import Submitted, final_outputs, open_streams, reply
from triollm.server.middleware import Receive, Scope, Send
from triollm.server.request import GenerationRequest

if TYPE_CHECKING:
    from triollm.server.engine_kind import ServedEngine

__all__ = ["NULL_DELIMITED_MEDIA_TYPE", "BuildReply", "Emit", "EventStream",
           "NullDelimitedStream", "WriteEvents", "respond", "run_stream"]

#: The media type of a streamed /generate (JSON objects, each followed by NUL).
NULL_DELIMITED_MEDIA_TYPE = "application/octet-stream"

#: Sends one ``data:`` event: a JSON object, or a string as is (``[DONE]``).
Emit = Callable[[dict[str, Any] | str], Awaitable[None]]
#: Writes a stream's events from its prompts' outputs.
WriteEvents = Callable[[GenerationRequest, list[Submitted], Emit], Awaitable[None]]
#: Builds the reply of a request that is not streamed, from each prompt's last output.
BuildReply = Callable[[GenerationRequest, list[RequestOutput]], Response]


class _OwnedStream(Response):
    """A streamed response whose body owns the request's engine streams."""

    def __init__(self, engine: ServedEngine, request: GenerationRequest,
                 media_type: str) -> None:
        super().__init__(status_code=200, media_type=media_type)
        self.engine = engine
        self.request = request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Refused before anything is sent, the request's OpenAIError is answered by the
        # app's error handlers, as a route's is (they wrap the response's call too).
        async with open_streams(self.engine, self.request) as submitted:
            await self.write(submitted, send)

    async def write(self, submitted: list[Submitted], send: Send) -> None:
        raise NotImplementedError


class EventStream(_OwnedStream):
    """A server-sent-events response written by ``events``."""

    def __init__(self, engine: ServedEngine, request: GenerationRequest,
                 events: WriteEvents) -> None:
        super().__init__(engine, request, "text/event-stream")
        self.events = events

    async def write(self, submitted: list[Submitted], send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        # Only the producers of several prompts contend for it. Taken uncontended, it
        # skips the yield to the scheduler (2.6 µs an event on trio); the send yields.
        lock = anyio.Lock(fast_acquire=True)

        async def emit(data: dict[str, Any] | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            async with lock:
                await send({"type": "http.response.body",
                            "body": f"data: {text}\n\n".encode(), "more_body": True})

        await self.events(self.request, submitted, emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_stream(emit: Emit, producers: list[Callable[[], Coroutine[Any, Any, None]]]
                     ) -> None:
    """Run the producers; an engine failure becomes a final error event."""
    try:
        async with anyio.create_task_group() as tasks:
            for producer in producers:
                tasks.start_soon(producer)
    except BaseExceptionGroup as group:
        failures = [e for e in group.exceptions if isinstance(e, EngineError)]
        if not failures or len(failures) != len(group.exceptions):
            raise
        await emit(stream_error_event(failures[0]))
    except EngineError as error:
        await emit(stream_error_event(error))


class NullDelimitedStream(_OwnedStream):
    """The seed's streaming /generate: cumulative texts as JSON, each followed by NUL
    (so not one JSON document: ``application/octet-stream``). An engine that dies or
    shuts down mid-stream ends it with an ``{"error": ...}`` chunk in OpenAI's shape."""

    def __init__(self, engine: ServedEngine, request: GenerationRequest) -> None:
        super().__init__(engine, request, NULL_DELIMITED_MEDIA_TYPE)

    async def write(self, submitted: list[Submitted], send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", NULL_DELIMITED_MEDIA_TYPE.encode())]})
        [item] = submitted
        output: RequestOutput | None = item.first
        # A CUMULATIVE output carries the samples that changed; each chunk has them all.
        texts: dict[int, str] = {}
        while output is not None:
            prompt = output.prompt or ""
            texts.update((c.index, c.text) for c in output.outputs)
            chunk = json.dumps({"text": [prompt + texts[i] for i in sorted(texts)]})
            await send({"type": "http.response.body",
                        "body": chunk.encode() + b"\0", "more_body": True})
            try:
                output = None if output.finished else await anext(item.stream, None)
                if output is not None:
                    item.count(output)
            except EngineError as error:
                await send({"type": "http.response.body", "more_body": True,
                            "body": json.dumps(stream_error_event(error)).encode() + b"\0"})
                output = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def respond(engine: ServedEngine, request: GenerationRequest, events: WriteEvents,
                  build: BuildReply) -> Response:
    """A generation request's response: a stream of events written by ``events`` (its
    body owns the engine streams), or, once every prompt has finished, one reply made by
    ``build``. Either way, bad input is a 400 before anything is sent, and the engine
    streams are closed whatever happens (what is unfinished is aborted)."""
    if request.stream:
        return EventStream(engine, request, events)
    async with open_streams(engine, request) as submitted:
        finals = await final_outputs(submitted)
    return await reply(lambda: build(request, finals), finals)
