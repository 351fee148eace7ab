"""The canonical form of one quantized linear layer's weight, between the checkpoint
formats (GPTQ, AWQ, compressed-tensors, on-the-fly) and the kernels.

Every format's loader unpacks its tensors into ``QuantizedWeight``; every kernel packs a
``QuantizedWeight`` into its own layout. Neither side knows the other's format.

The weight it stands for is, for output row ``n`` and input column ``k`` in group
``g = group_of(k)``::

    w[n, k] = (qweight[n, k] - zeros[n, g]) * scales[n, g]

with ``qweight`` holding unsigned integers in ``[0, 2**bits)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedWeight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear layer's weight, quantized, in the layout above.

    ``qweight``: ``[out_features, in_features]`` int32 (values in ``[0, 2**bits)``).
    ``scales``: ``[out_features, num_groups]`` float32.
    ``zeros``: ``[out_features, num_groups]`` float32, the zero points in the integer
    domain (``2**(bits - 1)`` for a symmetric format); may be fractional only where
    a format stores a float zero.
    ``group_size``: input columns per group; ``in_features`` for one group per row
    (per-channel).
    ``group_index``: ``[in_features]`` int32, the group of each input column where
    columns are not grouped in order (GPTQ's ``desc_act``); None: column ``k`` is in
    group ``k // group_size``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    group_index: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    def groups(self) -> torch.Tensor:
        """``[in_features]``: the group of each input column."""
        if self.group_index is not None:
            return self.group_index.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight it stands for, in ``dtype``."""
        if self.group_index is None and self.in_features % self.group_size == 0:
            # groups in order: broadcast each group's scale and zero over its columns
            q = self.qweight.float().view(self.out_features, -1, self.group_size)
            weight = (q - self.zeros.float()[:, :, None]) * self.scales.float()[:, :, None]
            return weight.view(self.out_features, self.in_features).to(dtype)
        groups = self.groups()
        q = self.qweight.float()
        weight = (q - self.zeros.float()[:, groups]) * self.scales.float()[:, groups]
        return weight.to(dtype)
