"""Integers packed into int32 words, low bits first, as GPTQ, AWQ and
compressed-tensors store them."""

from __future__ import annotations

import torch

__all__ = ["unpack_int32"]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit values packed along ``dim`` of an int32 tensor, as
    int32: value ``j`` of word ``i`` (bits ``j * bits`` up) becomes index
    ``i * (32 // bits) + j`` of ``dim``."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not pack evenly into int32 words")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.to(torch.int32).movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return values.movedim(-1, dim).contiguous()
