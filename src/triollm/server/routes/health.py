"""Health, version and Prometheus metrics (what load balancers and scrapers read), and
vLLM's ``/reset_prefix_cache``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

import triollm
from triollm.server.errors import OpenAIError
from triollm.server.metrics import CONTENT_TYPE
from triollm.server.state import server_state

__all__ = ["router"]

router = APIRouter()


_EMPTY_UNLESS_DEAD: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine runs (an empty body)"},
    503: {"description": "The engine is dead (an empty body)"}}


@router.get("/health", response_class=Response, responses=_EMPTY_UNLESS_DEAD)
async def health(request: Request) -> Response:
    """200 while the engine runs; 503 once it is dead."""
    engine = server_state(request).engine
    if engine.errored or not engine.is_running:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/ping", operation_id="ping_get", response_class=Response,
            responses=_EMPTY_UNLESS_DEAD)
@router.post("/ping", operation_id="ping_post", response_class=Response,
             responses=_EMPTY_UNLESS_DEAD)
async def ping(request: Request) -> Response:
    """SageMaker's health check: the same answer as ``/health``."""
    return await health(request)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": triollm.__version__}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    metrics = server_state(request).metrics
    return Response(metrics.render() if metrics is not None else b"",
                    media_type=CONTENT_TYPE)


@router.post("/reset_prefix_cache", response_class=Response,
             responses={200: {"description": "The prefix cache is empty (an empty body)"}})
async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prompt prefix: 200, or 409 while running requests hold
    cached blocks (try again when they finish)."""
    if not await server_state(request).engine.reset_prefix_cache():
        raise OpenAIError(409, "The prefix cache cannot be reset while requests hold its "
                               "blocks; try again when they finish.", type="ConflictError")
    return Response(status_code=200)
