"""What a quantized checkpoint's format tells its loader: which tensors mark a quantized
linear layer, and how one layer's tensors become a ``QuantizedWeight``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["CheckpointFormat", "TensorGetter"]

#: A checkpoint tensor by its full name (``model.layers.0.mlp.up_proj.qweight``);
#: ``KeyError`` where the checkpoint has none by that name.
TensorGetter = Callable[[str], torch.Tensor]


class CheckpointFormat(Protocol):
    """One quantized checkpoint format, configured from its ``quantization_config``."""

    #: The name users and vLLM give it (``gptq``, ``awq``, ``compressed-tensors``).
    method: str

    @property
    def marker(self) -> str:
        """The tensor suffix whose presence makes a linear layer quantized."""
        ...

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        """Every tensor suffix a quantized layer may have in this format."""
        ...

    def read_layer(self, prefix: str, get: TensorGetter) -> QuantizedWeight:
        """The layer at ``prefix`` (``model.layers.0.mlp.up_proj``), unpacked."""
        ...

