"""Integers packed into int32 words, low bits first, as GPTQ, AWQ and
compressed-tensors store them."""

from __future__ import annotations

import torch

__all__ = ["unpack_int32"]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, *,
                 transpose: bool = False) -> torch.Tensor:
    """The unsigned ``bits``-bit values packed along ``dim`` of a 2-D int32 tensor, as
    int32: value ``j`` of word ``i`` (bits ``j * bits`` up) becomes index
    ``i * (32 // bits) + j`` of ``dim``. ``transpose``: the result transposed, made
    contiguous in the same pass."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not pack evenly into int32 words")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32)
    # the values of each word go on a new axis right after ``dim``; unpacking the
    # transposed words along the other dimension gives the transposed result
    if transpose:
        words = words.t()
        dim = 1 - dim
    if dim == 1:
        values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return values.reshape(words.shape[0], -1)
    values = (words.unsqueeze(1) >> shifts[:, None]) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1])
