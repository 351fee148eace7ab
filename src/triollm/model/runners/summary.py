"""The generation runner's start-up summary: one log line with the settings in effect."""

from __future__ import annotations

import logging

import torch
from torch import nn

from triollm.config import EngineConfig
from triollm.model.attention.metadata import PagedKVCache
from triollm.model.cpu.packed_linear import PackedLinear
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.runners.batch import DecodeAttention

__all__ = ["attention_name", "log_pooling_summary", "log_summary"]

logger = logging.getLogger("triollm.model.runners")


def attention_name(attention: DecodeAttention) -> str:
    """How decodes attend, in words."""
    kernel = attention.kernel
    if kernel is None:
        return "gather + SDPA"
    if type(kernel).__name__ == "CpuDecodeKernel":
        return "C kernel" + (", one call a step" if attention.step is not None else "")
    return str(getattr(kernel, "__name__", type(kernel).__name__))


def compile_mode(config: EngineConfig, compiled: bool, compiling: bool) -> str:
    """Whether the forward is compiled, in words."""
    model = config.model
    if compiled:
        return "compiled"
    if compiling:
        return "compiling in the background, serving eagerly meanwhile"
    if model.device.type != "cpu" or not model.compile_model:
        return "eager"
    return "eager: not compiled"


def log_summary(config: EngineConfig, model: nn.Module, kv_cache: PagedKVCache,
                threads: ComputeThreads | None, attention: DecodeAttention,
                mode: str) -> None:
    """Log the settings a generation runner serves with, in one INFO line."""
    cache_bytes = sum(tensor.numel() * tensor.element_size()
                      for tensor in [*kv_cache.keys, *kv_cache.values])
    cache_dtype = kv_cache.keys[0].dtype if kv_cache.keys else config.model.dtype
    thread_text = ("" if threads is None else
                   f", {threads.threads} thread{'' if threads.threads == 1 else 's'}"
                   f"{' (adaptive)' if threads.adaptive else ''}")
    packed = sum(isinstance(module, PackedLinear) for module in model.modules())
    logger.info(
        "engine ready: dtype %s, KV cache %s, %d blocks of %d tokens (%.1f MiB), "
        "max_model_len %d, max_num_seqs %d%s, optimization level %d (%s), decode "
        "attention: %s, %d linear layers packed",
        _dtype(config.model.dtype), _kv_dtype(config, cache_dtype), kv_cache.num_blocks,
        kv_cache.block_size, cache_bytes / 2**20, config.model.max_model_len,
        config.scheduler.max_num_seqs, thread_text, config.model.optimization_level, mode,
        attention_name(attention), packed)


def log_pooling_summary(config: EngineConfig, model: nn.Module, task: str,
                        threads: ComputeThreads | None, attention: str) -> None:
    """Log the settings a pooling runner serves with, in one INFO line."""
    thread_text = ("" if threads is None else
                   f", {threads.threads} thread{'' if threads.threads == 1 else 's'}"
                   f"{' (adaptive)' if threads.adaptive else ''}")
    packed = sum(isinstance(module, PackedLinear) for module in model.modules())
    logger.info(
        "engine ready: pooling (%s), dtype %s, no KV cache, max_model_len %d, "
        "max_num_seqs %d, max_num_batched_tokens %d%s, eager, prompt attention: %s, "
        "%d linear layers packed", task, _dtype(config.model.dtype),
        config.model.max_model_len, config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens, thread_text, attention, packed)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_dtype(config: EngineConfig, dtype: torch.dtype) -> str:
    """The cache's element type, and the ``--kv-cache-dtype`` that chose it if not auto."""
    chosen = config.cache.cache_dtype
    return _dtype(dtype) + ("" if chosen == "auto" else f" (--kv-cache-dtype {chosen})")
