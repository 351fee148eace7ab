"""triollm: an LLM serving engine with vLLM's techniques and a structured-concurrency core."""

from __future__ import annotations

from triollm.config import AsyncEngineArgs, EngineArgs
from triollm.llm import LLM
from triollm.model.runner import ModelRunner, RunnerOutput
from triollm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from triollm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "ModelRunner",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RunnerOutput",
    "SamplingParams",
]

__version__ = "0.1.0"
