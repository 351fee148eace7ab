"""The ``--kv-cache-dtype`` values triollm honours, by vLLM's names (imports nothing
heavy, so that validating engine arguments does not load torch).

``auto`` keeps the cache in the model's dtype (fp32 where decode gathers blocks for
SDPA). The 8-bit caches store each key and value element as one byte, halving a bf16
cache: ``fp8_e5m2`` is a plain cast (fp16's top byte, no scale); ``fp8`` and
``fp8_e4m3`` are vLLM's names for e4m3 (``float8_e4m3fn``), stored with a scale of 1.0,
what vLLM uses for a checkpoint without calibrated k/v scales, saturating at +-448.
Checkpoints that carry k/v scales (compressed-tensors ``kv_cache_scheme``, fp8
checkpoints) are refused at load (docs/quantization.md), so no scale is ever dropped.
"""

from __future__ import annotations

__all__ = ["KV_CACHE_DTYPES", "check_kv_cache_dtype"]

#: Each honoured value and the torch dtype (its name in ``torch``) the cache is stored
#: in; None: the model's dtype, as decided by the runner.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "fp8_e5m2": "float8_e5m2",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}

#: Values vLLM knows that are not built here, with the reason.
_NOT_BUILT = {
    "int8_per_token_head": "int8 with per-token-head scales beside the cache is not built "
                           "(vLLM's CPU build does not offer it either)",
    "float16": "vLLM takes it only for models whose cache defaults to fp8",
    "bfloat16": "vLLM takes it only for models whose cache defaults to fp8",
}


def check_kv_cache_dtype(value: str) -> str | None:
    """Why ``value`` cannot be the KV cache's dtype (a sentence naming it), or None."""
    if value in KV_CACHE_DTYPES:
        return None
    honoured = ", ".join(KV_CACHE_DTYPES)
    reason = _NOT_BUILT.get(value, "triollm's attention does not read such a cache")
    return f"{value!r} is not supported ({reason}); use one of {honoured}"
