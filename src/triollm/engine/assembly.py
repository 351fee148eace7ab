"""One engine's parts, put together the same way for ``LLM`` and ``AsyncLLMEngine``:
the tokenizer, the model runner, the ``EngineCore`` over them, and the request tracer.

``LLM`` builds the runner in the calling thread; ``AsyncLLMEngine`` builds it in its
model thread and the core on the event loop, so each part is its own call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from triollm.engine.core import EngineCore
from triollm.engine.tracing import RequestTracer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from triollm.config import EngineConfig
    from triollm.step import ModelRunner

__all__ = ["EngineParts", "assemble_core", "create_model_runner", "load_engine_tokenizer"]


def load_engine_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    """The tokenizer the config names, from the hub or a folder."""
    from triollm.model.loader import load_tokenizer

    return load_tokenizer(config.model.tokenizer,
                          trust_remote_code=config.model.trust_remote_code,
                          revision=config.model.tokenizer_revision,
                          download_dir=config.model.download_dir)


def create_model_runner(config: EngineConfig) -> ModelRunner:
    """Load the model and size its KV cache (seconds to minutes: the async engine calls
    this in its model thread)."""
    from triollm.model.runners import create_runner

    return create_runner(config)


@dataclass(frozen=True)
class EngineParts:
    core: EngineCore
    #: Exports each finished request's span (None without ``otlp_traces_endpoint``);
    #: its owner records the core's stats into it and shuts it down.
    tracer: RequestTracer | None


def assemble_core(config: EngineConfig, runner: ModelRunner,
                  tokenizer: PreTrainedTokenizerBase | None, *,
                  collect_stats: bool = False) -> EngineParts:
    """The core over a loaded runner, and the tracer the config asks for. The core
    gathers stats when ``collect_stats`` (someone logs them) or there is a tracer."""
    core = EngineCore(config, runner, tokenizer)
    endpoint = config.observability.otlp_traces_endpoint
    tracer = None if endpoint is None else RequestTracer(endpoint)
    core.collect_stats = collect_stats or tracer is not None
    return EngineParts(core, tracer)
