"""Engine arguments, with vLLM's names and meanings, and their resolution into the
frozen ``EngineConfig`` (``triollm.config``).

Resolving reads the model's own configuration (through the model layer's loader), so
it lives here rather than in ``triollm.config``, which stays free of transformers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triollm.config import (
    DEMO_MODEL_NAME,
    POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    RunnerKind,
    SchedulerConfig,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from triollm.pooling_params import PoolingTask

__all__ = ["GENERATION_CONFIG_FIELDS", "AsyncEngineArgs", "EngineArgs", "cpu_supports_bf16",
           "resolve_device", "resolve_dtype", "sampling_defaults"]

logger = logging.getLogger(__name__)

#: The generation_config.json fields that become sampling defaults (vLLM's list);
#: ``max_new_tokens`` is ``max_tokens`` there.
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                            "temperature", "top_k", "top_p", "min_p", "max_new_tokens")

_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


#: vLLM's default level: compile the model (``optimization_level``).
DEFAULT_OPTIMIZATION_LEVEL = 2


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name}: {message}")


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise _fail("device", f"must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail("device", "CUDA was requested but torch sees no CUDA device")
    return torch.device(device)


def cpu_supports_bf16() -> bool:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX512", "AVX512_BF16", "AMX") or capability.startswith("AVX512")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32
    elif dtype in _DTYPE_NAMES:
        resolved = getattr(torch, _DTYPE_NAMES[dtype])
    else:
        raise _fail("dtype", f"must be 'auto', 'bfloat16' or 'float32' (or 'float16' on CUDA), "
                    f"got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise _fail("dtype", f"unsupported dtype {resolved}")
    if resolved == torch.float16 and device.type == "cpu":
        raise _fail("dtype", "float16 is refused on CPU (it runs about 100x slower than "
                    "bfloat16 there); use 'bfloat16' or 'float32'")
    return resolved


def sampling_defaults(generation_config: Mapping[str, Any],
                      override: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` defaults a generation config and its overrides give
    (``override`` wins; its keys must be ``GENERATION_CONFIG_FIELDS``)."""
    for name in override:
        if name not in GENERATION_CONFIG_FIELDS:
            raise _fail("override_generation_config", f"{name!r} is not a sampling "
                        f"default; expected some of {', '.join(GENERATION_CONFIG_FIELDS)}")
    merged = {**generation_config, **override}
    defaults = {name: merged[name] for name in GENERATION_CONFIG_FIELDS
                if merged.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    from triollm.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise _fail("generation_config", f"the sampling defaults {defaults} are invalid: "
                    f"{error}") from None
    return defaults


def _json_object(name: str, value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """A dict field that the command line gives as JSON text (None: empty)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise _fail(name, f"not JSON: {error}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(name, f"must be a JSON object, got {value!r}")
    return dict(value)


#: Encoders whose positions start after the padding index (RoBERTa's scheme), so
#: ``max_position_embeddings`` counts ``pad_token_id + 1`` positions no token uses.
_OFFSET_POSITION_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})


def _encoder_context_length(hf_config: PretrainedConfig, limit: int | None) -> int | None:
    if limit is not None and getattr(hf_config, "model_type", "") in _OFFSET_POSITION_TYPES:
        return limit - int(getattr(hf_config, "pad_token_id", 0) or 0) - 1
    return limit


def _context_length(hf_config: PretrainedConfig) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class EngineArgs:
    """Arguments of the engine, with vLLM's names and meanings.

    ``num_gpu_blocks_override`` fixes the number of KV-cache blocks on any device;
    otherwise the cache takes ``kv_cache_space_gb`` on CPU and
    ``gpu_memory_utilization`` of the GPU's memory on CUDA.
    """

    model: str = DEMO_MODEL_NAME
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    #: Schedule each step while the previous one computes (``AsyncLLMEngine`` and the
    #: server). None: on for generation models on CUDA, as vLLM's default; off for
    #: pooling models and on CPU, where the model's threads take every core and the
    #: event loop's work could not overlap with a step (docs/benchmarks.md).
    async_scheduling: bool | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_space_gb: float = 4.0
    trust_remote_code: bool = False
    enforce_eager: bool = False
    #: vLLM's ``-O`` levels: 0 runs the model eagerly; 1-3 (on CPU) compile its
    #: forward with ``torch.compile`` at start-up. None: ``DEFAULT_OPTIMIZATION_LEVEL``.
    optimization_level: int | None = None
    cpu_threads: int | None = None
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    scheduling_policy: str = "fcfs"
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None
    #: ``generate``, ``pooling`` (embeddings, classifiers, cross-encoders) or ``auto``:
    #: pooling for sentence-transformers folders, ``*ForSequenceClassification`` and
    #: bare encoders (``BertModel``), generate otherwise.
    runner: str = "auto"
    #: What a pooling model computes: ``embed`` or ``classify`` (``auto``: classify for
    #: ``*ForSequenceClassification``, embed otherwise).
    convert: str = "auto"
    #: Older vLLM's spelling of the two above: ``generate``, ``embed``, ``classify`` or
    #: ``score``.
    task: str | None = None
    #: Overrides of the model's pooling: ``pooling_type`` (MEAN, CLS, LAST),
    #: ``use_activation`` (``normalize``), ``dimensions``; a dict or JSON.
    pooler_config: dict[str, Any] | str | None = None
    #: Serve LoRA adapters over the base model (``LoRARequest`` on each request).
    enable_lora: bool = False
    #: Distinct adapters one step may hold; adapters past it wait their turn.
    max_loras: int = 1
    max_lora_rank: int = 16
    #: Adapters kept loaded in host memory (None: ``max_loras``).
    max_cpu_loras: int | None = None
    #: ``auto`` (the model's dtype), ``bfloat16`` or ``float32`` (``float16`` on CUDA).
    lora_dtype: str = "auto"
    #: Only these module names take adapters (None: every linear layer of the decoder).
    lora_target_modules: list[str] | None = None
    #: OpenTelemetry: send each finished request's span to this OTLP endpoint (the
    #: protocol from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: grpc or http/protobuf).
    otlp_traces_endpoint: str | None = None
    #: Extra timings on each span: ``model``, ``worker`` or ``all`` (a list, or one
    #: comma-separated string).
    collect_detailed_traces: list[str] | str | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate every field and resolve the model's limits into a frozen config."""
        self._validate_ranges()
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        # Imported here so that building arguments (``triollm serve --help``) does not
        # load torch and transformers.
        from triollm.model.loader import load_hf_config

        hf_config = load_hf_config(self.model, trust_remote_code=self.trust_remote_code,
                                   revision=self.revision, download_dir=self.download_dir)
        hub = {"revision": self.revision, "download_dir": self.download_dir}
        runner, pooling_task = self._resolve_runner(hf_config, hub)
        model_limit = _context_length(hf_config)
        if runner == "pooling":
            from triollm.model.pooler import max_seq_length

            model_limit = _encoder_context_length(hf_config, model_limit)
            st_limit = max_seq_length(self.model, **hub)
            if st_limit is not None and self.max_model_len is None:
                model_limit = min(model_limit or st_limit, st_limit)
        if self.max_model_len is None:
            if model_limit is None:
                raise _fail("max_model_len", "the model config names no context length; set it")
            max_model_len = model_limit
        else:
            max_model_len = self.max_model_len
            if model_limit is not None and max_model_len > model_limit:
                raise _fail("max_model_len", f"{max_model_len} exceeds the model's context "
                            f"length {model_limit}")
        # A pooling model attends over whole prompts (bidirectionally, for encoders), so a
        # prompt runs in one step: no chunks, and no prefix cache (every position's
        # hidden state is pooled).
        chunked = self.enable_chunked_prefill and runner == "generate"
        if self.max_num_batched_tokens is None:
            budget = 2048 if chunked else max(max_model_len, 2048)
        else:
            budget = self.max_num_batched_tokens
        if not chunked and budget < max_model_len:
            raise _fail("max_num_batched_tokens", f"{budget} is smaller than max_model_len="
                        f"{max_model_len}; raise it or enable chunked prefill" if
                        runner == "generate" else f"{budget} is smaller than max_model_len="
                        f"{max_model_len}; a pooling model computes a whole prompt per step")
        pooler = None
        if pooling_task is not None:
            from triollm.model.pooler import resolve_pooler

            pooler = resolve_pooler(self.model, hf_config, pooling_task,
                                    self._pooler_overrides(), **hub)
        served = self.served_model_name
        if isinstance(served, list):
            served = served[0] if served else None
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            served_model_name=served or self.model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            enforce_eager=self.enforce_eager,
            compile_model=not self.enforce_eager and (
                DEFAULT_OPTIMIZATION_LEVEL if self.optimization_level is None
                else self.optimization_level) > 0,
            cpu_threads=self.cpu_threads,
            max_logprobs=self.max_logprobs,
            hf_config=hf_config,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision or (
                self.revision if self.tokenizer is None else None),
            download_dir=self.download_dir,
            generation_defaults=self._generation_defaults() if runner == "generate" else {},
            runner=runner,
            pooler=pooler,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching and runner == "generate",
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_space_gb=self.kv_cache_space_gb,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            async_scheduling=(runner == "generate" and device.type == "cuda"
                              if self.async_scheduling is None else self.async_scheduling),
            policy=next(p for p in POLICIES if p == self.scheduling_policy),
            max_loras=self.max_loras if self.enable_lora else None,
        )
        return EngineConfig(model=model, cache=cache, scheduler=scheduler,
                            lora=self._lora_config(runner, device, dtype),
                            observability=self._observability_config())

    def _observability_config(self) -> ObservabilityConfig:
        endpoint = self.otlp_traces_endpoint
        detailed = self.collect_detailed_traces
        names = ([] if detailed is None else
                 [part.strip() for item in ([detailed] if isinstance(detailed, str)
                                            else detailed) for part in str(item).split(",")
                  if part.strip()])
        for name in names:
            if name not in ("model", "worker", "all"):
                raise _fail("collect_detailed_traces", f"expected model, worker or all, "
                            f"got {name!r}")
        if names and endpoint is None:
            raise _fail("collect_detailed_traces", "needs otlp_traces_endpoint "
                        "(--otlp-traces-endpoint) to be set")
        if endpoint is not None:
            if not isinstance(endpoint, str) or not endpoint.strip():
                raise _fail("otlp_traces_endpoint", f"must be a URL, got {endpoint!r}")
            from triollm.engine.tracing import exporter_protocol, tracing_unavailable_reason

            reason = tracing_unavailable_reason()
            if reason is not None:
                raise _fail("otlp_traces_endpoint", reason)
            exporter_protocol()  # a ValueError naming the variable, before anything starts
        modules = ("model", "worker") if "all" in names else tuple(dict.fromkeys(names))
        return ObservabilityConfig(otlp_traces_endpoint=endpoint,
                                   collect_detailed_traces=modules)

    def _lora_config(self, runner: RunnerKind, device: torch.device,
                     dtype: torch.dtype) -> LoRAConfig | None:
        if not self.enable_lora:
            for name in ("max_cpu_loras", "lora_target_modules"):
                if getattr(self, name) is not None:
                    raise _fail(name, "needs enable_lora=True")
            return None
        if runner != "generate":
            raise _fail("enable_lora", "LoRA adapters are served over generation models "
                        "(runner='generate'); this model is loaded with runner='pooling'")
        max_cpu_loras = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if max_cpu_loras < self.max_loras:
            raise _fail("max_cpu_loras", f"{max_cpu_loras} must be >= max_loras="
                        f"{self.max_loras}")
        lora_dtype = dtype if self.lora_dtype == "auto" else resolve_dtype(self.lora_dtype,
                                                                          device)
        targets = self.lora_target_modules
        if targets is not None:
            if (isinstance(targets, str) or not targets
                    or not all(isinstance(t, str) and t for t in targets)):
                raise _fail("lora_target_modules", f"must be a non-empty list of module "
                            f"names, got {targets!r}")
            targets = list(targets)
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=max_cpu_loras, lora_dtype=lora_dtype,
                          target_modules=None if targets is None else tuple(targets))

    def _resolve_runner(self, hf_config: PretrainedConfig, hub: dict[str, Any]
                        ) -> tuple[RunnerKind, PoolingTask | None]:
        """``runner``, ``convert`` and ``task`` (vLLM's older spelling) → the runner and,
        for pooling, its task."""
        runner, convert = self.runner, self.convert
        if runner not in ("auto", "generate", "pooling"):
            raise _fail("runner", f"must be 'auto', 'generate' or 'pooling', got {runner!r}")
        if convert not in ("auto", "none", "embed", "classify"):
            raise _fail("convert", f"must be 'auto', 'none', 'embed' or 'classify', got "
                        f"{convert!r}")
        if self.task not in (None, "auto"):
            task_runner = {"generate": "generate", "embed": "pooling", "embedding": "pooling",
                           "classify": "pooling", "score": "pooling"}.get(self.task)
            if task_runner is None:
                raise _fail("task", f"must be 'auto', 'generate', 'embed', 'classify' or "
                            f"'score', got {self.task!r}")
            if runner not in ("auto", task_runner):
                raise _fail("task", f"{self.task!r} contradicts runner={runner!r}")
            runner = task_runner
            if self.task in ("embed", "embedding", "classify", "score") and convert == "auto":
                convert = "classify" if self.task in ("classify", "score") else "embed"
        architectures = [str(a) for a in getattr(hf_config, "architectures", None) or []]
        classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
        if runner == "auto":
            from triollm.model.pooler import sentence_transformers_modules

            bare = bool(architectures) and all(
                a.endswith("Model") and not a.endswith("LMHeadModel") for a in architectures)
            pooling = (classifier or bare or convert in ("embed", "classify")
                       or sentence_transformers_modules(self.model, **hub) is not None)
            runner = "pooling" if pooling else "generate"
        if runner == "generate":
            if convert in ("embed", "classify"):
                raise _fail("convert", f"{convert!r} needs runner='pooling'")
            return "generate", None
        if convert in ("auto", "none"):
            return "pooling", "classify" if classifier else "embed"
        if convert == "classify" and not classifier:
            raise _fail("convert", f"'classify' needs a *ForSequenceClassification model "
                        f"(a classification head); {self.model!r} is {architectures}")
        return "pooling", "classify" if convert == "classify" else "embed"

    def _pooler_overrides(self) -> dict[str, Any]:
        return _json_object("pooler_config", self.pooler_config)

    def _generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults, as vLLM's ``--generation-config``: ``auto`` reads the
        model's generation_config.json, ``vllm`` uses none, a directory reads its file;
        ``override_generation_config`` applies on top."""
        from triollm.model.loader import load_generation_config

        override = _json_object("override_generation_config", self.override_generation_config)
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise _fail("generation_config", f"must be 'auto', 'vllm' or a directory, got "
                        f"{source!r}")
        if source == "vllm":
            found: dict[str, Any] = {}
        elif source == "auto":
            found = load_generation_config(self.model, revision=self.revision,
                                           download_dir=self.download_dir)
        else:
            found = load_generation_config(source)
            if not found:
                raise _fail("generation_config", f"{source!r} holds no "
                            f"generation_config.json")
        defaults = sampling_defaults(found, override)
        if defaults and source != "vllm":
            logger.warning("Default sampling parameters have been overridden by %s: %s. "
                           "If this is not intended, pass --generation-config vllm.",
                           "the model's generation_config.json" if source == "auto"
                           else source, defaults)
        return defaults

    def _validate_ranges(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(name, f"must be an integer >= 1, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise _fail("model", "must be a non-empty model name or path")
        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value)
        if (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                or self.max_logprobs < -1):
            raise _fail("max_logprobs", f"must be an integer >= -1 (-1: the whole "
                        f"vocabulary), got {self.max_logprobs!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _fail("gpu_memory_utilization", f"must be in (0, 1], got "
                        f"{self.gpu_memory_utilization}")
        if self.optimization_level is not None and (
                not isinstance(self.optimization_level, int)
                or isinstance(self.optimization_level, bool)
                or not 0 <= self.optimization_level <= 3):
            raise _fail("optimization_level", f"must be 0, 1, 2 or 3, got "
                        f"{self.optimization_level!r}")
        if not self.kv_cache_space_gb > 0:
            raise _fail("kv_cache_space_gb", f"must be > 0, got {self.kv_cache_space_gb}")
        if self.tensor_parallel_size != 1:
            raise _fail("tensor_parallel_size", f"only 1 is supported for now, got "
                        f"{self.tensor_parallel_size}")
        if self.scheduling_policy not in POLICIES:
            raise _fail("scheduling_policy", f"must be one of {POLICIES}, got "
                        f"{self.scheduling_policy!r}")
        positive_int("max_loras", self.max_loras)
        positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.async_scheduling not in (None, True, False):
            raise _fail("async_scheduling", f"must be True, False or None, got "
                        f"{self.async_scheduling!r}")
        if not isinstance(self.enable_lora, bool):
            raise _fail("enable_lora", f"must be True or False, got {self.enable_lora!r}")
        if not isinstance(self.seed, int):
            raise _fail("seed", f"must be an integer, got {self.seed!r}")


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` plus the async engine's request logging options. As in vLLM,
    requests are logged only with ``enable_log_requests`` (``disable_log_requests``,
    vLLM's older spelling, still turns it off)."""

    enable_log_requests: bool = False
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    max_log_len: int | None = None
