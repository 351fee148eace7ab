"""triollm: an LLM serving engine with vLLM's techniques and a structured-concurrency core."""

from __future__ import annotations

from triollm.engine.args import AsyncEngineArgs, EngineArgs
from triollm.engine.async_engine import AsyncLLMEngine
from triollm.engine.inputs import TextPrompt, TokensPrompt
from triollm.engine.stats import EngineStatistics
from triollm.errors import EngineClosedError, EngineDeadError, EngineError, RequestFailedError
from triollm.llm import LLM
from triollm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from triollm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from triollm.step import ModelRunner, RunnerOutput

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineStatistics",
    "Logprob",
    "ModelRunner",
    "PoolingParams",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RunnerOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]

__version__ = "0.1.0"
