"""What a runner does to a loaded model before its first step.

On CPU (``prepare_for_cpu``, both runners): the thread policy (model/cpu/threads.py),
the linear layers quantized where asked (model/quantization/), the others moved onto
packed weights (model/cpu/packed_linear.py), and malloc
told to keep freed memory for the next step (model/cpu/malloc.py). For generation: a
profiling forward without a cache finds the attention layers and their keys' and
values' shapes (and, on CUDA, a full step's activation memory), from which the KV cache
is sized.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from triollm.config import EngineConfig, QuantizationConfig
from triollm.model.attention.metadata import (
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    ProfileRecorder,
)
from triollm.model.cpu.malloc import keep_freed_memory
from triollm.model.cpu.packed_linear import pack_linear_layers
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.quantization.methods import ON_THE_FLY_BITS
from triollm.model.quantization.replace import quantize_linear_layers

__all__ = ["num_kv_blocks", "prepare_for_cpu", "profile_kv_specs"]

logger = logging.getLogger(__name__)

_PROFILE_TOKENS = 8


def prepare_for_cpu(model: nn.Module, cpu_threads: int | None,
                    quantization: QuantizationConfig | None = None) -> ComputeThreads:
    """The thread policy a runner's steps compute with (``cpu_threads``: a fixed count,
    or None to adapt), after quantizing ``model``'s linear layers (``quantization``,
    model/quantization/), moving the others onto packed weights and raising malloc's
    thresholds."""
    compute_threads = ComputeThreads(cpu_threads)
    keep_freed_memory()
    if quantization is not None and quantization.method in ON_THE_FLY_BITS:
        quantize_linear_layers(model, quantization.method, quantization.group_size)
    packed = pack_linear_layers(model)
    logger.info("%d linear layers run on packed weights", packed)
    return compute_threads


@torch.inference_mode()
def profile_kv_specs(model: nn.Module, config: EngineConfig) -> dict[int, KVCacheSpec]:
    """Run a forward without a cache to find the attention layers (by module id) and
    their keys' and values' shapes; on CUDA, over a full step's tokens, so that the
    peak memory it leaves shows a step's activations."""
    device = config.model.device
    tokens = _PROFILE_TOKENS
    if device.type == "cuda":
        tokens = min(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
        torch.cuda.reset_peak_memory_stats(device)
    recorder = ProfileRecorder()
    metadata = PagedAttentionMetadata(
        kv_cache=None, slot_mapping=torch.empty(0, dtype=torch.long), profile=recorder)
    input_ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device)[None]
    model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1,
          triollm_metadata=metadata)
    if not recorder.layers:
        raise RuntimeError("the model never called its attention interface")
    return recorder.layers


def num_kv_blocks(config: EngineConfig, specs: dict[int, KVCacheSpec],
                  cache_dtype: torch.dtype) -> int:
    """How many blocks the KV cache gets: ``num_gpu_blocks_override``, else what the
    free memory allows on CUDA (after the profiled step) or ``kv_cache_space_gb`` on
    CPU, capped there at what every running sequence can fill. ``ValueError`` where
    that is less than one sequence of ``max_model_len``."""
    cache = config.cache
    device = config.model.device
    block_size = cache.block_size
    max_model_len = config.model.max_model_len
    per_block = PagedKVCache.bytes_per_block(specs, block_size, cache_dtype)
    if cache.num_gpu_blocks_override is not None:
        blocks = cache.num_gpu_blocks_override
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(
            device)
        budget = total * cache.gpu_memory_utilization - used - peak_extra
        blocks = int(budget // per_block)
    else:
        blocks = int(cache.kv_cache_space_gb * (1 << 30) // per_block)
        # More blocks than every running sequence can fill at full length only cost
        # start-up time and memory on CPU.
        useful = config.scheduler.max_num_seqs * -(-max_model_len // block_size)
        blocks = min(blocks, useful)
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"max_model_len: the KV cache holds {blocks} blocks of {block_size} "
            f"tokens, fewer than one sequence of max_model_len={max_model_len} needs "
            f"({needed}); lower max_model_len or give the cache more memory "
            f"(kv_cache_space_gb / gpu_memory_utilization / num_gpu_blocks_override)")
    logger.info("KV cache: %d blocks of %d tokens in %s (%.1f MiB)", blocks, block_size,
                str(cache_dtype).removeprefix("torch."), blocks * per_block / 2**20)
    return blocks
