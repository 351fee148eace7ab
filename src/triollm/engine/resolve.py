"""How ``EngineArgs`` (engine/args.py) become the parts of an ``EngineConfig``: the
device and dtype, the runner and pooling task a model gets, its context length, its
sampling defaults, and the LoRA and observability settings. Reading the model's own
configuration goes through the model layer's loader, imported where it is used, so
that building arguments (``triollm serve --help``) loads neither torch nor
transformers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from triollm.config import (
    LoRAConfig,
    ObservabilityConfig,
    PoolingTask,
    RunnerKind,
    StructuredOutputsConfig,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["GENERATION_CONFIG_FIELDS", "context_length", "cpu_supports_bf16",
           "encoder_context_length", "fail", "generation_defaults", "json_object",
           "lora_config", "observability_config", "resolve_device", "resolve_dtype",
           "resolve_max_model_len", "resolve_reasoning_parser", "resolve_runner",
           "sampling_defaults"]

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


def fail(field_name: str, message: str) -> ValueError:
    """The ``ValueError`` for a bad argument, naming it."""
    return ValueError(f"{field_name}: {message}")


def resolve_device(device: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device torch can use."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise fail("device", f"must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise fail("device", "CUDA was requested but torch sees no CUDA device")
    return torch.device(device)


def cpu_supports_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 and up)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX512", "AVX512_BF16", "AMX") or capability.startswith("AVX512")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name (or ``auto``: bfloat16 where the device computes it) as a torch
    dtype the device serves."""
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
        raise fail("dtype", f"must be 'auto', 'bfloat16' or 'float32' (or 'float16' on CUDA), "
                   f"got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise fail("dtype", f"unsupported dtype {resolved}")
    if resolved == torch.float16 and device.type == "cpu":
        raise fail("dtype", "float16 is refused on CPU (it runs about 100x slower than "
                   "bfloat16 there); use 'bfloat16' or 'float32'")
    return resolved


def sampling_defaults(generation_config: Mapping[str, Any],
                      override: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` defaults a generation config and its overrides give
    (``override`` wins; its keys must be ``GENERATION_CONFIG_FIELDS``)."""
    for name in override:
        if name not in GENERATION_CONFIG_FIELDS:
            raise fail("override_generation_config", f"{name!r} is not a sampling "
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
        raise fail("generation_config", f"the sampling defaults {defaults} are invalid: "
                   f"{error}") from None
    return defaults


def json_object(name: str, value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """A dict field that the command line gives as JSON text (None: empty)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise fail(name, f"not JSON: {error}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail(name, f"must be a JSON object, got {value!r}")
    return dict(value)


#: The options older vLLM wrote after ``--guided-decoding-backend``'s name
#: (``xgrammar:no-fallback``), each the ``StructuredOutputsConfig`` field it sets.
_BACKEND_OPTIONS = {"no-fallback": "disable_fallback",
                    "disable-any-whitespace": "disable_any_whitespace",
                    "no-additional-properties": "disable_additional_properties"}


def guided_decoding_backend(config: StructuredOutputsConfig, value: str | None
                            ) -> StructuredOutputsConfig:
    """Older vLLM's ``--guided-decoding-backend NAME[:option,...]`` over ``config``
    (from ``--structured-outputs-config``): its backend and options; a backend that
    contradicts the config's, or an unknown option, is refused by name."""
    if value is None:
        return config
    name, _, options = value.partition(":")
    if config.backend not in ("auto", name):
        raise fail("guided_decoding_backend", f"{name!r} contradicts "
                   f"structured_outputs_config's backend {config.backend!r}")
    changes: dict[str, Any] = {"backend": name}
    for option in filter(None, (o.strip() for o in options.split(","))):
        if option not in _BACKEND_OPTIONS:
            raise fail("guided_decoding_backend", f"unknown option {option!r} (known: "
                       f"{', '.join(_BACKEND_OPTIONS)})")
        changes[_BACKEND_OPTIONS[option]] = True
    return structured_outputs_config(dataclasses.replace(config, **changes))


#: Encoders whose positions start after the padding index (RoBERTa's scheme), so
#: ``max_position_embeddings`` counts ``pad_token_id + 1`` positions no token uses.
_OFFSET_POSITION_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})


def encoder_context_length(hf_config: PretrainedConfig, limit: int | None) -> int | None:
    if limit is not None and getattr(hf_config, "model_type", "") in _OFFSET_POSITION_TYPES:
        return limit - int(getattr(hf_config, "pad_token_id", 0) or 0) - 1
    return limit


def context_length(hf_config: PretrainedConfig) -> int | None:
    """The context length a model config names (None if it names none)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def observability_config(endpoint: str | None,
                         detailed: list[str] | str | None) -> ObservabilityConfig:
    """``otlp_traces_endpoint`` and ``collect_detailed_traces``, checked (the tracing
    extra installed, the exporter's protocol known) before anything starts."""
    names = ([] if detailed is None else
             [part.strip() for item in ([detailed] if isinstance(detailed, str)
                                        else detailed) for part in str(item).split(",")
              if part.strip()])
    for name in names:
        if name not in ("model", "worker", "all"):
            raise fail("collect_detailed_traces", f"expected model, worker or all, "
                       f"got {name!r}")
    if names and endpoint is None:
        raise fail("collect_detailed_traces", "needs otlp_traces_endpoint "
                   "(--otlp-traces-endpoint) to be set")
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.strip():
            raise fail("otlp_traces_endpoint", f"must be a URL, got {endpoint!r}")
        from triollm.engine.tracing import exporter_protocol, tracing_unavailable_reason

        reason = tracing_unavailable_reason()
        if reason is not None:
            raise fail("otlp_traces_endpoint", reason)
        exporter_protocol()  # a ValueError naming the variable, before anything starts
    modules = ("model", "worker") if "all" in names else tuple(dict.fromkeys(names))
    return ObservabilityConfig(otlp_traces_endpoint=endpoint,
                               collect_detailed_traces=modules)


def lora_config(*, enable_lora: bool, max_loras: int, max_lora_rank: int,
                max_cpu_loras: int | None, lora_dtype: str,
                target_modules: list[str] | None, runner: RunnerKind,
                device: torch.device, dtype: torch.dtype) -> LoRAConfig | None:
    """The LoRA settings (None without ``enable_lora``, when none of them may be set)."""
    if not enable_lora:
        for name, value in (("max_cpu_loras", max_cpu_loras),
                            ("lora_target_modules", target_modules)):
            if value is not None:
                raise fail(name, "needs enable_lora=True")
        return None
    if runner != "generate":
        raise fail("enable_lora", "LoRA adapters are served over generation models "
                   "(runner='generate'); this model is loaded with runner='pooling'")
    cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu_loras < max_loras:
        raise fail("max_cpu_loras", f"{cpu_loras} must be >= max_loras={max_loras}")
    resolved_dtype = dtype if lora_dtype == "auto" else resolve_dtype(lora_dtype, device)
    targets = target_modules
    if targets is not None:
        if (isinstance(targets, str) or not targets
                or not all(isinstance(t, str) and t for t in targets)):
            raise fail("lora_target_modules", f"must be a non-empty list of module "
                       f"names, got {targets!r}")
        targets = list(targets)
    return LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                      max_cpu_loras=cpu_loras, lora_dtype=resolved_dtype,
                      target_modules=None if targets is None else tuple(targets))


def resolve_runner(model: str, hf_config: PretrainedConfig, runner: str, convert_to: str,
                   task: str | None, hub: dict[str, Any]
                   ) -> tuple[RunnerKind, PoolingTask | None]:
    """``runner``, ``convert`` and ``task`` (vLLM's older spelling) → the runner and,
    for pooling, its task."""
    convert = convert_to
    if runner not in ("auto", "generate", "pooling"):
        raise fail("runner", f"must be 'auto', 'generate' or 'pooling', got {runner!r}")
    if convert not in ("auto", "none", "embed", "classify"):
        raise fail("convert", f"must be 'auto', 'none', 'embed' or 'classify', got "
                   f"{convert!r}")
    if task not in (None, "auto"):
        task_runner = {"generate": "generate", "embed": "pooling", "embedding": "pooling",
                       "classify": "pooling", "score": "pooling"}.get(task)
        if task_runner is None:
            raise fail("task", f"must be 'auto', 'generate', 'embed', 'classify' or "
                       f"'score', got {task!r}")
        if runner not in ("auto", task_runner):
            raise fail("task", f"{task!r} contradicts runner={runner!r}")
        runner = task_runner
        if task in ("embed", "embedding", "classify", "score") and convert == "auto":
            convert = "classify" if task in ("classify", "score") else "embed"
    architectures = [str(a) for a in getattr(hf_config, "architectures", None) or []]
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if runner == "auto":
        from triollm.model.pooler import sentence_transformers_modules

        bare = bool(architectures) and all(
            a.endswith("Model") and not a.endswith("LMHeadModel") for a in architectures)
        pooling = (classifier or bare or convert in ("embed", "classify")
                   or sentence_transformers_modules(model, **hub) is not None)
        runner = "pooling" if pooling else "generate"
    if runner == "generate":
        if convert in ("embed", "classify"):
            raise fail("convert", f"{convert!r} needs runner='pooling'")
        return "generate", None
    if convert in ("auto", "none"):
        return "pooling", "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise fail("convert", f"'classify' needs a *ForSequenceClassification model "
                   f"(a classification head); {model!r} is {architectures}")
    return "pooling", "classify" if convert == "classify" else "embed"


def generation_defaults(model: str, source: str, override: Mapping[str, Any] | str | None,
                        *, revision: str | None, download_dir: str | None) -> dict[str, Any]:
    """Sampling defaults, as vLLM's ``--generation-config``: ``auto`` reads the
    model's generation_config.json, ``vllm`` uses none, a directory reads its file;
    ``override_generation_config`` applies on top."""
    from triollm.model.loader import load_generation_config

    overrides = json_object("override_generation_config", override)
    if not isinstance(source, str) or not source:
        raise fail("generation_config", f"must be 'auto', 'vllm' or a directory, got "
                   f"{source!r}")
    if source == "vllm":
        found: dict[str, Any] = {}
    elif source == "auto":
        found = load_generation_config(model, revision=revision, download_dir=download_dir)
    else:
        found = load_generation_config(source)
        if not found:
            raise fail("generation_config", f"{source!r} holds no "
                       f"generation_config.json")
    defaults = sampling_defaults(found, overrides)
    if defaults and source != "vllm":
        logger.warning("Default sampling parameters have been overridden by %s: %s. "
                       "If this is not intended, pass --generation-config vllm.",
                       "the model's generation_config.json" if source == "auto"
                       else source, defaults)
    return defaults


def resolve_max_model_len(model: str, hf_config: PretrainedConfig, runner: RunnerKind,
                          requested: int | None, hub: dict[str, Any]) -> int:
    """The context length: ``requested`` (checked against the model's), or the model's
    own (for a pooling model, also the sentence-transformers ``max_seq_length``)."""
    model_limit = context_length(hf_config)
    if runner == "pooling":
        from triollm.model.pooler import max_seq_length

        model_limit = encoder_context_length(hf_config, model_limit)
        st_limit = max_seq_length(model, **hub)
        if st_limit is not None and requested is None:
            model_limit = min(model_limit or st_limit, st_limit)
    if requested is None:
        if model_limit is None:
            raise fail("max_model_len", "the model config names no context length; set it")
        max_model_len = model_limit
    else:
        max_model_len = requested
        if model_limit is not None and max_model_len > model_limit:
            raise fail("max_model_len", f"{max_model_len} exceeds the model's context "
                       f"length {model_limit}")
    return max_model_len


def structured_outputs_config(value: StructuredOutputsConfig | Mapping[str, Any] | str | None
                              ) -> StructuredOutputsConfig:
    """``structured_outputs_config``: the config itself, a dict of its fields, or their
    JSON (``--structured-outputs-config``)."""
    name = "structured_outputs_config"
    if isinstance(value, StructuredOutputsConfig):
        config = value
    else:
        fields = json_object(name, value)
        known = {f.name for f in dataclasses.fields(StructuredOutputsConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise fail(name, f"unknown field(s) {', '.join(unknown)} (known: "
                       f"{', '.join(sorted(known))})")
        config = StructuredOutputsConfig(**fields)
    if config.backend not in ("auto", "xgrammar", "guidance"):
        raise fail(name, f"backend must be auto, xgrammar or guidance, got {config.backend!r}")
    if config.backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
        raise fail(name, "backend xgrammar is not installed (pip install 'triollm[xgrammar]')")
    for flag in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "enable_in_reasoning"):
        if not isinstance(getattr(config, flag), bool):
            raise fail(name, f"{flag} must be true or false")
    if config.reasoning_parser is not None and not isinstance(config.reasoning_parser, str):
        raise fail(name, "reasoning_parser must be a parser's name")
    return config


def resolve_reasoning_parser(name: str | None, plugin: str | None) -> str | None:
    """``--reasoning-parser NAME`` checked against the registered parsers, after
    ``--reasoning-parser-plugin FILE`` has registered its own."""
    from triollm.reasoning import ReasoningParserManager

    if plugin:
        try:
            ReasoningParserManager.import_reasoning_parser(plugin)
        except ValueError as error:
            raise fail("reasoning_parser_plugin", str(error)) from None
    if not name:
        return None
    try:
        ReasoningParserManager.get_reasoning_parser(name)
    except KeyError as error:
        raise fail("reasoning_parser", error.args[0]) from None
    return name
