"""triollm: an LLM serving engine with vLLM's techniques and a structured-concurrency core."""

from __future__ import annotations

from triollm.engine.args import AsyncEngineArgs, EngineArgs
from triollm.engine.async_engine import AsyncLLMEngine
from triollm.engine.inputs import TextPrompt, TokensPrompt
from triollm.engine.stats import EngineStatistics
from triollm.errors import EngineClosedError, EngineDeadError, EngineError, RequestFailedError
from triollm.llm import LLM
from triollm.lora.request import LoRARequest
from triollm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import RequestOutputKind, SamplingParams
from triollm.step import ModelRunner, RunnerOutput

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineStatistics",
    "LoRARequest",
    "Logprob",
    "ModelRunner",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RunnerOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "TextPrompt",
    "TokensPrompt",
]

__version__ = "0.1.0"
