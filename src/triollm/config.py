"""The engine's frozen configuration.

``EngineArgs`` (``triollm.engine.args``) is what users write;
``EngineArgs.create_engine_config()`` checks it once against the model's own
configuration and returns the ``EngineConfig`` defined here, which nothing changes
afterwards. This module imports nothing heavy: torch and transformers types appear only
in annotations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "DEMO_MODEL_NAME",
    "EXECUTOR_BACKENDS",
    "POLICIES",
    "POOLING_TASKS",
    "CacheConfig",
    "DecodingConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "PoolerConfig",
    "PoolingTask",
    "RunnerKind",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]

#: The built-in demo model: random weights, so it produces noise. It exists so that
#: ``triollm serve`` and ``LLM()`` work on a fresh offline machine.
DEMO_MODEL_NAME = "triollm/tiny-demo"

#: ``generate``: a causal LM that samples tokens. ``pooling``: a model that returns one
#: vector (an embedding, or a classifier's label scores) per prompt.
RunnerKind = Literal["generate", "pooling"]
#: ``embed``: one vector per prompt. ``classify``: a sequence classifier's label
#: probabilities (a cross-encoder's score is ``classify`` over a text pair).
PoolingTask = Literal["embed", "classify"]
POOLING_TASKS: tuple[PoolingTask, ...] = ("embed", "classify")
PoolingType = Literal["MEAN", "CLS", "LAST"]
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
    #: Run the forward through ``torch.compile`` (CPU only; ``optimization_level`` > 0
    #: and not ``enforce_eager``).
    compile_model: bool
    #: Intra-op threads on CPU; None: adapt to the cores other processes leave free.
    cpu_threads: int | None
    #: The most logprobs (sample or prompt) one request may ask for; -1: the vocabulary.
    max_logprobs: int
    hf_config: PretrainedConfig = field(repr=False, compare=False)
    #: Hub revision of the weights and config, and of the tokenizer; None: the default.
    revision: str | None = None
    tokenizer_revision: str | None = None
    #: Where hub downloads go (transformers' ``cache_dir``); None: the hub cache.
    download_dir: str | None = None
    #: Sampling defaults for requests that leave a field out: ``SamplingParams``
    #: names (``max_tokens``, ``temperature``...), from the model's
    #: ``generation_config.json`` unless ``generation_config="vllm"``.
    generation_defaults: Mapping[str, Any] = field(default_factory=dict, compare=False)
    runner: RunnerKind = "generate"
    #: How a pooling model turns hidden states into its output (None for ``generate``).
    pooler: PoolerConfig | None = None
    #: The effective ``optimization_level`` (0 under ``enforce_eager``), for the log.
    optimization_level: int = 0
    #: With ``compile_model``: serve eagerly at once and switch to the compiled forward
    #: when a thread of the runner's has built it (the async engine), instead of
    #: compiling before the runner is returned (``LLM``).
    compile_in_background: bool = False
    #: Weight-only quantization of the linear layers at load; None: weights in ``dtype``.
    quantization: QuantizationConfig | None = None


@dataclass(frozen=True)
class QuantizationConfig:
    """``--quantization``: a method of model/quantization/methods.py and the input
    columns per group (-1: per channel) where the method groups them."""

    method: str
    group_size: int


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module after pooling: ``activation(x W^T + b)``,
    its weights in ``folder`` of the model (a subfolder name)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  #: ``identity``, ``tanh``, ``relu``, ``gelu`` or ``sigmoid``


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's pipeline after the transformer, resolved once from the model
    folder (sentence-transformers' ``modules.json``) and ``pooler_config``."""

    task: PoolingTask
    pooling_type: PoolingType
    #: The default of ``PoolingParams.use_activation``: normalize embeddings; sigmoid /
    #: softmax for classifiers.
    use_activation: bool
    #: The size of the embeddings (after any ``Dense``), or the number of labels.
    embedding_size: int
    dense_layers: tuple[DenseLayer, ...] = ()
    #: A default Matryoshka truncation (``pooler_config``'s ``dimensions``).
    dimensions: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    #: A classifier's label names, by index.
    labels: tuple[str, ...] = ()
    #: Where the pipeline came from, for the start-up log.
    source: str = "defaults"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    kv_cache_space_gb: float
    #: ``--kv-cache-dtype``: ``auto`` (the model's dtype) or an 8-bit format
    #: (model/quantization/kv_cache_dtype.py).
    cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: SchedulingPolicy
    #: Schedule each step while the previous one computes (the async engine only).
    async_scheduling: bool = False
    #: Distinct LoRA adapters among the running requests (None: LoRA is off).
    max_loras: int | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters over the base model (``enable_lora``), with vLLM's names."""

    #: Distinct adapters one step may hold (the runner keeps this many resident).
    max_loras: int
    #: The highest adapter rank accepted.
    max_lora_rank: int
    #: Adapters kept loaded in host memory, least recently used dropped first
    #: (>= ``max_loras``).
    max_cpu_loras: int
    #: The dtype the adapters' weights compute in.
    lora_dtype: torch.dtype
    #: Only these module names (``q_proj``, ``down_proj``...) take adapters; None: every
    #: linear layer of the decoder.
    target_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ObservabilityConfig:
    """Tracing (vLLM's ``ObservabilityConfig`` fields that triollm serves)."""

    #: Where finished requests' spans go over OTLP (None: no tracing).
    otlp_traces_endpoint: str | None = None
    #: Extra per-request timings on each span: ``model`` (time in the model forward),
    #: ``worker`` (time in the model runner); ``all`` is resolved into both.
    collect_detailed_traces: tuple[str, ...] = ()


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``--structured-outputs-config``: which grammar backend compiles requests'
    constraints, its options, and the reasoning parser whose end of reasoning the
    constraints wait for."""

    #: ``auto`` (llguidance, else xgrammar where installed and able), ``xgrammar`` or
    #: ``guidance``.
    backend: str = "auto"
    #: Refuse a constraint the chosen backend cannot compile instead of trying the other.
    disable_fallback: bool = False
    #: JSON without optional whitespace (every request's default).
    disable_any_whitespace: bool = False
    #: Objects allow no properties their schema does not list (every request's default).
    disable_additional_properties: bool = False
    #: The reasoning parser (``--reasoning-parser``): constraints apply once its
    #: reasoning has ended. None: from the first output token.
    reasoning_parser: str | None = None
    #: Constrain the reasoning too (vLLM's ``enable_in_reasoning``).
    enable_in_reasoning: bool = False


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``. Method ``ngram`` (prompt lookup): each decode
    proposes the tokens that followed the latest earlier occurrence of its sequence's
    last ``prompt_lookup_max`` ... ``prompt_lookup_min`` tokens. Method ``draft_model``:
    a small model of the target's tokenizer (``model``) proposes them. One forward of
    the target verifies them (docs/serving.md, "Speculative decoding")."""

    method: str
    #: The most draft tokens proposed per request and step.
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    #: A step speculates only while at most this many requests run (older vLLM's
    #: ``speculative_disable_by_batch_size``).
    disable_by_batch_size: int
    #: ``draft_model``: the draft model's path or hub id (None for ``ngram``).
    model: str | None = None


#: vLLM's older name for the same settings (``get_decoding_config()``).
DecodingConfig = StructuredOutputsConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    #: None unless ``enable_lora``.
    lora: LoRAConfig | None = None
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: None unless ``speculative_config`` is given.
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig())


#: ``distributed_executor_backend`` values: one process; child processes; Ray actors.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's parallelism settings inside one engine: the model's tensor-parallel ranks
    (model/parallel/) and who runs them (``distributed_executor_backend``)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    #: ``uni`` (one process, tensor_parallel_size 1), ``mp`` or ``ray``.
    distributed_executor_backend: str = "uni"
    #: Seconds a rank may keep a step's collective waiting before the engine is dead.
    worker_timeout_s: float = 5.0
    #: Each rank's cores (``VLLM_CPU_OMP_THREADS_BIND``'s ``|``-separated lists); None:
    #: the usable cores split evenly, unbound.
    rank_cpus: tuple[tuple[int, ...], ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
