"""One step's flattened batch: the scheduled requests turned into one forward's inputs.

Single-token queries (decodes) come first, then prefill chunks, with positions
restarting per sequence, a slot in the paged cache for every token, and
``logits_to_keep`` so the LM head only runs where a token is sampled (after every
position of a request with draft tokens) or a prompt log-probability is wanted.
Decodes are grouped by block-table width so that a group pads little
(``decode_spans``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triollm.model.attention.kernel import DecodeKernel, DecodeStep
from triollm.model.attention.metadata import (
    DecodeGroup,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillChunk,
)
from triollm.model.attention.op import forward_metadata
from triollm.model.quantization.rescored_head import argmax_rows
from triollm.step import ScheduledRequest

__all__ = ["DecodeAttention", "StepBatch", "decode_groups", "decode_spans", "prepare_batch",
           "run_forward"]

#: A decode joins a group if the group's longest block table is at most this many
#: times its own.
_MAX_DECODE_PADDING = 1.25


@dataclass(frozen=True)
class DecodeAttention:
    """How a runner's decodes attend, decided once at set-up."""

    #: The decode kernel; None: gather each group's blocks, then SDPA.
    kernel: DecodeKernel | None = None
    #: The kernel's one-call step for a step of decodes only, where it has one.
    step: DecodeStep | None = None
    #: Keys of padding a decode may add to join a group besides ``_MAX_DECODE_PADDING``
    #: (a kernel that reads each row's own blocks only is not slowed by padding).
    padding_keys: int = 0


def decode_spans(widths: list[int], padding_blocks: int) -> list[tuple[int, int]]:
    """Split decodes, sorted by block-table width longest first, into ``[start, end)``
    groups: a decode joins the group if padding it to the group's width adds at most a
    quarter (``_MAX_DECODE_PADDING``) or at most ``padding_blocks`` blocks."""
    spans = []
    start = 0
    while start < len(widths):
        width = widths[start]
        end = start + 1
        while end < len(widths) and (widths[end] * _MAX_DECODE_PADDING >= width
                                     or width - widths[end] <= padding_blocks):
            end += 1
        spans.append((start, end))
        start = end
    return spans


def decode_groups(tables: list[list[int]], lens: list[int], attention: DecodeAttention,
                  block_size: int, device: torch.device) -> list[DecodeGroup]:
    """The decodes' block tables (longest first) and context lengths in groups, each
    table padded with block 0 to its group's width."""
    groups = []
    for start, end in decode_spans([len(t) for t in tables],
                                   attention.padding_keys // block_size):
        width = len(tables[start])
        padded = [t + [0] * (width - len(t)) for t in tables[start:end]]
        groups.append(DecodeGroup(
            start, end,
            torch.tensor(padded, dtype=torch.long, device=device),
            torch.tensor(lens[start:end], dtype=torch.long, device=device)))
    return groups


@dataclass
class StepBatch:
    """A step's forward inputs: ``[T]`` tokens and positions, the rows of the logits to
    keep and, for each kept row, the index of the request it belongs to and whether only
    the argmax of its logits is wanted (quantization/rescored_head.py)."""

    metadata: PagedAttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    keep_owner: list[int]
    argmax_rows: list[bool]


def prepare_batch(items: list[ScheduledRequest], kv_cache: PagedKVCache,
                  attention: DecodeAttention, device: torch.device) -> StepBatch:
    """The flattened batch of ``items``, decodes (sorted longest context first) first."""
    block_size = kv_cache.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    keep: list[int] = []
    keep_owner: list[int] = []  # index into items, for each kept row
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    for index, item in enumerate(items):
        start = item.start_position
        count = item.num_tokens
        table = item.block_table
        query_start = len(input_ids)
        input_ids.extend(item.token_ids)
        span = range(start, start + count)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        if item.wants_prompt_logprobs or item.num_draft_tokens:
            keep.extend(range(query_start, query_start + count))
            keep_owner.extend([index] * count)
        elif item.sample:
            keep.append(query_start + count - 1)
            keep_owner.append(index)
        context_len = start + count
        if count == 1:
            decode_tables.append(table[: -(-context_len // block_size)])
            decode_lens.append(context_len)
        else:
            used = table[: -(-context_len // block_size)]
            prefills.append(PrefillChunk(
                query_start, query_start + count, context_len,
                torch.tensor(used, dtype=torch.long, device=device)))

    argmax_only = [item.wants_only_the_argmax for item in items]  # once per request
    metadata = PagedAttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_groups=decode_groups(decode_tables, decode_lens, attention, block_size,
                                    device),
        prefills=prefills,
        decode_kernel=attention.kernel,
        decode_step=attention.step,
    )
    return StepBatch(
        metadata,
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        torch.tensor(keep, dtype=torch.long, device=device),
        keep_owner,
        [argmax_only[owner] for owner in keep_owner],
    )


def run_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                keep: int | torch.Tensor, metadata: PagedAttentionMetadata,
                compiled: bool, argmax_only: list[bool] | None = None) -> torch.Tensor:
    """The logits of a ``[T]`` batch's ``keep`` rows (``argmax_only``: whether only the
    argmax of each is wanted, for quantization/rescored_head.py); a compiled model takes
    the metadata through ``forward_metadata`` instead of a keyword."""
    with argmax_rows(argmax_only):
        if compiled:
            with forward_metadata(metadata):
                return model(input_ids=input_ids[None], position_ids=positions[None],
                             use_cache=False, logits_to_keep=keep).logits[0]
        return model(input_ids=input_ids[None], position_ids=positions[None],
                     use_cache=False, logits_to_keep=keep, triollm_metadata=metadata
                     ).logits[0]
