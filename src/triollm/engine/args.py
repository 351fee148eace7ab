"""Engine arguments, with vLLM's names and meanings: ``EngineArgs`` checks its fields
and ``create_engine_config`` puts the frozen ``EngineConfig`` (``triollm.config``)
together from what engine/resolve.py makes of them and of the model's own
configuration (read through the model layer's loader, so it happens here rather than
in ``triollm.config``, which stays free of transformers).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triollm.config import (
    DEMO_MODEL_NAME,
    EXECUTOR_BACKENDS,
    POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from triollm.engine.resolve import (
    fail,
    generation_defaults,
    guided_decoding_backend,
    json_object,
    lora_config,
    observability_config,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_reasoning_parser,
    resolve_runner,
    structured_outputs_config,
)
from triollm.engine.speculative.config import speculative_config
from triollm.model.quantization.kv_cache_dtype import check_kv_cache_dtype
from triollm.model.quantization.methods import (
    DEFAULT_GROUP_SIZE,
    ON_THE_FLY_BITS,
    check_group_size,
    check_method,
)
from triollm.model.source import model_source_problem

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_OPTIMIZATION_LEVEL", "AsyncEngineArgs", "EngineArgs"]

#: vLLM's default level: compile the model (``optimization_level``).
DEFAULT_OPTIMIZATION_LEVEL = 2


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
    #: Shard the model over this many ranks (model/parallel/): ranks 1... run in child
    #: processes (``mp``) or Ray actors (``ray``).
    tensor_parallel_size: int = 1
    #: ``uni``, ``mp`` or ``ray``; None: ``uni`` for one rank, else ``mp`` (vLLM's).
    distributed_executor_backend: str | None = None
    #: Seconds a step's collective waits for a rank: a worker that died or hangs fails
    #: every request with ``EngineDeadError`` within about this long.
    distributed_timeout_seconds: float = 5.0
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
    #: Structured outputs: the grammar backend (``auto``, ``xgrammar``, ``guidance``)
    #: and its options, as a ``StructuredOutputsConfig``, a dict of its fields or their
    #: JSON (vLLM's ``--structured-outputs-config``).
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = None
    #: Older vLLM's spelling of the backend: ``NAME[:option,...]`` (options
    #: ``no-fallback``, ``disable-any-whitespace``, ``no-additional-properties``).
    guided_decoding_backend: str | None = None
    #: vLLM's --reasoning-parser: a name in ``ReasoningParserManager``. The server
    #: splits the reasoning out of chat answers, and structured outputs apply once it
    #: has ended.
    reasoning_parser: str | None = None
    #: vLLM's --reasoning-parser-plugin: a Python file that registers more parsers.
    reasoning_parser_plugin: str | None = None
    #: Weight-only quantization of the linear layers at load, on CPU: ``int8`` or
    #: ``int4`` (triollm's own names; model/quantization/methods.py), or a quantized
    #: checkpoint's own method (which it must match). None: the checkpoint's, if any.
    quantization: str | None = None
    #: ``int4``'s input columns per group (-1: per channel); triollm's own flag.
    quantization_group_size: int = DEFAULT_GROUP_SIZE
    #: Speculative decoding, as vLLM's dict or its JSON: ``method`` ``ngram`` (prompt
    #: lookup: ``prompt_lookup_min``/``max``) or ``draft_model`` (``model``),
    #: ``num_speculative_tokens``, ``disable_by_batch_size`` (engine/speculative/config.py).
    speculative_config: dict[str, Any] | str | None = None
    #: The KV cache's element type: ``auto`` (the model's dtype), ``fp8_e5m2``, or
    #: ``fp8``/``fp8_e4m3`` (8 bits: half a bf16 cache's memory; docs/quantization.md).
    kv_cache_dtype: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        """Validate every field and resolve the model's limits into a frozen config."""
        self._validate_ranges()
        structured = guided_decoding_backend(
            structured_outputs_config(self.structured_outputs_config),
            self.guided_decoding_backend)
        reasoning_parser = resolve_reasoning_parser(
            self.reasoning_parser or structured.reasoning_parser, self.reasoning_parser_plugin)
        structured = dataclasses.replace(structured, reasoning_parser=reasoning_parser)
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        for name, source in (("model", self.model), ("tokenizer", self.tokenizer)):
            problem = source and model_source_problem(
                source, revision=self.revision, download_dir=self.download_dir,
                probe_hub=True, tokenizer=name == "tokenizer")
            if problem:
                raise fail(name, problem)
        # Imported here so that building arguments (``triollm serve --help``) does not
        # load torch and transformers.
        from triollm.model.loader import load_hf_config

        hf_config = load_hf_config(self.model, trust_remote_code=self.trust_remote_code,
                                   revision=self.revision, download_dir=self.download_dir)
        hub = {"revision": self.revision, "download_dir": self.download_dir}
        runner, pooling_task = resolve_runner(self.model, hf_config, self.runner,
                                              self.convert, self.task, hub)
        max_model_len = resolve_max_model_len(self.model, hf_config, runner,
                                              self.max_model_len, hub)
        # A pooling model attends over whole prompts (bidirectionally, for encoders), so a
        # prompt runs in one step: no chunks, and no prefix cache (every position's
        # hidden state is pooled).
        chunked = self.enable_chunked_prefill and runner == "generate"
        if self.max_num_batched_tokens is None:
            budget = 2048 if chunked else max(max_model_len, 2048)
        else:
            budget = self.max_num_batched_tokens
        if not chunked and budget < max_model_len:
            raise fail("max_num_batched_tokens", f"{budget} is smaller than max_model_len="
                       f"{max_model_len}; raise it or enable chunked prefill" if
                        runner == "generate" else f"{budget} is smaller than max_model_len="
                        f"{max_model_len}; a pooling model computes a whole prompt per step")
        pooler = None
        if pooling_task is not None:
            from triollm.model.pooler import resolve_pooler

            pooler = resolve_pooler(self.model, hf_config, pooling_task,
                                    json_object("pooler_config", self.pooler_config),
                                    **hub)
        served = self.served_model_name
        if isinstance(served, list):
            served = served[0] if served else None
        level = (DEFAULT_OPTIMIZATION_LEVEL if self.optimization_level is None
                 else self.optimization_level)
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
            # the tensor-parallel collectives run eagerly (model/parallel/runner.py)
            compile_model=not self.enforce_eager and level > 0
            and self.tensor_parallel_size == 1,
            optimization_level=0 if self.enforce_eager else level,
            cpu_threads=self.cpu_threads,
            max_logprobs=self.max_logprobs,
            hf_config=hf_config,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision or (
                self.revision if self.tokenizer is None else None),
            download_dir=self.download_dir,
            generation_defaults=generation_defaults(
                self.model, self.generation_config, self.override_generation_config,
                revision=self.revision, download_dir=self.download_dir)
            if runner == "generate" else {},
            runner=runner,
            pooler=pooler,
            quantization=self._quantization(device),
        )
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching and runner == "generate",
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_space_gb=self.kv_cache_space_gb,
            cache_dtype=self._kv_cache_dtype(runner, device),
        )
        speculative = speculative_config(
            self.speculative_config, async_scheduling=bool(self.async_scheduling),
            runner=runner)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            async_scheduling=(runner == "generate" and device.type == "cuda"
                              and speculative is None
                              if self.async_scheduling is None else self.async_scheduling),
            policy=next(p for p in POLICIES if p == self.scheduling_policy),
            max_loras=self.max_loras if self.enable_lora else None,
        )
        return EngineConfig(model=model, cache=cache, scheduler=scheduler,
                            lora=lora_config(
                                enable_lora=self.enable_lora, max_loras=self.max_loras,
                                max_lora_rank=self.max_lora_rank,
                                max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                                target_modules=self.lora_target_modules, runner=runner,
                                device=device, dtype=dtype),
                            observability=observability_config(
                                self.otlp_traces_endpoint, self.collect_detailed_traces),
                            structured_outputs=structured, speculative=speculative,
                            parallel=self._parallel(runner, hf_config))

    def _parallel(self, runner: str, hf_config: Any) -> ParallelConfig:
        size = self.tensor_parallel_size
        backend = self.distributed_executor_backend or ("uni" if size == 1 else "mp")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise fail("distributed_executor_backend",
                       "'ray' needs Ray: pip install 'triollm[ray]'")
        if size > 1:
            from triollm.model.parallel.plan import tensor_parallel_problem

            problem = tensor_parallel_problem(
                hf_config, size, runner=runner, enable_lora=self.enable_lora,
                quantization=self.quantization, backend=backend)
            if problem is not None:
                raise fail("tensor_parallel_size", problem)
        return ParallelConfig(tensor_parallel_size=size, distributed_executor_backend=backend,
                              worker_timeout_s=self.distributed_timeout_seconds)

    def _quantization(self, device: torch.device) -> QuantizationConfig | None:
        if self.quantization is None:
            return None
        reason = check_method(self.quantization)
        if reason is None and self.quantization in ON_THE_FLY_BITS and device.type != "cpu":
            reason = f"{self.quantization} runs torch's CPU kernels; --device is {device.type}"
        if reason is not None:
            raise fail("quantization", reason)
        if (reason := check_group_size(self.quantization_group_size)) is not None:
            raise fail("quantization_group_size", reason)
        return QuantizationConfig(self.quantization, self.quantization_group_size)

    def _kv_cache_dtype(self, runner: str, device: torch.device) -> str:
        if self.kv_cache_dtype != "auto":
            if runner != "generate":
                raise fail("kv_cache_dtype", f"{self.kv_cache_dtype!r}: a pooling model "
                           f"keeps no KV cache")
            if device.type != "cpu":
                raise fail("kv_cache_dtype", f"{self.kv_cache_dtype!r} is built for the "
                           f"CPU's attention; --device is {device.type}")
        return self.kv_cache_dtype

    def _validate_ranges(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise fail(name, f"must be an integer >= 1, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise fail("model", "must be a non-empty model name or path")
        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value)
        if (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                or self.max_logprobs < -1):
            raise fail("max_logprobs", f"must be an integer >= -1 (-1: the whole "
                       f"vocabulary), got {self.max_logprobs!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise fail("gpu_memory_utilization", f"must be in (0, 1], got "
                       f"{self.gpu_memory_utilization}")
        if self.optimization_level is not None and (
                not isinstance(self.optimization_level, int)
                or isinstance(self.optimization_level, bool)
                or not 0 <= self.optimization_level <= 3):
            raise fail("optimization_level", f"must be 0, 1, 2 or 3, got "
                       f"{self.optimization_level!r}")
        if (reason := check_kv_cache_dtype(self.kv_cache_dtype)) is not None:
            raise fail("kv_cache_dtype", reason)
        if not self.kv_cache_space_gb > 0:
            raise fail("kv_cache_space_gb", f"must be > 0, got {self.kv_cache_space_gb}")
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise fail("distributed_executor_backend", f"must be one of {EXECUTOR_BACKENDS}, "
                       f"got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise fail("distributed_executor_backend", f"'uni' runs one rank; "
                       f"tensor_parallel_size={self.tensor_parallel_size} needs mp or ray")
        if not self.distributed_timeout_seconds > 0:
            raise fail("distributed_timeout_seconds", f"must be > 0, got "
                       f"{self.distributed_timeout_seconds}")
        if self.scheduling_policy not in POLICIES:
            raise fail("scheduling_policy", f"must be one of {POLICIES}, got "
                       f"{self.scheduling_policy!r}")
        positive_int("max_loras", self.max_loras)
        positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.async_scheduling not in (None, True, False):
            raise fail("async_scheduling", f"must be True, False or None, got "
                       f"{self.async_scheduling!r}")
        if not isinstance(self.enable_lora, bool):
            raise fail("enable_lora", f"must be True or False, got {self.enable_lora!r}")
        if not isinstance(self.seed, int):
            raise fail("seed", f"must be an integer, got {self.seed!r}")


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` plus the async engine's request logging options. As in vLLM,
    requests are logged only with ``enable_log_requests`` (``disable_log_requests``,
    vLLM's older spelling, still turns it off)."""

    enable_log_requests: bool = False
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    max_log_len: int | None = None
    #: Engine replicas, each in a process of its own, behind one ``EngineClient``
    #: (engine/process/client.py); ``AsyncLLMEngine`` itself runs one, in this process.
    data_parallel_size: int = 1

    def create_engine_config(self) -> EngineConfig:
        """``EngineArgs.create_engine_config``, with the model compiled in the background
        while the engine already serves eagerly (the async engine's start-up)."""
        if (isinstance(self.data_parallel_size, bool)
                or not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1):
            raise ValueError(f"data_parallel_size: must be a positive integer, got "
                             f"{self.data_parallel_size!r}")
        config = super().create_engine_config()
        return dataclasses.replace(config, model=dataclasses.replace(
            config.model, compile_in_background=True))
