"""The pooling routes: ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``
(``/v1/score``) and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``), as vLLM serves them.

Every input of a request enters the engine at once, as its own pooling request under
the server's id for it; the route waits for all of them. A bad input is a 400 naming
it and ends the others; a client that disconnects cancels the route, and closing each
engine stream aborts what has not finished.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.entrypoints.score_utils import plan_scoring, score_pairs
from triollm.errors import EngineClosedError, EngineError
from triollm.outputs import PoolingOutput, PoolingRequestOutput
from triollm.pooling_params import PoolingParams, PoolingTask
from triollm.sampling_params import check_text
from triollm.server.errors import (
    OpenAIError,
    bad_request,
    engine_unavailable,
)
from triollm.server.generation import for_each_prompt
from triollm.server.protocol.pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    InputRequest,
    PoolingData,
    PoolingFields,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from triollm.server.request import EncodeRequest, encode_request, request_id_for
from triollm.server.state import ChatRendering, ServerState, server_state

__all__ = ["router"]

router = APIRouter()

Pooled = PoolingRequestOutput[PoolingOutput]


# -- shared steps -------------------------------------------------------------------------


def _checked(state: ServerState, body: PoolingFields, route: str,
             task: PoolingTask | None) -> str:
    model = state.check_model(body.model)
    state.require_pooling(route, task)
    state.check_fields(body)
    return model


def _params(body: PoolingFields, **extra: Any) -> PoolingParams:
    try:
        return body.pooling_params(**extra)
    except ValueError as error:
        raise bad_request(error) from error


async def _prompts(state: ServerState, body: InputRequest) -> list[PromptType]:
    """``input`` (texts or token ids) or ``messages`` (through the chat template), as
    token ids (texts tokenized in a worker thread)."""
    if body.messages is not None:
        if body.input is not None:
            raise OpenAIError(400, "input: give either input or messages, not both",
                              param="input")
        return [TokensPrompt(prompt_token_ids=await state.render_chat_or_400(
            body.messages, ChatRendering(
                chat_template=body.chat_template, add_generation_prompt=body.generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens, tools=body.tools,
                documents=body.documents, chat_template_kwargs=body.chat_template_kwargs)))]
    data = body.input
    if data is None:
        raise OpenAIError(400, "input: required (or messages)", param="input")
    items: Sequence[Any] = [data] if isinstance(data, str) else data
    if not items:
        raise OpenAIError(400, "input: must not be empty", param="input")
    if all(isinstance(item, int) for item in items):
        items = [list(items)]  # one prompt of token ids
    prompts: list[PromptType] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            try:
                check_text(f"input[{index}]", item)
            except ValueError as error:
                raise bad_request(error) from error
            if not item:
                raise OpenAIError(400, f"input[{index}]: must not be empty",
                                  param=f"input[{index}]")
            prompts.append(TokensPrompt(prompt_token_ids=await state.encode(
                item, body.add_special_tokens, field=f"input[{index}]",
                truncate_to=body.truncate_prompt_tokens, generating=False)))
        elif isinstance(item, list):
            prompts.append(TokensPrompt(prompt_token_ids=list(item)))
        else:
            raise OpenAIError(400, f"input[{index}]: expected text or token ids",
                              param=f"input[{index}]")
    return prompts


async def _encode_all(state: ServerState, work: EncodeRequest) -> list[Pooled]:
    """Every prompt into the engine at once; their outputs in prompt order."""
    count = len(work.prompts)
    results: list[Pooled | None] = [None] * count

    async def one(index: int) -> None:
        try:
            async with aclosing(state.engine.encode(
                    work.prompts[index], work.params, work.engine_ids[index],
                    priority=work.priority, trace_headers=work.trace_headers)) as stream:
                async for output in stream:
                    results[index] = output
        except ValueError as error:
            raise _for_input(bad_request(error), index, count) from error
        except EngineError as error:
            raise engine_unavailable(error) from error
        result = results[index]
        if result is None:
            raise engine_unavailable(EngineClosedError("ended early"))
        work.tokens.prompt_tokens += len(result.prompt_token_ids)

    await for_each_prompt(count, one)
    return [result for result in results if result is not None]


def _for_input(error: OpenAIError, index: int, count: int) -> OpenAIError:
    """A prompt's error says which input it was, when there are several."""
    if count == 1:
        return error
    return OpenAIError(error.status, f"input[{index}]: {error.message}", type=error.type,
                       param=error.param)


def _usage(outputs: Sequence[Pooled]) -> PoolingUsage:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # OpenAI's encoding: the float32 values' little-endian bytes
        data = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return [float(value) for value in vector.tolist()]


# -- routes ---------------------------------------------------------------------------------


async def _vectors(body: EmbeddingRequest, request: Request, route: str,
                   task: PoolingTask | None, prefix: str) -> tuple[str, str, list[Pooled]]:
    """An embeddings or pooling request, run: its model name, id and outputs."""
    state = server_state(request)
    model = _checked(state, body, route, task)
    params = _params(body, dimensions=body.dimensions, normalize=body.normalize, task=task)
    request_id = request_id_for(request, body, prefix)
    work = encode_request(state, request, body, await _prompts(state, body), params,
                          request_id)
    return model, request_id, await _encode_all(state, work)


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    model, request_id, outputs = await _vectors(body, request, "/v1/embeddings", "embed",
                                                "embd")
    data = [EmbeddingData(index=i, embedding=_encoded(o.outputs.data, body.encoding_format))
            for i, o in enumerate(outputs)]
    return JSONResponse(EmbeddingResponse(id=request_id, model=model, data=data,
                                          usage=_usage(outputs)).model_dump())


@router.post("/pooling", response_model=PoolingResponse)
async def pooling(body: PoolingRequest, request: Request) -> JSONResponse:
    model, request_id, outputs = await _vectors(body, request, "/pooling", body.task, "pool")
    data = [PoolingData(index=i, data=_encoded(o.outputs.data, body.encoding_format))
            for i, o in enumerate(outputs)]
    return JSONResponse(PoolingResponse(id=request_id, model=model, data=data,
                                        usage=_usage(outputs)).model_dump())


@router.post("/classify", response_model=ClassificationResponse)
async def classify(body: ClassificationRequest, request: Request) -> JSONResponse:
    state = server_state(request)
    model = _checked(state, body, "/classify", "classify")
    labels = state.require_pooling("/classify").labels
    request_id = request_id_for(request, body, "classify")
    outputs = await _encode_all(state, encode_request(state, request, body,
                                                      await _prompts(state, body),
                                                      _params(body),
                                                      request_id))
    data = []
    for index, output in enumerate(outputs):
        probs = [float(p) for p in output.outputs.data.tolist()]
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=index, label=labels[best] if labels else None,
                                       probs=probs, num_classes=len(probs)))
    return JSONResponse(ClassificationResponse(id=request_id, model=model, data=data,
                                               usage=_usage(outputs)).model_dump())


async def _scores(state: ServerState, request: Request, body: PoolingFields,
                  pairs: list[tuple[str, str]], request_id: str
                  ) -> tuple[list[float], PoolingUsage]:
    """Each pair's score: a cross-encoder reads the pair as one prompt; an embedding
    model compares the two embeddings."""
    pooler = state.require_pooling("score")
    params = _params(body)
    try:
        plan = await state.offload.run(functools.partial(
            plan_scoring, pooler, state.engine.tokenizer, pairs,
            max_length=state.engine.config.model.max_model_len,
            truncate_prompt_tokens=body.truncate_prompt_tokens))
    except ValueError as error:
        raise bad_request(error) from error
    prompts = [TokensPrompt(prompt_token_ids=await state.encode(
        prompt, truncate_to=body.truncate_prompt_tokens, generating=False))
        if isinstance(prompt, str) else prompt for prompt in plan.prompts]
    outputs = await _encode_all(state, encode_request(state, request, body, prompts,
                                                      params, request_id))
    return plan.scores([output.outputs.data for output in outputs]), _usage(outputs)


def _score_sides(body: ScoreRequest) -> tuple[Any, Any, tuple[str, str]]:
    second_of_queries = "items" if body.items is not None else "documents"
    for first, second in (("text_1", "text_2"), ("data_1", "data_2"),
                          ("queries", second_of_queries)):
        a, b = getattr(body, first), getattr(body, second)
        if a is not None or b is not None:
            if a is None or b is None:
                missing = first if a is None else second
                raise OpenAIError(400, f"{missing}: required with "
                                       f"{second if a is None else first}", param=missing)
            return a, b, (first, second)
    raise OpenAIError(400, "text_1: required (with text_2; or data_1 and data_2, or "
                           "queries and documents)", param="text_1")


@router.post("/score", response_model=ScoreResponse)
@router.post("/v1/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, request: Request) -> JSONResponse:
    state = server_state(request)
    model = _checked(state, body, "/score", None)
    first, second, names = _score_sides(body)
    try:
        pairs = score_pairs(first, second, names=names)
    except ValueError as error:
        raise bad_request(error) from error
    request_id = request_id_for(request, body, "score")
    scores, usage = await _scores(state, request, body, pairs, request_id)
    data = [ScoreData(index=i, score=value) for i, value in enumerate(scores)]
    return JSONResponse(ScoreResponse(id=request_id, model=model, data=data,
                                      usage=usage).model_dump())


@router.post("/rerank", response_model=RerankResponse)
@router.post("/v1/rerank", response_model=RerankResponse)
@router.post("/v2/rerank", response_model=RerankResponse)
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    state = server_state(request)
    model = _checked(state, body, "/rerank", None)
    documents = [d.text if isinstance(d, RerankDocument) else d for d in body.documents]
    if body.top_n is not None and body.top_n < 0:
        raise OpenAIError(400, f"top_n: must be >= 0, got {body.top_n}", param="top_n")
    try:
        pairs = score_pairs(body.query, documents, names=("query", "documents"))
    except ValueError as error:
        raise bad_request(error) from error
    request_id = request_id_for(request, body, "rerank")
    scores, usage = await _scores(state, request, body, pairs, request_id)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:  # None or 0: every document, as vLLM does
        order = order[: body.top_n]
    results = [RerankResult(
        index=i, relevance_score=scores[i],
        document=RerankDocument(text=documents[i]) if body.return_documents else None)
        for i in order]
    return JSONResponse(RerankResponse(id=request_id, model=model, usage=usage,
                                       results=results).model_dump())
