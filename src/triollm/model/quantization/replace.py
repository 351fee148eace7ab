"""Swapping a loaded model's linear layers for quantized ones, before the runner packs
what is left (model/runners/setup.py).

``replace_linear_layers`` takes the ``QuantizedWeight`` of each layer by its module name
(as ``model.named_modules()`` names it: ``model.layers.0.self_attn.q_proj``), whether a
checkpoint reader unpacked it or ``quantize_linear_layers`` made it from the float
weight (``--quantization int8`` / ``int4``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["replace_linear_layers"]


def replace_linear_layers(model: nn.Module, weights: Mapping[str, QuantizedWeight]) -> int:
    """Replace each ``nn.Linear`` of ``model`` named in ``weights`` by a layer that computes
    on that quantized weight (its bias kept, its float weight dropped), in place; a
    layer no kernel takes gets its weight dequantized into the model's dtype instead.
    Returns how many layers were replaced. ``KeyError`` for a name that is not an
    ``nn.Linear`` of ``model``."""
    raise NotImplementedError
