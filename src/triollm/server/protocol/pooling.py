"""Request and response models of the pooling routes, with vLLM's names: embeddings
(OpenAI's), ``/pooling``, ``/classify``, ``/score`` and ``/rerank`` (Jina's and
Cohere's shape). vLLM's fields this server does not implement are refused unless
neutral, as on the generation routes."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from triollm.pooling_params import PoolingParams
from triollm.request_ids import random_request_id
from triollm.server.protocol.base import ChatMessage, ChatTemplateFields, CheckedRequest

__all__ = [
    "ClassificationData",
    "ClassificationRequest",
    "ClassificationResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "InputRequest",
    "PoolingData",
    "PoolingFields",
    "PoolingRequest",
    "PoolingResponse",
    "PoolingUsage",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
]

#: One input or several: text, token ids, or lists of either.
PoolingInput = str | list[str] | list[int] | list[list[int]]


class PoolingFields(CheckedRequest):
    """What every pooling request shares."""

    model: str | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    cache_salt: str | None = None  # accepted: a pooling request reads no prefix cache
    # vLLM's formats this server does not offer
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"

    def pooling_params(self, **extra: Any) -> PoolingParams:
        """Raises ``ValueError`` naming the field."""
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             use_activation=self.use_activation, **extra)


class InputRequest(PoolingFields, ChatTemplateFields):
    """A request whose prompts are ``input`` (completion style) or ``messages`` (chat
    style, through the chat template)."""

    input: PoolingInput | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = False


class EmbeddingRequest(InputRequest):
    """``POST /v1/embeddings``."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: the model's raw pooled output per input."""

    task: Literal["embed", "classify"] | None = None


class ClassificationRequest(InputRequest):
    """``POST /classify``."""


class ScoreRequest(PoolingFields):
    """``POST /score`` and ``/v1/score``: vLLM's spellings of the two sides
    (``text_1``/``text_2``, ``data_1``/``data_2``, ``queries`` with ``documents`` or
    ``items``)."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(PoolingFields):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina and Cohere)."""

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class _ListResponse(BaseModel):
    """What the list-shaped pooling replies share (``data`` is each one's own)."""

    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_request_id("embd"))
    data: list[EmbeddingData]


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_request_id("pool"))
    data: list[PoolingData]


class ClassificationData(BaseModel):
    index: int
    object: Literal["classification"] = "classification"
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_request_id("classify"))
    data: list[ClassificationData]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    id: str = Field(default_factory=lambda: random_request_id("score"))
    data: list[ScoreData]


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_request_id("rerank"))
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
