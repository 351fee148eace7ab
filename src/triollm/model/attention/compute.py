"""Paged attention itself: write a step's keys and values into one layer's cache, then
attend.

Decodes attend one call per group of similar context length: through the decode kernel
where the runner has one (model/attention/kernel.py), which reads the blocks in place;
else the group's blocks are gathered into a reused workspace and handed to SDPA. A step
of decodes only, on a kernel with a one-call step, does the cache writes and the
attention in that one call. Each prefill chunk attends on its own, causally, over its
cached prefix plus itself.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from triollm.model.attention.kv_storage import is_eight_bit, write_slots
from triollm.model.attention.metadata import PagedAttentionMetadata
from triollm.model.cpu.build import cpu_flags

__all__ = ["attend", "attention_dtype", "write_and_attend"]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``[B, Hq, Lq, D]`` attention over ``[B, Hkv, Lk, D]``; a ``None`` mask means causal."""
    groups = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=groups > 1,
        )
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def attention_dtype(model_dtype: torch.dtype, key_cache: torch.Tensor, prefill: bool
                    ) -> torch.dtype:
    """What SDPA computes in over ``key_cache``: on CPU, a bf16 model's prefill chunks in
    bf16 where the CPU has AMX-BF16 (torch's flash attention runs on its tiles, 2-2.6x
    faster than fp32 from 128 tokens, docs/benchmarks.md), all else in fp32 (several
    times faster than bf16 without AMX; decodes as the C decode kernel computes);
    elsewhere in the cache's dtype, or fp32 over an 8-bit cache."""
    if key_cache.device.type == "cpu":
        return (torch.bfloat16 if prefill and model_dtype == torch.bfloat16
                and _has_amx_bf16() else torch.float32)
    return torch.float32 if is_eight_bit(key_cache.dtype) else key_cache.dtype


@cache
def _has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def write_and_attend(
    meta: PagedAttentionMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Write the step's keys and values into one layer's cache and attend: ``[H, T, D]``
    in, ``[Hq, T, D]`` out in the query's dtype."""
    assert meta.kv_cache is not None
    group = meta.one_call_group()
    if group is not None and meta.decode_step is not None:
        # A step of decodes only: the cache writes and the attention in one call (the
        # C kernel's; it returns None for inputs it does not take).
        out = meta.decode_step(q, k, v, meta.slot_mapping, key_cache, value_cache,
                               group.block_tables, group.context_lens, scale,
                               sliding_window, softcap)
        if out is not None:
            return out
    heads, _, _, dim = key_cache.shape
    # The cache may be narrower than the model (bf16 or 8 bits on CPU, read by the C
    # decode kernel); each result is rounded to the model's dtype as it is stored.
    write_slots(key_cache, meta.slot_mapping, k)
    write_slots(value_cache, meta.slot_mapping, v)

    out = torch.empty_like(q)
    block_size = key_cache.shape[2]
    compute = attention_dtype(q.dtype, key_cache, prefill=False)
    for group in meta.decode_groups:
        group_q = q[:, group.start:group.end].to(compute)
        if meta.decode_kernel is not None:
            out[:, group.start:group.end] = meta.decode_kernel(
                group_q.transpose(0, 1), key_cache, value_cache,
                group.block_tables, group.context_lens, scale, sliding_window, softcap,
            ).transpose(0, 1)
            continue
        batch, max_blocks = group.block_tables.shape
        flat = group.block_tables.reshape(-1)
        length = max_blocks * block_size
        gathered_k = meta.kv_cache.gather(key_cache, flat, "k").view(
            heads, batch, length, dim).to(compute)
        gathered_v = meta.kv_cache.gather(value_cache, flat, "v").view(
            heads, batch, length, dim).to(compute)
        decode_q = group_q.transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
        decode_out = attend(decode_q, gathered_k.transpose(0, 1), gathered_v.transpose(0, 1),
                             group.mask(sliding_window, block_size), scale, softcap)
        out[:, group.start:group.end] = decode_out[:, :, 0].transpose(0, 1)
    compute = attention_dtype(q.dtype, key_cache, prefill=True)
    for index, chunk in enumerate(meta.prefills):
        chunk_q = q[:, chunk.query_start:chunk.query_end].to(compute)
        if chunk.context_len == chunk.num_query:
            chunk_k = k[:, chunk.query_start:chunk.query_end].to(compute)
            chunk_v = v[:, chunk.query_start:chunk.query_end].to(compute)
        else:
            chunk_k = key_cache[:, chunk.block_ids].view(heads, -1, dim)[
                :, : chunk.context_len].to(compute)
            chunk_v = value_cache[:, chunk.block_ids].view(heads, -1, dim)[
                :, : chunk.context_len].to(compute)
        mask = meta.prefill_mask(index, sliding_window)
        chunk_out = attend(chunk_q[None], chunk_k[None], chunk_v[None], mask, scale, softcap)
        out[:, chunk.query_start:chunk.query_end] = chunk_out[0]
    return out
