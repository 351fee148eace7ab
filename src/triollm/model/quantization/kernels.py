"""torch's CPU weight-only kernels, each packing a ``QuantizedWeight`` into its layout.

``Int4Kernel``: ``torch._weight_int4pack_mm_for_cpu``, for weights of at most 4 bits in
equal groups (GPTQ's ``desc_act`` order included: the columns are permuted so that
groups are contiguous, and each input's columns the same way). The op dequantizes
``(q - 8) * scale + zero`` with ``zero`` in the float domain, so the canonical integer
zero ``z`` is stored as ``(8 - z) * scale``. It takes group sizes of 32, 64, 128 and 256
and an output size that is a multiple of 16; a larger group (per-channel included) is
written as several of one of those sizes with the same scale and zero.

``Int8Kernel``: ``torch._weight_int8pack_mm``, for one group per output channel with
integer zero points (``q - z`` fits a signed byte), a scale per channel.

Both compute in the activations' dtype (bfloat16, float16 or float32; on CPU they are
several times faster in bfloat16) on 2-D inputs, so inputs are flattened to rows.
"""

from __future__ import annotations

import torch

from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["Int4Kernel", "Int8Kernel", "QuantizedKernel", "kernel_for"]

_INT4_GROUP_SIZES = (256, 128, 64, 32)


class QuantizedKernel:
    """A packed weight and the op that multiplies rows by it."""

    name: str
    #: the bytes its packed weight, scales and zero points take
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _equal_groups(weight: QuantizedWeight) -> tuple[torch.Tensor | None, int] | None:
    """The column permutation that makes the groups contiguous (None: already in order)
    and the size of each group; None where groups differ in size."""
    num_groups = int(weight.scales.shape[1])
    if weight.group_index is None:
        if num_groups == 1:
            return None, weight.in_features
        if weight.group_size * num_groups != weight.in_features:
            return None
        return None, weight.group_size
    groups = weight.group_index.long()
    counts = torch.bincount(groups, minlength=num_groups)
    size = int(counts[0])
    if bool((counts != size).any()) or size * counts.numel() != weight.in_features:
        return None
    permutation = torch.argsort(groups, stable=True)
    if bool((permutation == torch.arange(weight.in_features)).all()):
        return None, size
    return permutation, size


class Int4Kernel(QuantizedKernel):
    """``torch._weight_int4pack_mm_for_cpu`` over a weight of at most 4 bits."""

    name = "int4"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, permutation:
                 torch.Tensor | None, group_size: int, kernel_group_size: int) -> None:
        qweight = weight.qweight if permutation is None else weight.qweight[:, permutation]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(
            qweight.to(torch.int32).contiguous(), 2)
        repeat = group_size // kernel_group_size
        scales = weight.scales.float().repeat_interleave(repeat, dim=1)
        zeros = (8 - weight.zeros.float().repeat_interleave(repeat, dim=1)) * scales
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(
            dtype).contiguous()
        self.group_size = kernel_group_size
        self.permutation = permutation
        self.out_features = weight.out_features
        self.nbytes = (self.packed.nbytes + self.scales_and_zeros.nbytes
                       + (0 if permutation is None else permutation.nbytes))

    @staticmethod
    def build(weight: QuantizedWeight, dtype: torch.dtype) -> Int4Kernel | None:
        """The kernel for ``weight``, or None where its shape or layout does not fit."""
        if weight.bits > 4 or weight.out_features % 16:
            return None
        groups = _equal_groups(weight)
        if groups is None:
            return None
        permutation, size = groups
        kernel_size = next((s for s in _INT4_GROUP_SIZES if size % s == 0), None)
        if kernel_size is None:
            return None
        return Int4Kernel(weight, dtype, permutation, size, kernel_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.permutation is not None:
            x = x.index_select(-1, self.permutation)
        out = torch._weight_int4pack_mm_for_cpu(_rows(x), self.packed, self.group_size,
                                                self.scales_and_zeros)
        return out.view(*x.shape[:-1], self.out_features)


class Int8Kernel(QuantizedKernel):
    """``torch._weight_int8pack_mm`` over a per-channel weight with integer zeros."""

    name = "int8"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        signed = weight.qweight.to(torch.int32) - weight.zeros.to(torch.int32)
        self.weight = signed.to(torch.int8).contiguous()
        self.scales = weight.scales[:, 0].to(dtype).contiguous()
        self.out_features = weight.out_features
        self.nbytes = self.weight.nbytes + self.scales.nbytes

    @staticmethod
    def build(weight: QuantizedWeight, dtype: torch.dtype) -> Int8Kernel | None:
        """The kernel for ``weight``, or None where it has more than one group per
        channel or zero points that do not fit."""
        if weight.bits > 8 or weight.scales.shape[1] != 1:
            return None
        zeros = weight.zeros
        if not bool((zeros == zeros.round()).all()):
            return None
        signed_low = int(weight.qweight.min()) - int(zeros.max())
        signed_high = int(weight.qweight.max()) - int(zeros.min())
        if signed_low < -128 or signed_high > 127:
            return None
        return Int8Kernel(weight, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(_rows(x), self.weight, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


def kernel_for(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedKernel | None:
    """The fastest of torch's kernels that computes ``weight`` in ``dtype`` (int4's where
    it fits, else int8's), or None where neither does."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if not (hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
            and hasattr(torch, "_weight_int8pack_mm")):
        return None
    return Int4Kernel.build(weight, dtype) or Int8Kernel.build(weight, dtype)
