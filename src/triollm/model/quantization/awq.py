"""AWQ checkpoints (AutoAWQ's GEMM version): ``qweight`` int32 ``[K, N / 8]`` and
``qzeros`` int32 ``[groups, N / 8]``, both packed along the output dimension with the
8 columns of a word in AWQ's order (nibble ``i`` holds column ``_ORDER[i]``),
``scales`` ``[groups, N]``; 4-bit, with zero points."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from triollm.model.quantization.checkpoint_format import TensorGetter
from triollm.model.quantization.packing import unpack_int32
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["AWQFormat"]

_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQFormat:
    """An AWQ checkpoint's layers, by its ``quantization_config``."""

    method = "awq"
    marker = "qweight"
    tensor_suffixes = ("qweight", "qzeros", "scales")

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits != 4:
            raise ValueError(f"AWQ with bits={self.bits} is not supported (supported: 4)")
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (supported: gemm)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        # column c of a word sits in nibble self._columns[c]
        self._columns = torch.tensor([_ORDER.index(c) for c in range(8)])

    def read_layer(self, prefix: str, get: TensorGetter) -> QuantizedWeight:
        qweight = self._unpack(get(f"{prefix}.qweight"))  # [N, K]
        in_features = qweight.shape[1]
        zeros = self._unpack(get(f"{prefix}.qzeros")).float()  # [N, groups]
        scales = get(f"{prefix}.scales").t().float().contiguous()
        group_size = in_features if self.group_size in (-1, 0) else self.group_size
        return QuantizedWeight(qweight=qweight, scales=scales, zeros=zeros, bits=self.bits,
                               group_size=min(group_size, in_features))

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[rows, N / 8]`` words → ``[N, rows]`` values in column order."""
        values = unpack_int32(packed, self.bits, dim=1, transpose=True)  # nibble order
        columns, rows = values.shape
        return values.view(columns // 8, 8, rows)[:, self._columns].reshape(columns, rows)
