"""vLLM's minimal ``/generate`` (the seed's api_server): a prompt and sampling
parameters in, the texts out, or a NUL-delimited stream of them."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triollm.errors import EngineClosedError
from triollm.sampling_params import SamplingParams
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
    remember_request_id,
)
from triollm.server.generation import (
    check_limits,
    close_all,
    engine_request_id,
    first_output,
    tokenized,
    trace_headers,
)
from triollm.server.limits import MAX_N
from triollm.server.protocol import GenerateRequest, random_id
from triollm.server.state import server_state
from triollm.server.streaming import NullDelimitedStream

__all__ = ["router"]

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = server_state(request)
    if state.shutting_down:
        raise engine_unavailable(EngineClosedError("shutting down"))
    state.require_generation()
    extra = dict(body.model_extra or {})
    if "output_kind" in extra:
        raise OpenAIError(400, "output_kind: chosen by the server (texts so far)",
                          param="output_kind")
    try:
        params = SamplingParams(**extra)
    except TypeError as error:
        raise OpenAIError(400, f"unknown sampling parameter: {error}") from error
    except ValueError as error:
        raise bad_request(error) from error
    if params.n > MAX_N:
        raise OpenAIError(400, f"n: at most {MAX_N}, got {params.n}", param="n")
    prompt = tokenized(state, body.prompt, None)
    check_limits(state, prompt, params)
    request_id = remember_request_id(request, random_id("generate"))
    stream = state.engine.generate(prompt, params, engine_request_id(request_id),
                                   trace_headers=trace_headers(request))
    try:
        first = await first_output(stream)
        if body.stream:
            return NullDelimitedStream(stream, first)
        final = first
        async for output in stream:
            final = output
    except BaseException:
        await close_all([stream])
        raise
    await close_all([stream])
    return JSONResponse({"text": [body.prompt + c.text for c in final.outputs]})
