"""The help texts of the engine flags ``triollm`` generates from ``EngineArgs``'s fields
(``--max-model-len``...), by field name."""

from __future__ import annotations

__all__ = ["ENGINE_FLAG_DEFAULTS", "ENGINE_FLAG_HELP", "engine_flag_help"]

ENGINE_FLAG_HELP: dict[str, str] = {
    "model": "model directory or hub id",
    "tokenizer": "tokenizer directory or hub id",
    "revision": "hub revision (branch, tag or commit) of the model",
    "tokenizer_revision": "hub revision of the tokenizer",
    "download_dir": "where hub downloads go",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), "
                         "vllm (none) or a directory holding a generation_config.json",
    "override_generation_config": 'sampling defaults as JSON, over --generation-config\'s '
                                  '(e.g. \'{"temperature": 0.5}\')',
    "enable_log_requests": "log each request (prompts included, up to --max-log-len)",
    "dtype": "auto (bf16 on CUDA or a bf16-capable CPU, else fp32), bfloat16, float32",
    "device": "auto, cpu or cuda",
    "max_num_batched_tokens": "token budget of one engine step",
    "num_gpu_blocks_override": "fix the number of KV-cache blocks on any device",
    "kv_cache_space_gb": "KV-cache memory on CPU, in GiB",
    "served_model_name": "the model name(s) the API answers to",
    "seed": "random seed of the engine",
    "max_model_len": "context length",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most sequences in one engine step",
    "enable_chunked_prefill": "split long prompts across steps",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "async_scheduling": "schedule each step while the previous one computes",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "trust_remote_code": "allow a model directory's own modeling code",
    "max_logprobs": "the most logprobs or prompt_logprobs one request may ask for; -1: "
                    "the whole vocabulary",
    "enforce_eager": "compile nothing, whatever --optimization-level says: on CPU the "
                     "model runs eagerly, decode attention gathers KV blocks for SDPA "
                     "instead of running the C kernel, so the KV cache is fp32 (twice a "
                     "bf16 model's), and pooling models attend with SDPA",
    "optimization_level": "-O0 to -O3 for short. 0: run the model's forward eagerly (the C "
                          "attention kernels still run); 1-3: on CPU, compile the forward "
                          "with torch.compile, which takes tens of seconds to minutes: the "
                          "server answers eagerly meanwhile and switches once it is built, "
                          "generate compiles first (docs/serving.md)",
    "cpu_threads": "compute threads on CPU (docs/api.md)",
    "tensor_parallel_size": "shard the model over this many ranks (processes)",
    "distributed_executor_backend": "who runs ranks 1...: mp (child processes) or ray "
                                    "(Ray actors; pip install 'triollm[ray]'); uni: one "
                                    "process",
    "distributed_timeout_seconds": "seconds a step waits for a tensor-parallel rank "
                                   "before the engine is dead",
    "scheduling_policy": "fcfs, priority or slo (docs/scheduling.md)",
    "disable_log_requests": "do not log requests (vLLM's older flag)",
    "disable_log_stats": "do not log engine statistics periodically",
    "max_log_len": "longest prompt prefix printed in request logs",
    "data_parallel_size": "engine replicas, each in its own process on its own share of "
                          "the cores, behind one API server; requests go to the one with "
                          "the fewest waiting and running (docs/serving.md)",
    "runner": "generate, pooling (embeddings, classifiers, cross-encoders: /v1/embeddings, "
              "/pooling, /classify, /score, /rerank) or auto (pooling for "
              "sentence-transformers folders, *ForSequenceClassification and bare encoders)",
    "convert": "what a pooling model computes: embed, classify, or auto",
    "task": "vLLM's older spelling of --runner/--convert: generate, embed, classify, score",
    "enable_lora": "serve LoRA adapters over the model (--lora-modules, or "
                   "/v1/load_lora_adapter with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    "max_loras": "distinct adapters one engine step may hold; requests for others wait "
                 "their turn",
    "max_lora_rank": "the highest adapter rank accepted",
    "max_cpu_loras": "adapters kept loaded in memory; others are "
                     "read again from their path when needed",
    "lora_dtype": "dtype of the adapters' weights: auto (the model's), bfloat16, float32",
    "quantization": "weight-only quantization of the linear layers at load, on CPU: int8 "
                    "(per channel) or int4 (grouped), triollm's own methods; or a "
                    "quantized checkpoint's own method (gptq, awq, compressed-tensors), "
                    "which is read from its config without this flag "
                    "(docs/quantization.md)",
    "quantization_group_size": "int4's input columns per group, a multiple of 32 (-1: "
                               "per channel); triollm's own flag",
    "lora_target_modules": "only these module names take adapters",
    "kv_cache_dtype": "the KV cache's element type: auto (the model's dtype), fp8_e5m2, "
                      "fp8 or fp8_e4m3 (8 bits, half a bf16 cache: twice the tokens in "
                      "the same memory; docs/quantization.md)",
    "otlp_traces_endpoint": "send a span per finished request to this OpenTelemetry "
                            "collector (OTLP; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc "
                            "or http/protobuf; needs pip install 'triollm[tracing]')",
    "collect_detailed_traces": "add model forward (model) and model runner (worker) time "
                               "to each span: model, worker or all",
    "reasoning_parser": "split chat answers' reasoning into reasoning_content (deepseek_r1, "
                        "qwen3, ...); structured outputs apply after it",
    "reasoning_parser_plugin": "a Python file that registers more reasoning parsers",
    "structured_outputs_config": 'structured outputs as JSON: backend (auto, xgrammar, '
                                 'guidance), disable_fallback, disable_any_whitespace, '
                                 'disable_additional_properties, reasoning_parser, '
                                 'enable_in_reasoning',
    "guided_decoding_backend": "older vLLM's backend flag: NAME[:no-fallback,...]",
    "speculative_config": 'speculative decoding as JSON: method ngram (prompt lookup: '
                          'prompt_lookup_min, prompt_lookup_max) or draft_model (model), '
                          'num_speculative_tokens, '
                          'disable_by_batch_size (e.g. \'{"method": "ngram", '
                          '"num_speculative_tokens": 3}\')',
    "pooler_config": 'overrides of the model\'s pooling as JSON: pooling_type (MEAN, CLS, '
                     'LAST), use_activation (normalize), dimensions '
                     '(e.g. \'{"pooling_type": "MEAN"}\')',
}

#: The defaults that ``EngineArgs`` resolves (its field is None, or means more than its
#: value), in words; tests/test_cli_help.py checks each against the resolved config.
ENGINE_FLAG_DEFAULTS: dict[str, str] = {
    "model": "triollm/tiny-demo, the built-in demo model: random weights",
    "tokenizer": "the model's",
    "tokenizer_revision": "--revision when the tokenizer is the model's",
    "download_dir": "the Hugging Face cache",
    "served_model_name": "--model",
    "max_model_len": "the model's",
    "max_num_batched_tokens": "2048; max(2048, --max-model-len) without chunked prefill "
                              "and for pooling models",
    "async_scheduling": "on for generation models on CUDA, off on CPU and for pooling "
                        "models",
    "num_gpu_blocks_override": "sized by --kv-cache-space-gb on CPU, "
                               "--gpu-memory-utilization on CUDA",
    "cpu_threads": "all usable cores, fewer while other processes keep some busy",
    "max_cpu_loras": "--max-loras",
    "distributed_executor_backend": "uni for one rank, mp for more",
    "lora_target_modules": "every linear layer but the LM head",
    "max_log_len": "the whole prompt",
    "structured_outputs_config": "backend auto",
}


def engine_flag_help(name: str, default: object) -> str:
    """The help of an engine flag with its one default: in words where the engine
    resolves it, else the parser's value (``%(default)s``, so that a default a ``VLLM_*``
    variable sets shows); none where unset means off. ``default`` is the field's, or for
    ``optimization_level`` the level the engine resolves None to."""
    text = ENGINE_FLAG_HELP.get(name, "")
    if name in ENGINE_FLAG_DEFAULTS:
        return f"{text} (default: {ENGINE_FLAG_DEFAULTS[name]})"
    if name == "optimization_level":  # None in EngineArgs: its DEFAULT_OPTIMIZATION_LEVEL
        return f"{text} (default: {default})"
    return text if default is None else f"{text} (default: %(default)s)"
