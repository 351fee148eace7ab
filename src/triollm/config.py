"""The engine's frozen configuration.

``EngineArgs`` (``triollm.engine.args``) is what users write;
``EngineArgs.create_engine_config()`` checks it once against the model's own
configuration and returns the ``EngineConfig`` defined here, which nothing changes
afterwards. This module imports nothing heavy: torch and transformers types appear only
in annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "DEMO_MODEL_NAME",
    "POLICIES",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
]

#: The built-in demo model: random weights, so it produces noise. It exists so that
#: ``triollm serve`` and ``LLM()`` work on a fresh offline machine.
DEMO_MODEL_NAME = "triollm/tiny-demo"

SchedulingPolicy = Literal["fcfs", "priority", "slo"]
POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority", "slo")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    served_model_name: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    seed: int
    trust_remote_code: bool
    enforce_eager: bool
    #: Intra-op threads on CPU; None: adapt to the cores other processes leave free.
    cpu_threads: int | None
    #: The most logprobs (sample or prompt) one request may ask for; -1: the vocabulary.
    max_logprobs: int
    hf_config: PretrainedConfig = field(repr=False, compare=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    kv_cache_space_gb: float


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: SchedulingPolicy


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
