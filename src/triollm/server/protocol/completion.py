"""``POST /v1/completions`` (and vLLM's minimal ``POST /generate``): the requests and the
reply."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from triollm.request_ids import random_request_id
from triollm.server.protocol.base import PromptLogprobs, UsageInfo
from triollm.server.protocol.sampling import SamplingRequest

__all__ = ["CompletionChoice", "CompletionLogprobs", "CompletionRequest",
           "CompletionResponse", "GenerateRequest"]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1, self.n):
            # vLLM's V1 engine dropped best_of too; n samples plus logprobs replace it.
            raise ValueError("best_of: not supported (use n and logprobs)")

class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_request_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None

class GenerateRequest(BaseModel):
    """vLLM's minimal ``POST /generate`` (the seed's api_server): a prompt, ``stream``,
    and any ``SamplingParams`` field."""

    model_config = ConfigDict(extra="allow")

    prompt: str
    stream: bool = False
