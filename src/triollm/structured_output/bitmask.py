"""Allowed-token bitmasks applied to a step's logits in torch, batched: one int32
bitmask ``[rows, ceil(vocab / 32)]`` for the step's constrained rows, unpacked through a
byte table and applied with one add, on any device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GrammarMask", "allocate_bitmask", "apply_bitmask", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask the matchers fill (pinned to copy to a GPU without a sync)."""
    return torch.empty((rows, bitmask_words(vocab_size)), dtype=torch.int32,
                       pin_memory=pin_memory)


_PENALTIES: dict[torch.device, torch.Tensor] = {}


def _penalties(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: for each byte value, 0 where bit ``j`` is set, -inf where
    it is clear."""
    table = _PENALTIES.get(device)
    if table is None:
        clear = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0
        table = _PENALTIES[device] = torch.zeros(256, 8).masked_fill_(
            clear, float("-inf")).to(device)
    return table


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every token of float32 ``logits[rows[i]]`` whose bit is
    clear in ``bitmask[i]``.

    The words are read as bytes (little-endian: token ``t`` is bit ``t % 8`` of byte
    ``t // 8``), each byte looked up in a table of eight 0/-inf penalties, and the
    penalties added to the logits: one gather and one add, both vectorized. (A
    ``masked_fill`` with the unpacked boolean mask costs several times more on CPU.)
    """
    if not rows:
        return
    vocab = logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True).contiguous()
    penalty = _penalties(logits.device).index_select(
        0, words.view(torch.uint8).view(-1).int()).view(len(rows), -1)[:, :vocab]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)


@dataclass(frozen=True)
class GrammarMask:
    """A step's bitmask and, for each of its rows, the sampling row it constrains."""

    bitmask: torch.Tensor
    rows: list[int]

    def select(self, row: int) -> GrammarMask | None:
        """The mask of sampling row ``row`` alone (as row 0), or None if it has none."""
        if row not in self.rows:
            return None
        i = self.rows.index(row)
        return GrammarMask(self.bitmask[i:i + 1], [0])
