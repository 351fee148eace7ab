"""SageMaker's ``POST /invocations``: a chat or completions request, told apart by its
body (``messages`` or ``prompt``), answered as that route answers it."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from triollm.server.errors import OpenAIError
from triollm.server.protocol import ChatCompletionRequest, CompletionRequest
from triollm.server.routes.chat import chat_completions
from triollm.server.routes.completions import completions

__all__ = ["router"]

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        raw: Any = json.loads(await request.body())
    except json.JSONDecodeError as error:
        raise OpenAIError(400, f"Invalid JSON body: {error}") from None
    if not isinstance(raw, dict) or not ("messages" in raw or "prompt" in raw):
        raise OpenAIError(400, "body: /invocations takes a chat request (messages) or a "
                               "completions request (prompt)")
    try:
        if "messages" in raw:
            return await chat_completions(ChatCompletionRequest.model_validate(raw), request)
        return await completions(CompletionRequest.model_validate(raw), request)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None
