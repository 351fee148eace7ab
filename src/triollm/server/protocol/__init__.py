"""The OpenAI (and vLLM) request and response models, one module per API.

Requests are validated by pydantic (wrong types and out-of-range values are 400s) and
turned into ``SamplingParams`` or ``PoolingParams``, whose own validation names the
offending field. ``base`` holds what they share (unknown fields refused or reported,
the error shape, chat messages), ``sampling`` the sampling fields of completions and
chat; ``completion``, ``chat``, ``responses``, ``tokenize``, ``models`` and ``pooling``
one API each.
"""

from __future__ import annotations

from triollm.server.protocol.base import (
    REFUSED_FIELDS,
    ChatMessage,
    ChatTemplateFields,
    CheckedRequest,
    ErrorInfo,
    ErrorResponse,
    PromptLogprobs,
    PromptTokenLogprob,
    StreamOptions,
    UsageInfo,
)
from triollm.server.protocol.chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from triollm.server.protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
)
from triollm.server.protocol.models import (
    ModelCard,
    ModelList,
)
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
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from triollm.server.protocol.responses import (
    ResponsesRequest,
)
from triollm.server.protocol.sampling import (
    SamplingRequest,
)
from triollm.server.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = [
    "REFUSED_FIELDS",
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatMessageOut",
    "ChatStreamChoice",
    "ChatTemplateFields",
    "ChatTokenLogprob",
    "CheckedRequest",
    "ClassificationData",
    "ClassificationRequest",
    "ClassificationResponse",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ErrorInfo",
    "ErrorResponse",
    "GenerateRequest",
    "InputRequest",
    "ModelCard",
    "ModelList",
    "PoolingData",
    "PoolingFields",
    "PoolingRequest",
    "PoolingResponse",
    "PoolingUsage",
    "PromptLogprobs",
    "PromptTokenLogprob",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "ResponsesRequest",
    "SamplingRequest",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "UsageInfo",
]
