"""Paged attention, plugged into transformers' models through ``AttentionInterface``.

The model runs one forward per engine step over a flattened ``[1, T]`` batch (decodes
first, then prefill chunks; metadata.py). The step's metadata travels as the
``triollm_metadata`` keyword through an eager model call, which transformers passes down
to every attention layer; a compiled model calls the ``triollm::paged_attention`` op
instead (op.py). The first forward, with a ``ProfileRecorder`` and no cache, finds the
attention layers and their keys' and values' shapes.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from triollm.model.attention.compute import attend, write_and_attend
from triollm.model.attention.metadata import (
    LAYER_ATTRIBUTE,
    KVCacheSpec,
    PagedAttentionMetadata,
)
from triollm.model.attention.op import paged_attention

__all__ = ["ATTENTION_NAME", "paged_attention_forward"]

ATTENTION_NAME = "triollm_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    triollm_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: ``[1, H, T, D]`` in, ``[1, T, H, D]`` out."""
    if query.shape[0] != 1:
        raise RuntimeError("triollm runs one flattened [1, T] batch per forward")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(sliding_window, int) and sliding_window <= 0:
        sliding_window = None
    # not is_compiling(): that is true on every thread while one compiles
    if torch.compiler.is_dynamo_compiling():
        out = paged_attention(query[0], key[0], value[0], getattr(module, LAYER_ATTRIBUTE),
                              scale, sliding_window, softcap)
        return out.transpose(0, 1).unsqueeze(0), None
    meta = triollm_metadata
    if meta is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside triollm's model runner")
    q, k, v = query[0], key[0], value[0]  # [H, T, D]

    if meta.profile is not None:
        meta.profile.layers[id(module)] = KVCacheSpec(k.shape[0], k.shape[-1])
        out = attend(q[None], k[None], v[None], None, scale, softcap)
        return out.transpose(1, 2), None

    if meta.kv_cache is None:
        raise RuntimeError("paged attention called without a KV cache")
    key_cache, value_cache = meta.kv_cache.layer(module)
    out = write_and_attend(meta, key_cache, value_cache, q, k, v, scale, sliding_window, softcap)
    return out.transpose(0, 1).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
