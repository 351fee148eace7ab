"""What the paged attention asks of a decode kernel.

A decode kernel attends single-token queries over their sequences' blocks, read in
place from the paged cache. Two implement it: the C kernel (model/cpu/decode.py) and
``paged_decode_attention`` through ``torch.compile`` (torch_decode.py). The C kernel also
takes a whole step of decodes in one call, writes into the cache included
(``DecodeStepKernel``); the runner finds out once, at set-up, which one it has.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["DecodeKernel", "DecodeStep", "DecodeStepKernel"]


class DecodeKernel(Protocol):
    """Single-token queries ``[B, Hq, D]`` over their sequences' blocks: ``block_tables``
    ``[B, max_blocks]`` (padded with any valid block id), ``context_lens`` ``[B]``;
    returns ``[B, Hq, D]``."""

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor: ...


class DecodeStep(Protocol):
    """A layer's attention for a step of decodes only, in one call: ``key`` and ``value``
    (``[Hkv, T, D]``) written into the caches at ``slot_mapping``, then the queries
    (``[Hq, T, D]``) over their sequences; returns ``[Hq, T, D]``, or None, having
    written nothing, for inputs it does not take."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor | None: ...


@runtime_checkable
class DecodeStepKernel(DecodeKernel, Protocol):
    """A decode kernel that also runs a step of decodes only in one call."""

    def decode_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                    softcap: float | None) -> torch.Tensor | None: ...
