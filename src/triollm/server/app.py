"""The OpenAI-compatible ASGI app: ``build_app(state)`` wires the pieces together.

::

    CORSMiddleware            answers preflights, adds its headers to every response
    └── RequestLifetime       API key, body limit, disconnect → cancel   (middleware.py)
        └── FastAPI           OpenAI-shaped errors                       (errors.py)
            └── routes/       completions, chat, responses, invocations (SageMaker),
                              tokenize, models, health, /generate, pooling
                              (embeddings, /pooling, /classify, /score, /rerank),
                              LoRA adapters (/v1/load_lora_adapter, when allowed)

Each route reads the shared ``ServerState`` (state.py) from the app and turns the body,
once, into a ``GenerationRequest`` (request.py); ``respond`` (streaming.py) answers it,
the engine streams owned by one ``async with open_streams`` (generation.py), and fields
are formatted by formatting.py.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

import triollm
from triollm.server.errors import add_error_handlers
from triollm.server.middleware import ASGIApp, RequestLifetime
from triollm.server.openapi import install_openapi
from triollm.server.routes import (
    chat,
    completions,
    generate,
    health,
    invocations,
    lora,
    models,
    pooling,
    responses,
    tokenize,
)
from triollm.server.state import ServerState

__all__ = ["build_app"]

logger = logging.getLogger(__name__)


def build_app(state: ServerState, *, api_docs: bool = True) -> ASGIApp:
    """The OpenAI-compatible app around a running engine (``api_docs``: serve /docs,
    /redoc and /openapi.json)."""
    docs: dict[str, Any] = {} if api_docs else {"docs_url": None, "redoc_url": None,
                                                 "openapi_url": None}
    app = FastAPI(title="triollm", version=triollm.__version__,
                  description="OpenAI-compatible LLM server", **docs)
    app.state.triollm = state
    install_openapi(app)
    add_error_handlers(app)
    for routes in (health, models, tokenize, completions, chat, responses, invocations,
                   generate, pooling):
        app.include_router(routes.router)
    if lora.runtime_updates_allowed():
        logger.warning("LoRA adapters may be loaded and unloaded at run time "
                       "(%s): /v1/load_lora_adapter reads any directory it is given; use "
                       "this only where every client is trusted.",
                       lora.RUNTIME_UPDATES_VARIABLE)
        app.include_router(lora.router)
    # CORS is outermost: it answers preflight requests itself (they carry no API key)
    # and adds its headers to every response, the 401s and 413s included.
    cors = state.settings.cors
    return cast(ASGIApp, CORSMiddleware(
        RequestLifetime(cast(ASGIApp, app), state), allow_origins=cors.allowed_origins,
        allow_credentials=cors.allow_credentials, allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers))
