"""The flags of ``vllm serve`` (vLLM 0.32) that ``triollm serve`` does not implement.

A user's vLLM command line must never be half-understood: each of these flags is
accepted only with a value that asks for what triollm does anyway (``--pipeline-parallel-size
1``, the ``--no-`` form of a feature switch), and any
other use stops ``triollm serve`` with the reason. docs/migration.md lists them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OLDER_VLLM_FLAGS", "REFUSED_FLAGS", "RefusedFlag", "add_refused_flags"]

_PARALLEL = "triollm runs tensor-parallel ranks and data-parallel replicas on this " \
            "machine only (no pipeline, context or expert parallelism, no other node)"
_DATA_PARALLEL = ("the --data-parallel-size replicas all run on this machine, started, "
                  "owned and balanced by the one API server: there is no other node, "
                  "rank, address, RPC port or external load balancer to name")
_MULTIMODAL = "triollm serves text-only models"
_LORA = "this LoRA option is not supported: triollm serves LoRA adapters on the linear " \
        "layers of text generation models (--enable-lora, --lora-modules, --max-loras, " \
        "--max-lora-rank, --max-cpu-loras, --lora-dtype, --lora-target-modules)"
_QUANT = ("only the --quantization methods and --kv-cache-dtype values in "
          "docs/quantization.md are supported")
_KV_QUANT = ("every layer's KV cache is kept in --kv-cache-dtype, and an fp8 cache with a "
             "scale of 1.0 (no k/v scales are calculated)")
_KERNELS = "vLLM's kernel, CUDA-graph and compilation settings have no counterpart: " \
           "on CPU triollm compiles its decode attention and, by --optimization-level, the " \
           "model's forward (--enforce-eager turns both off)"
_TRACING = ("NVTX and trace-replay tracing are not supported (OpenTelemetry is: "
            "--otlp-traces-endpoint)")
_METRICS = "this metric is not implemented"
_SPEC = ("pass speculative decoding as --speculative-config JSON (method ngram with "
         "prompt_lookup_min/max, or draft_model with its model; num_speculative_tokens, "
         "disable_by_batch_size)")
_OFFLOAD = "weight and KV-cache offloading are not supported"
_DISAGG = "disaggregated serving (KV, encoder-cache and weight transfer) is not supported"
_MAMBA = "triollm serves attention-only transformers models (no Mamba or hybrid caches)"
_PLUGINS = "vLLM's plugin and class-override hooks do not exist in triollm"
_SLEEP = "sleep mode is not supported"
_CUDA_MEMORY = "GPU memory management options are not supported"
_NOT_IMPLEMENTED = "not implemented by triollm"


@dataclass(frozen=True)
class RefusedFlag:
    """A vLLM flag: ``switch`` (on/off, refused when on), ``value``, ``optional`` (a
    value that may be left out) or ``values`` (one or several values), refused unless
    every value is in ``neutral``."""

    kind: str
    reason: str
    neutral: tuple[str, ...] = ()


def _switches(reason: str, *names: str) -> dict[str, RefusedFlag]:
    return {name: RefusedFlag("switch", reason) for name in names}


def _values(reason: str, *names: str, neutral: tuple[str, ...] = ()) -> dict[str, RefusedFlag]:
    return {name: RefusedFlag("value", reason, neutral) for name in names}


def _optional(reason: str, *names: str, neutral: tuple[str, ...] = ()
              ) -> dict[str, RefusedFlag]:
    """Flags whose value may be left out (vLLM's ``nargs="?"`` booleans, meaning True)."""
    return {name: RefusedFlag("optional", reason, neutral) for name in names}


def _lists(reason: str, *names: str) -> dict[str, RefusedFlag]:
    return {name: RefusedFlag("values", reason) for name in names}


REFUSED_FLAGS: dict[str, RefusedFlag] = {
    # one device, one process
    **_values(_PARALLEL, "--pipeline-parallel-size",
              "--decode-context-parallel-size", "--prefill-context-parallel-size",
              "--api-server-count", "--nnodes", neutral=("1",)),
    **_values(_PARALLEL, "--node-rank", neutral=("0",)),
    **_values(_DATA_PARALLEL, "--data-parallel-rank", "--data-parallel-start-rank",
              neutral=("0",)),
    **_values(_DATA_PARALLEL, "--data-parallel-address", "--data-parallel-backend",
              "--data-parallel-rpc-port", "--data-parallel-supervisor-port"),
    **_switches(_DATA_PARALLEL, "--data-parallel-external-lb", "--data-parallel-hybrid-lb",
                "--data-parallel-multi-port-external-lb"),
    **_values(_PARALLEL, "--dp-supervisor-probe-failure-threshold",
              "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s",
              "--dp-sync-interval", "--master-addr", "--master-port",
              "--cpu-distributed-timeout-seconds",
              "--all2all-backend", "--dcp-comm-backend",
              "--dcp-kv-cache-interleave-size", "--cp-kv-cache-interleave-size",
              "--elastic-ep-max-dp-size", "--eplb-config", "--expert-placement-strategy",
              "--ubatch-size", "--dbo-decode-token-threshold",
              "--dbo-prefill-token-threshold", "--fault-tolerance-config", "--device-ids",
              "--max-parallel-loading-workers"),
    **_switches(_PARALLEL, "--dcp-q-replicate",
                "--disable-custom-all-reduce", "--disable-nccl-for-dp-synchronization",
                "--enable-batch-sharded-sampling", "--enable-dbo", "--enable-elastic-ep",
                "--enable-ep-weight-filter", "--enable-eplb", "--enable-expert-parallel",
                "--enable-fault-tolerance", "--enable-hc-sp", "--enable-shm-tensor-arena",
                "--ray-workers-use-nsight", "--headless", "--numa-bind",
                "--enable-nccl-comm-suspend", "--enable-scale-out"),
    **_lists(_PARALLEL, "--numa-bind-cpus", "--numa-bind-nodes"),
    # text only
    **_values(_MULTIMODAL, "--allowed-local-media-path", "--limit-mm-per-prompt",
              "--media-io-kwargs", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
              "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-margin",
              "--mm-encoder-fp8-scale-save-path", "--mm-encoder-tp-mode",
              "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb", "--mm-processor-cache-gb",
              "--mm-processor-cache-type", "--mm-processor-device", "--mm-processor-kwargs",
              "--mm-shm-cache-max-object-size-mb", "--mm-tensor-ipc",
              "--video-pruning-method", "--video-pruning-rate", "--io-processor-plugin"),
    **_lists(_MULTIMODAL, "--allowed-media-domains"),
    **_switches(_MULTIMODAL, "--enable-mm-embeds", "--interleave-mm-strings",
                "--mm-device-do-normalize", "--mm-encoder-only", "--skip-mm-profiling",
                "--disable-chunked-mm-input", "--trust-request-mm-kwargs",
                "--enable-prompt-embeds"),
    **_switches(_MULTIMODAL + " (every model is language-only)", "--language-model-only"),
    # LoRA
    **_switches(_LORA, "--enable-mixed-moe-lora-format", "--enable-moe-shared-loras",
                "--enable-tower-connector-lora", "--fully-sharded-loras",
                "--specialize-active-lora"),
    **_values(_LORA, "--default-mm-loras", "--max-lora-cls-labels"),
    # quantization and kernels
    **_values(_QUANT, "--quantization-config"),
    **_lists(_KV_QUANT, "--kv-cache-dtype-skip-layers"),
    **_switches(_QUANT, "--allow-deprecated-quantization"),
    **_values(_KERNELS, "--attention-backend", "--attention-config", "--compilation-config",
              "--cudagraph-capture-sizes", "--max-cudagraph-capture-size",
              "--ir-op-priority", "--linear-backend", "--moe-backend",
              "--sparse-indexer-topk-backend", "--gdn-prefill-backend",
              "--kda-decode-backend", "--kda-prefill-backend", "--kernel-config",
              "--performance-mode", "--jit-monitor-mode"),
    **_switches(_KERNELS, "--enable-flashinfer-autotune", "--disable-cascade-attn",
                "--use-fp64-gumbel", "--jit-monitor-verbose",
                "--enable-flash-late-interaction"),
    # tracing, metrics and logging
    **_switches(_TRACING, "--enable-layerwise-nvtx-tracing", "--enable-trace-replay"),
    **_switches(_METRICS, "--cudagraph-metrics", "--enable-mfu-metrics",
                "--kv-cache-metrics", "--enable-per-request-metrics",
                "--enable-logging-iteration-details", "--enable-server-load-tracking",
                "--aggregate-engine-logging"),
    **_values(_METRICS, "--custom-histogram-buckets", "--kv-cache-metrics-sample",
              "--per-request-spec-decode-metrics", "--show-hidden-metrics-for-version"),
    **_values(_NOT_IMPLEMENTED + ": configure logging from Python instead",
              "--log-config-file", "--logging-config"),
    **_switches(_NOT_IMPLEMENTED, "--enable-log-outputs", "--enable-log-deltas",
                "--log-error-stack", "--enable-request-id-headers",
                "--enable-force-include-usage", "--enable-prompt-tokens-details",
                "--enable-tokenizer-info-endpoint", "--enable-offline-docs",
                "--enable-ssl-refresh", "--tokens-only",
                "--exclude-tools-when-tool-choice-none", "--return-sampling-mask",
                "--enable-return-routed-experts", "--scheduler-reserve-full-isl",
                "--long-prefill-token-threshold-adaptive",
                "--disable-hybrid-kv-cache-manager", "--kv-sharing-fast-prefill",
                "--disable-sliding-window", "--enable-cumem-allocator", "--grpc",
                "--fail-on-environ-validation", "--cohere-is-reasoning-model",
                "--swa-bounded-replay", "--use-tqdm-on-load"),
    **_values(_NOT_IMPLEMENTED, "--default-chat-template-kwargs",
              "--fingerprint-mode",
              "--fingerprint-value", "--grpc-port", "--sse-keep-alive-interval",
              "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-ciphers", "--cohere-format",
              "--anthropic-disabled-thinking-effort", "--hf-config-path", "--hf-overrides",
              "--hf-token", "--code-revision", "--pt-load-map-location",
              "--safetensors-load-strategy", "--safetensors-prefetch-block-size",
              "--safetensors-prefetch-num-threads", "--model-loader-extra-config",
              "--long-prefill-token-threshold", "--max-num-active-seqs",
              "--max-num-queued-reqs", "--max-num-queued-tokens",
              "--max-num-scheduled-tokens", "--prefill-schedule-interval",
              "--stream-interval", "--watermark", "--watermark-config",
              "--prefix-cache-retention-interval", "--prefix-caching-hash-algo",
              "--prefix-match-unit", "--kv-cache-memory-bytes", "--renderer-num-workers",
              "--additional-config", "--aux-output-config", "--diffusion-config",
              "--engram-config", "--profiler-config",
              "--weight-transfer-config"),
    **_lists(_NOT_IMPLEMENTED, "--ignore-patterns", "--logits-processors",
             "--sleep-preserve-parameter-names", "--middleware"),
    # model loading and tokenizers, where triollm does one thing
    **_values("weights load through transformers' from_pretrained",
              "--load-format", neutral=("auto", "safetensors")),
    **_values("triollm runs transformers' own model code", "--model-impl",
              neutral=("auto", "transformers")),
    **_values("the tokenizer loads with transformers' AutoTokenizer", "--tokenizer-mode",
              neutral=("auto", "hf")),
    **_values("configs load with transformers' AutoConfig", "--config-format",
              neutral=("auto", "hf")),
    **_switches("triollm needs the tokenizer", "--skip-tokenizer-init"),
    **_values("raw log-probabilities (before any sampling setting) are the only mode",
              "--logprobs-mode", neutral=("raw_logprobs",)),
    **_values("the assistant's role is always 'assistant'", "--response-role",
              neutral=("assistant",)),
    **_values("the scheduler is triollm's own", "--scheduler-cls"),
    **_values(_PLUGINS, "--worker-cls", "--worker-extension-cls", "--model-class-overrides"),
    **_values("built-in tool servers (MCP, browsing, code interpreter) for /v1/responses "
              "are not supported", "--tool-server"),
    # features of other model kinds
    **_values(_MAMBA, "--mamba-backend", "--mamba-block-size", "--mamba-cache-dtype",
              "--mamba-cache-mode", "--mamba-cache-philox-rounds", "--mamba-ssm-cache-dtype",
              "--mamba-ssu-algorithm", "--replayssm-buffer-len"),
    **_switches(_MAMBA, "--enable-mamba-cache-stochastic-rounding",
                "--enable-mamba-shared-prefix-checkpoint", "--use-replayssm"),
    **_values(_NOT_IMPLEMENTED + ": thinking budgets are not supported", "--reasoning-config"),
    **_values(_NOT_IMPLEMENTED + ': tool calls under tool_choice "auto" are parsed, not '
              "constrained", "--tool-strict-level"),
    **_values(_SPEC, "--spec-method", "--spec-model", "--spec-tokens"),
    **_values(_OFFLOAD, "--cpu-offload-gb", neutral=("0",)),
    **_values(_OFFLOAD, "--kv-offloading-backend", "--kv-offloading-size",
              "--offload-backend", "--offload-group-size", "--offload-num-in-group",
              "--offload-prefetch-step"),
    **_lists(_OFFLOAD, "--cpu-offload-params", "--offload-params"),
    **_values(_DISAGG, "--kv-transfer-config", "--kv-events-config", "--ec-transfer-config",
              "--ec-manager-config"),
    **_switches(_SLEEP, "--enable-sleep-mode", "--sleep-mode-offload-cudagraph"),
}


_REMOVED = "removed from vLLM since; "

#: Flags of older vLLM releases that command lines still carry (vLLM 0.32 no longer
#: knows them either): refused with the reason, not as unknown.
OLDER_VLLM_FLAGS: dict[str, RefusedFlag] = {
    **_values("triollm never swaps KV blocks to host memory: a preempted request is "
              "recomputed", "--swap-space", neutral=("0",)),
    **_values("a preempted request is recomputed (no swapping)", "--preemption-mode",
              neutral=("recompute",)),
    **_switches(_REMOVED + "triollm's block manager is the only one",
                "--use-v2-block-manager"),
    **_values(_REMOVED + "one step is scheduled at a time", "--num-scheduler-steps",
              neutral=("1",)),
    **_switches(_REMOVED + "one step is scheduled at a time",
                "--multi-step-stream-outputs"),
    **_values(_KERNELS, "--max-seq-len-to-capture"),
    **_values("vLLM renamed it --pooler-config; pass that", "--override-pooler-config"),
    **_values(_SPEC, "--speculative-model", "--num-speculative-tokens",
              "--num-lookahead-slots", "--speculative-model-quantization",
              "--speculative-draft-tensor-parallel-size", "--speculative-max-model-len",
              "--speculative-disable-by-batch-size", "--ngram-prompt-lookup-max",
              "--ngram-prompt-lookup-min", "--spec-decoding-acceptance-method",
              "--typical-acceptance-sampler-posterior-threshold",
              "--typical-acceptance-sampler-posterior-alpha"),
    **_switches(_SPEC, "--speculative-disable-mqa-scorer"),
    **_optional("speculative decoding returns the logprobs a request asks for",
                "--disable-logprobs-during-spec-decoding", neutral=("False",)),
    **_values(_NOT_IMPLEMENTED + ": change the model's config.json instead",
              "--rope-scaling", "--rope-theta"),
    **_values(_NOT_IMPLEMENTED, "--tokenizer-pool-size", neutral=("0",)),
    **_values(_NOT_IMPLEMENTED, "--scheduler-delay-factor", neutral=("0", "0.0")),
    **_values(_NOT_IMPLEMENTED, "--max-num-partial-prefills", "--max-long-partial-prefills",
              neutral=("1",)),
    **_values(_LORA, "--qlora-adapter-name-or-path", "--lora-extra-vocab-size"),
    **_lists(_LORA, "--long-lora-scaling-factors"),
    **_switches(_LORA, "--enable-prompt-adapter"),
    **_values(_LORA, "--max-prompt-adapters", "--max-prompt-adapter-token"),
    **_switches(_REMOVED + "pass --distributed-executor-backend ray (the tensor-parallel "
                "ranks as Ray actors)", "--worker-use-ray"),
    **_switches(_PARALLEL, "--engine-use-ray", "--disable-frontend-multiprocessing"),
    **_switches(_NOT_IMPLEMENTED + ": outputs are already processed as each step ends",
                "--disable-async-output-proc"),
    **_switches(_KV_QUANT, "--calculate-kv-scales"),
    **_switches(_MULTIMODAL, "--disable-mm-preprocessor-cache"),
}


class _Refuse(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, *, refused: RefusedFlag,
                 **kwargs: Any) -> None:
        self.refused = refused
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag = self.option_strings[0]
        if self.refused.kind == "switch":
            if option_string is not None and option_string.startswith("--no-"):
                return
            parser.error(f"{flag}: not supported by triollm: {self.refused.reason}")
        given = values if isinstance(values, list) else [values]
        if all(value in self.refused.neutral for value in given):
            return
        shown = " ".join(str(value) for value in given)
        allowed = (f" (only {' or '.join(self.refused.neutral)} is accepted)"
                   if self.refused.neutral else "")
        parser.error(f"{flag} {shown}: not supported by triollm: {self.refused.reason}"
                     f"{allowed}")


def add_refused_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Register every flag of ``REFUSED_FLAGS`` and ``OLDER_VLLM_FLAGS`` (hidden from
    ``--help``)."""
    for flag, refused in {**REFUSED_FLAGS, **OLDER_VLLM_FLAGS}.items():
        names = [flag]
        kwargs: dict[str, Any] = {}
        if refused.kind == "switch":
            names.append("--no-" + flag[2:])
            kwargs["nargs"] = 0
        elif refused.kind == "values":
            kwargs["nargs"] = "+"
        elif refused.kind == "optional":
            kwargs["nargs"] = "?"
            kwargs["const"] = "True"
        parser.add_argument(*names, action=_Refuse, refused=refused, default=None,
                            dest="refused_" + flag[2:].replace("-", "_"),
                            help=argparse.SUPPRESS, **kwargs)
