"""Submitting an API request's prompts to the engine and collecting their outputs.

Every prompt enters the engine and yields its first output before a response starts,
so bad input is a 400 and a dead engine a 503, never a broken stream. The caller owns
the engine streams (``opened``) and closes them with ``close_all``, which aborts
whatever is unfinished.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import anyio
from fastapi import Request

from triollm.engine.inputs import PromptType
from triollm.errors import EngineClosedError, EngineDeadError
from triollm.outputs import RequestOutput
from triollm.sampling_params import SamplingParams
from triollm.server.errors import bad_request, engine_unavailable
from triollm.server.protocol import ChatCompletionRequest, CompletionRequest, random_id
from triollm.server.state import ServerState

__all__ = ["EngineStream", "Submitted", "close_all", "final_outputs", "first_output",
           "outputs", "request_id_for", "submit"]

EngineStream = AsyncGenerator[RequestOutput, None]


@dataclass
class Submitted:
    """One engine request (one prompt of an API request) and its first output."""

    index: int
    stream: EngineStream
    first: RequestOutput


def request_id_for(request: Request, body: CompletionRequest | ChatCompletionRequest,
                   prefix: str) -> str:
    """The client's id (body, then ``X-Request-Id``), or a fresh one."""
    return body.request_id or request.headers.get("x-request-id") or random_id(prefix)


async def submit(state: ServerState, prompts: Sequence[PromptType], params: SamplingParams,
                 request_id: str, body: CompletionRequest | ChatCompletionRequest,
                 opened: list[EngineStream]) -> list[Submitted]:
    """Add every prompt to the engine and wait for each one's first output, so that bad
    input is a 400 before any response starts. Streams are appended to ``opened`` (the
    caller closes them, which aborts whatever is unfinished)."""
    if state.shutting_down:
        raise engine_unavailable(EngineClosedError("shutting down"))
    submitted = []
    for index, prompt in enumerate(prompts):
        sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
        stream = state.engine.generate(
            prompt, params, sub_id, priority=body.priority,
            is_latency_sensitive=body.latency_sensitive, slo=body.slo,
            ttft_slo=body.ttft_slo)
        opened.append(stream)
        submitted.append(Submitted(index, stream, await first_output(stream)))
    return submitted


async def first_output(stream: EngineStream) -> RequestOutput:
    """A new request's first output: adding it raises bad input as a 400, a dead or
    closed engine as a 503."""
    try:
        return await anext(stream)
    except ValueError as error:
        raise bad_request(error) from error
    except (EngineDeadError, EngineClosedError) as error:
        raise engine_unavailable(error) from error
    except StopAsyncIteration:
        raise engine_unavailable(EngineClosedError("ended early")) from None


async def outputs(item: Submitted) -> AsyncIterator[RequestOutput]:
    """Every output of one submitted prompt, its first included."""
    yield item.first
    if not item.first.finished:
        async for output in item.stream:
            yield output


async def close_all(streams: list[EngineStream]) -> None:
    """Close engine streams (aborting what is unfinished), even inside a cancelled scope."""
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()


async def final_outputs(submitted: list[Submitted]) -> list[RequestOutput]:
    """Each prompt's last output, in prompt order (the prompts run concurrently)."""
    finals: list[RequestOutput | None] = [None] * len(submitted)

    async def drain(item: Submitted) -> None:
        async for output in outputs(item):
            finals[item.index] = output

    async with anyio.create_task_group() as tasks:
        for item in submitted:
            tasks.start_soon(drain, item)
    return [f for f in finals if f is not None]
