"""vLLM's minimal ``/generate`` (the seed's api_server): a prompt and sampling
parameters in (``structured_outputs`` as vLLM's object), the texts out, or a
NUL-delimited stream of them."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from triollm.engine.tracing import trace_headers_from
from triollm.request_ids import engine_request_id, random_request_id
from triollm.sampling_params import SamplingParams
from triollm.server.access_log import token_counts
from triollm.server.client_budget import note_engine_work
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    remember_request_id,
)
from triollm.server.generation import open_streams, outputs
from triollm.server.limits import MAX_N
from triollm.server.protocol import GenerateRequest
from triollm.server.protocol.sampling import string_list_problem
from triollm.server.protocol.structured import Constraint, StructuredOutputFields
from triollm.server.request import (
    GenerationRequest,
    ReplyOptions,
    check_limits,
    check_sizes,
    tokenized,
)
from triollm.server.state import server_state
from triollm.server.streaming import NullDelimitedStream

__all__ = ["router"]

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = server_state(request)
    state.require_accepting()
    state.require_generation()
    extra = dict(body.model_extra or {})
    if "output_kind" in extra:
        raise OpenAIError(400, "output_kind: chosen by the server (texts so far)",
                          param="output_kind")
    for name in ("stop", "bad_words"):
        problem = string_list_problem(extra.get(name))
        if problem is not None:
            raise OpenAIError(400, f"{name}: {problem}", param=name)
    constraint = _constraint(extra, state.engine.config.structured_outputs.backend)
    if constraint is not None:
        extra["structured_outputs"] = constraint.params
    try:
        params = SamplingParams(**extra)
    except TypeError as error:
        raise OpenAIError(400, f"unknown sampling parameter: {error}") from error
    except ValueError as error:
        raise bad_request(error) from error
    if params.n > MAX_N:
        raise OpenAIError(400, f"n: at most {MAX_N}, got {params.n}", param="n")
    check_sizes(state, params)
    prompt = await tokenized(state, body.prompt, None,
                           truncate_to=params.truncate_prompt_tokens)
    check_limits(state, prompt, params)
    note_engine_work(request.scope)
    request_id = remember_request_id(request, random_request_id("generate"))
    work = GenerationRequest(
        request_id=request_id, engine_ids=(engine_request_id(request_id),), prompts=(prompt,),
        params=params, stream=body.stream,
        reply=ReplyOptions(model=state.settings.served_model_names[0],
                           created=int(time.time())),
        trace_headers=trace_headers_from(request.headers),
        constraint_field=constraint.field if constraint else None,
        tokens=token_counts(request.scope))
    if work.stream:
        return NullDelimitedStream(state.engine, work)
    # CUMULATIVE outputs carry the samples that changed: the reply is each one's last.
    texts: dict[int, str] = {}
    async with open_streams(state.engine, work) as [item]:
        async for output in outputs(item):
            texts.update((c.index, c.text) for c in output.outputs)
    return JSONResponse({"text": [body.prompt + texts[i] for i in sorted(texts)]})


def _constraint(extra: dict[str, Any], backend: str) -> Constraint | None:
    """The body's ``structured_outputs`` object (vLLM's keys) as the request's
    constraint; a 400 naming the field."""
    box = extra.pop("structured_outputs", None)
    if box is None:
        return None
    try:
        return StructuredOutputFields(structured_outputs=box).structured_output(backend)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise OpenAIError(400, f"{where}: {problem['msg']}", param=where) from None
    except ValueError as error:
        raise bad_request(error) from error
