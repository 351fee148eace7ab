"""A float weight quantized into a ``QuantizedWeight`` at load (``--quantization int8`` /
``int4``): round to nearest, no calibration data.

``int8``: symmetric, one scale per output channel, ``absmax / 127`` (the zero point is
128, so ``qweight - 128`` is the signed byte). ``int4`` (and any other bit count below 8):
asymmetric per group, the group's ``[min, max]`` (widened to hold 0) spread over
``[0, 2**bits - 1]`` with an integer zero point.
"""

from __future__ import annotations

import torch

from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["group_size_for", "quantize_weight"]

_KERNEL_GROUP_SIZES = (256, 128, 64, 32)


def group_size_for(in_features: int, group_size: int) -> int:
    """The group size a layer of ``in_features`` inputs takes for the asked ``group_size``
    (-1: per channel): that size where it divides ``in_features``, else the largest of
    the int4 kernel's sizes (256, 128, 64, 32) below it that does, else one group per
    output channel."""
    if group_size == -1 or group_size >= in_features:
        return in_features
    if in_features % group_size == 0:
        return group_size
    for size in _KERNEL_GROUP_SIZES:
        if size < group_size and in_features % size == 0:
            return size
    return in_features


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """``weight`` ``[out, in]`` quantized to ``bits`` (8: symmetric per channel; fewer:
    asymmetric in groups of ``group_size_for(in, group_size)`` columns)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    if bits == 8:
        absmax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scales = absmax / 127
        qweight = (torch.round(w / scales).clamp(-127, 127) + 128).to(torch.int32)
        zeros = torch.full_like(scales, 128.0)
        return QuantizedWeight(qweight, scales, zeros, bits=8, group_size=in_features)
    size = group_size_for(in_features, group_size)
    grouped = w.reshape(out_features, in_features // size, size)
    low = grouped.amin(dim=2).clamp(max=0)
    high = grouped.amax(dim=2).clamp(min=0)
    top = 2**bits - 1
    scales = ((high - low) / top).clamp(min=1e-12)
    zeros = torch.round(-low / scales).clamp(0, top)
    q = torch.round(grouped / scales[..., None]) + zeros[..., None]
    qweight = q.clamp(0, top).reshape(out_features, in_features).to(torch.int32)
    return QuantizedWeight(qweight, scales, zeros, bits=bits, group_size=size)
