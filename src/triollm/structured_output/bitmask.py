"""Allowed-token bitmasks applied to a step's logits in torch, batched: one int32
bitmask ``[rows, ceil(vocab / 32)]`` for the step's constrained rows, unpacked with bit
operations and applied with one ``masked_fill``, on any device."""

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


_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(
            torch.int32).to(device)
    return bits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every token of ``logits[rows[i]]`` whose bit is clear in
    ``bitmask[i]``."""
    if not rows:
        return
    vocab = logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = (words.unsqueeze(-1) & _bits(logits.device)) != 0
    blocked = ~allowed.view(len(rows), -1)[:, :vocab]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(blocked, float("-inf"))


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
