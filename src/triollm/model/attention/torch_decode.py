"""The decode attention in torch: single-token queries over their blocks, read in place.

``paged_decode_attention`` is written so that ``torch.compile`` fuses the block lookup
into the attention's two reductions, and the keys and values are read where they lie
rather than copied out first (an 8-bit cache widened on the way). Compiled, it is the
CPU decode kernel where the C one (model/cpu/decode.py) cannot be built; it also is the
reference the C kernel is checked against when it loads.
"""

from __future__ import annotations

import functools

import torch

from triollm.model.attention.kernel import DecodeKernel
from triollm.model.attention.kv_storage import is_eight_bit
from triollm.model.attention.metadata import visible_keys

__all__ = ["compiled_paged_decode_attention", "paged_decode_attention"]


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Single-token queries ``[B, Hq, D]`` over their sequences' blocks, read in place.

    ``block_tables`` is ``[B, max_blocks]`` (padded with any valid block id) and
    ``context_lens`` ``[B]``. Written so that ``torch.compile`` fuses the block lookup
    into the two reductions; run eagerly it is correct but materialises the lookups."""
    batch, max_blocks = block_tables.shape
    kv_heads, _, block_size, dim = key_cache.shape
    groups = query.shape[1] // kv_heads
    length = max_blocks * block_size
    q = query.reshape(batch, kv_heads, groups, dim).permute(1, 0, 2, 3)  # [Hkv, B, G, D]
    keys = key_cache[:, block_tables]  # [Hkv, B, max_blocks, block_size, D]
    if is_eight_bit(key_cache.dtype):  # torch promotes no float8 type: widened first
        keys = keys.to(query.dtype)
    scores = (q[:, :, :, None, None, :] * keys[:, :, None]).sum(-1)
    scores = scores.reshape(kv_heads, batch, groups, length) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(length, device=query.device)[None, :]
    visible = visible_keys(positions, context_lens[:, None] - 1, sliding_window)
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).reshape(
        kv_heads, batch, groups, max_blocks, block_size, 1)
    values = value_cache[:, block_tables][:, :, None]  # [Hkv, B, 1, max_blocks, bs, D]
    if is_eight_bit(value_cache.dtype):
        values = values.to(query.dtype)
    out = (weights * values).sum(dim=(3, 4))  # [Hkv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(batch, kv_heads * groups, dim)


@functools.cache
def _compiled_decode() -> DecodeKernel:
    return torch.compile(paged_decode_attention, dynamic=True)


def compiled_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``paged_decode_attention`` through ``torch.compile`` (one process-wide compiled
    function, dynamic in batch and table width)."""
    query = query.contiguous()  # its strides vary with the step's size: a guard each
    batch, max_blocks = block_tables.shape
    if batch < 2 or max_blocks < 2:
        # Sizes 0 and 1 are specialised by torch.compile and would each cost a compile;
        # pad to 2 with a harmless extra row (context 1) or table column (masked out).
        rows, columns = max(batch, 2), max(max_blocks, 2)
        tables = block_tables.new_zeros(rows, columns)
        tables[:batch, :max_blocks] = block_tables
        lens = context_lens.new_ones(rows)
        lens[:batch] = context_lens
        padded = query.new_zeros(rows, *query.shape[1:])
        padded[:batch] = query
        query, block_tables, context_lens = padded, tables, lens
    return _compiled_decode()(query, key_cache, value_cache, block_tables, context_lens,
                              scale, sliding_window, softcap)[:batch]
