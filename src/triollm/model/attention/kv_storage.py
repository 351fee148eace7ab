"""The KV cache's element types in torch: the dtype a ``--kv-cache-dtype`` stores, and
keys and values written into it.

An 8-bit cache (``float8_e5m2``, ``float8_e4m3fn``; model/quantization/kv_cache_dtype.py)
is written by torch's rounding cast (to nearest even; e4m3 saturates at +-448, e5m2
overflows to infinity) and read back by a widening one. Each reader converts: the C
decode kernel in its loads (csrc/fp8.h), torch's paths with ``.to``. torch has no
``index_copy_`` for float8 tensors, so writes copy the bytes.
"""

from __future__ import annotations

import torch

from triollm.model.quantization.kv_cache_dtype import KV_CACHE_DTYPES

__all__ = ["EIGHT_BIT_CACHE_DTYPES", "cache_storage_dtype", "is_eight_bit", "write_slots"]

#: The 8-bit element types a cache may be stored in.
EIGHT_BIT_CACHE_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def cache_storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The dtype ``kv_cache_dtype`` stores the cache in; None for ``auto`` (the runner's
    choice)."""
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    if name is None:
        return None
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def is_eight_bit(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is quantized to 8 bits (read through a conversion)."""
    return dtype in EIGHT_BIT_CACHE_DTYPES


def write_slots(cache: torch.Tensor, slots: torch.Tensor, tensor: torch.Tensor) -> None:
    """``tensor`` (``[heads, T, dim]``) cast to the dtype of ``cache`` (``[heads, blocks,
    block_size, dim]``) and written at the flat token ``slots``."""
    heads, _, _, dim = cache.shape
    tensor = tensor.to(cache.dtype)
    if is_eight_bit(cache.dtype):
        cache, tensor = cache.view(torch.uint8), tensor.view(torch.uint8)
    cache.view(heads, -1, dim).index_copy_(1, slots, tensor)
