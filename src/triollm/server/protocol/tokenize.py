"""``/tokenize`` and ``/detokenize``: requests and replies."""

from __future__ import annotations

from pydantic import BaseModel

from triollm.server.protocol.base import ChatMessage, ChatTemplateFields, CheckedRequest

__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse"]


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(CheckedRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
