"""Streaming responses: OpenAI's server-sent events and the seed's NUL-delimited
``/generate`` stream.

A stream's producers read engine outputs and ``emit`` events; ``run_stream`` turns a
request that fails, or an engine that dies or shuts down, under them into a final error
event, and always closes the engine streams (aborting what is unfinished).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio
from fastapi.responses import Response

from triollm.engine.inputs import PromptType
from triollm.errors import EngineError
from triollm.outputs import RequestOutput
from triollm.sampling_params import SamplingParams
from triollm.server.errors import stream_error_event
from triollm.server.generation import (
    EngineStream,
    Submitted,
    close_all,
    final_outputs,
    reply,
    submit,
)
from triollm.server.middleware import Receive, Scope, Send
from triollm.server.protocol import ChatCompletionRequest, CompletionRequest
from triollm.server.state import ServerState

__all__ = ["Emit", "EventStream", "NullDelimitedStream", "StreamWriter", "respond",
           "run_stream"]

#: Sends one ``data:`` event: a JSON object, or a string as is (``[DONE]``).
Emit = Callable[[dict[str, Any] | str], Awaitable[None]]
StreamWriter = Callable[[Emit], Awaitable[None]]


class EventStream(Response):
    """A server-sent-events response written by ``writer(emit)``."""

    media_type = "text/event-stream"

    def __init__(self, writer: StreamWriter) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self.writer = writer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

        await self.writer(emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_stream(opened: list[EngineStream], emit: Emit,
                     producers: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
    """Run the producers; an engine failure becomes a final error event. Always closes
    the engine streams (aborting what is unfinished)."""
    try:
        try:
            async with anyio.create_task_group() as tasks:
                for producer in producers:
                    tasks.start_soon(producer)
        except BaseExceptionGroup as group:
            failures = [e for e in group.exceptions
                        if isinstance(e, EngineError)]
            if not failures or len(failures) != len(group.exceptions):
                raise
            await emit(stream_error_event(failures[0]))
        except EngineError as error:
            await emit(stream_error_event(error))
    finally:
        await close_all(opened)


class NullDelimitedStream(Response):
    """The seed's streaming /generate: cumulative texts as JSON, each followed by NUL.
    An engine that dies or shuts down mid-stream ends it with an ``{"error": ...}``
    chunk in OpenAI's shape."""

    def __init__(self, stream: EngineStream, first: RequestOutput) -> None:
        super().__init__(status_code=200, media_type="application/json")
        self.stream, self.first = stream, first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        async with aclosing(self.stream):
            output: RequestOutput | None = self.first
            while output is not None:
                prompt = output.prompt or ""
                chunk = json.dumps({"text": [prompt + c.text for c in output.outputs]})
                await send({"type": "http.response.body",
                            "body": chunk.encode() + b"\0", "more_body": True})
                try:
                    output = None if output.finished else await anext(self.stream, None)
                except EngineError as error:
                    await send({"type": "http.response.body", "more_body": True,
                                "body": json.dumps(stream_error_event(error)).encode() + b"\0"})
                    output = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def respond(state: ServerState, prompts: Sequence[PromptType], params: SamplingParams,
                  request_id: str, body: CompletionRequest | ChatCompletionRequest,
                  stream: Callable[[list[Submitted], list[EngineStream]], StreamWriter],
                  build: Callable[[list[RequestOutput]], Response],
                  trace: Mapping[str, str] | None = None) -> Response:
    """A generation request's response: every prompt submitted (bad input is a 400 before
    anything is sent), then either a stream of events written by ``stream`` or, once
    every prompt has finished, one reply made by ``build``. The engine streams are
    closed whatever happens (what is unfinished is aborted)."""
    opened: list[EngineStream] = []
    try:
        submitted = await submit(state, prompts, params, request_id, body, opened, trace)
        if body.stream:
            return EventStream(stream(submitted, opened))
        finals = await final_outputs(submitted)
    except BaseException:
        await close_all(opened)
        raise
    await close_all(opened)
    return await reply(lambda: build(finals), finals)
