"""Swapping a loaded model's linear layers for quantized ones, before the runner packs
what is left (model/runners/setup.py).

``replace_linear_layers`` takes the ``QuantizedWeight`` of each layer by its module name
(as ``model.named_modules()`` names it: ``model.layers.0.self_attn.q_proj``), as a
checkpoint reader unpacks them; ``quantize_linear_layers`` makes them from the float
weights (``--quantization int8`` / ``int4``), one layer at a time so that the
full-precision and the integer copies of the model never coexist, and the LM head
onto an int8 copy (lm_head.py; a tied one also ranks greedy rows on an int4 copy). The
embeddings and any other weight another module shares stay as loaded; a checkpoint's
head stays as stored.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.lm_head import quantize_lm_head
from triollm.model.quantization.methods import ON_THE_FLY_BITS
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.rescored_head import RescoredHead
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["quantizable_layers", "quantize_linear_layers", "replace_linear_layers",
           "weight_bytes"]

logger = logging.getLogger(__name__)


def replace_linear_layers(model: nn.Module, weights: Mapping[str, QuantizedWeight], *,
                          method: str = "checkpoint") -> int:
    """Replace each ``nn.Linear`` of ``model`` named in ``weights`` by a layer that computes
    on that quantized weight (its bias kept, its float weight dropped), in place; a
    layer no kernel takes gets its weight dequantized into the model's dtype instead.
    Returns how many layers were replaced. ``KeyError`` for a name that is not an
    ``nn.Linear`` of ``model``. ``method`` names the quantization in the log."""
    modules = dict(model.named_modules())
    kernels: Counter[str] = Counter()
    layouts: set[str] = set()
    for name, weight in weights.items():  # one pass: a checkpoint reads each layer lazily
        kernels[_replace(model, modules, name, weight)] += 1
        layouts.add(_layout(weight))
    _log(model, method, layouts, kernels)
    return sum(kernels.values())


@torch.no_grad()
def quantize_linear_layers(model: nn.Module, method: str, group_size: int) -> int:
    """Quantize ``model``'s linear layers (``quantizable_layers``) with an on-the-fly
    ``method`` (methods.py) in groups of ``group_size`` input columns (-1: per
    channel; int8 is always per channel), and its LM head onto quantized copies
    (lm_head.py), in place. Returns how many decoder layers were replaced."""
    bits = ON_THE_FLY_BITS[method]
    modules = dict(model.named_modules())
    kernels: Counter[str] = Counter()
    layouts: set[str] = set()
    for name in quantizable_layers(model):
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        weight = quantize_weight(linear.weight, bits, group_size)
        kernels[_replace(model, modules, name, weight)] += 1
        layouts.add(_layout(weight))
    quantize_lm_head(model)
    _log(model, method, layouts, kernels)
    return sum(kernels.values())


def quantizable_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s ``nn.Linear`` layers that on-the-fly quantization
    replaces: all but the LM head and those sharing a weight with another module."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    uses = Counter(id(parameter) for _, parameter in
                   model.named_parameters(remove_duplicate=False))
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and module is not head
            and uses[id(module.weight)] == 1]


def weight_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s weights take: its parameters and buffers (each once) and its
    quantized layers' packed tensors (a ``RescoredHead``'s copies included)."""
    tensors = {id(t): t.nbytes for t in [*model.parameters(), *model.buffers()]}
    return sum(tensors.values()) + sum(
        module.nbytes for module in model.modules()
        if isinstance(module, (QuantizedLinear, RescoredHead)))


def _replace(model: nn.Module, modules: dict[str, nn.Module], name: str,
             weight: QuantizedWeight) -> str:
    """Put the layer for ``weight`` in place of the ``nn.Linear`` called ``name``; returns
    the kernel's name, or the dtype it was dequantized into."""
    linear = modules.get(name)
    if not isinstance(linear, nn.Linear):
        raise KeyError(f"{name!r} is not a linear layer of the model")
    layer = quantized_or_plain(weight, linear.bias, linear.weight.dtype)
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, layer)
    modules[name] = layer
    if isinstance(layer, QuantizedLinear):
        return layer.kernel.name
    return f"dequantized to {str(layer.weight.dtype).removeprefix('torch.')}"


def _layout(weight: QuantizedWeight) -> str:
    group = ("per channel" if int(weight.scales.shape[1]) == 1
             else f"group size {weight.group_size}")
    return f"{weight.bits} bits, {group}" + (", act order" if weight.group_index is not None
                                            else "")


def _log(model: nn.Module, method: str, layouts: set[str], kernels: Counter[str]) -> None:
    how = ", ".join(f"{count} {kind}" if kind.startswith("dequantized")
                    else f"{count} by the {kind} kernel" for kind, count in sorted(kernels.items()))
    logger.info("quantization %s (%s): %d linear layers (%s); the weights take %.1f MiB",
                method, "; ".join(sorted(layouts)), sum(kernels.values()), how,
                weight_bytes(model) / 2**20)
    if any(kind.startswith("dequantized") for kind in kernels):
        logger.warning("quantization %s: the layers no kernel takes compute in the "
                       "model's dtype, not quantized", method)
