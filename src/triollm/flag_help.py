"""The help texts of the engine flags ``triollm`` generates from ``EngineArgs``'s fields
(``--max-model-len``...), by field name."""

from __future__ import annotations

__all__ = ["ENGINE_FLAG_HELP"]

ENGINE_FLAG_HELP: dict[str, str] = {
    "model": "model directory or hub id (default: the built-in demo model, random weights)",
    "tokenizer": "tokenizer directory or hub id (default: the model's)",
    "revision": "hub revision (branch, tag or commit) of the model",
    "tokenizer_revision": "hub revision of the tokenizer (default: --revision when the "
                          "tokenizer is the model's)",
    "download_dir": "where hub downloads go (default: the Hugging Face cache)",
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
    "served_model_name": "the model name(s) the API answers to (default: --model)",
    "seed": "random seed of the engine",
    "max_model_len": "context length (default: the model's)",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most sequences in one engine step",
    "enable_chunked_prefill": "split long prompts across steps",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "async_scheduling": "schedule each step while the previous one computes (default: on "
                        "for generation models on CUDA, off on CPU and for pooling models)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "trust_remote_code": "allow a model directory's own modeling code",
    "max_logprobs": "the most logprobs or prompt_logprobs one request may ask for; -1: "
                    "the whole vocabulary",
    "enforce_eager": "compile nothing (on CPU, the model then runs eagerly and decode "
                     "attention gathers KV blocks "
                     "instead of running the C or torch.compile'd kernel; pooling "
                     "models attend with SDPA instead of the C kernel)",
    "optimization_level": "0: run the model eagerly (fastest start); 1-3: on CPU, compile "
                          "its forward with torch.compile at start-up (default 2)",
    "cpu_threads": "compute threads on CPU; default: all usable cores, fewer while other "
                   "processes keep some busy (docs/api.md)",
    "tensor_parallel_size": "number of GPUs (only 1 for now)",
    "scheduling_policy": "fcfs, priority or slo (docs/scheduling.md)",
    "disable_log_requests": "do not log requests (vLLM's older flag; off is the default)",
    "disable_log_stats": "do not log engine statistics periodically",
    "max_log_len": "longest prompt prefix printed in request logs",
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
    "max_cpu_loras": "adapters kept loaded in memory (default: --max-loras); others are "
                     "read again from their path when needed",
    "lora_dtype": "dtype of the adapters' weights: auto (the model's), bfloat16, float32",
    "quantization": "weight-only quantization of the linear layers at load, on CPU: int8 "
                    "(per channel) or int4 (grouped), triollm's own methods; or a "
                    "quantized checkpoint's own method (gptq, awq, compressed-tensors), "
                    "which is read from its config without this flag "
                    "(docs/quantization.md)",
    "quantization_group_size": "int4's input columns per group, a multiple of 32 (-1: "
                               "per channel); triollm's own flag",
    "lora_target_modules": "only these module names take adapters (default: every linear "
                           "layer but the LM head)",
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
    "pooler_config": 'overrides of the model\'s pooling as JSON: pooling_type (MEAN, CLS, '
                     'LAST), use_activation (normalize), dimensions '
                     '(e.g. \'{"pooling_type": "MEAN"}\')',
}
