"""The LM head of a model quantized on the fly (``--quantization int8`` / ``int4``): an
int8 copy, one scale per vocabulary row.

At one decode row the head is read whole every step, and in a small model it is a
large share of the weights (Qwen2.5-0.5B: 136M of 494M parameters), so a bf16 head
bounds what quantizing the decoder gains (docs/benchmarks.md). On-the-fly quantization
therefore also quantizes the head, to 8 bits whatever the decoder's bits (its rounding
error per logit is that of an int8 layer). A tied head keeps its embedding's weight for
the embedding and computes on the int8 copy (half the size again of a bf16 head, in
memory; the start-up log states it). Checkpoints (GPTQ, AWQ, compressed-tensors) keep
their head as stored, as vLLM does.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight

__all__ = ["HEAD_BITS", "lm_head_name", "quantize_lm_head"]

logger = logging.getLogger(__name__)

#: The bits of the head's copy.
HEAD_BITS = 8


def lm_head_name(model: nn.Module) -> str | None:
    """The module name of ``model``'s LM head where it is a plain ``nn.Linear``; None
    where it has none (a pooling model) or another kind of layer."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return None
    return next(name for name, module in model.named_modules() if module is head)


@torch.no_grad()
def quantize_lm_head(model: nn.Module) -> QuantizedLinear | None:
    """Replace ``model``'s LM head (``lm_head_name``) by an int8 ``QuantizedLinear``
    computing in its dtype, in place; the embedding keeps a tied weight. Returns the new
    head, or None where there is no such head or no kernel takes it (the head stays)."""
    name = lm_head_name(model)
    if name is None:
        return None
    head = model.get_submodule(name)
    assert isinstance(head, nn.Linear)
    weight = head.weight
    layer = quantized_or_plain(quantize_weight(weight, HEAD_BITS, -1), head.bias, weight.dtype)
    if not isinstance(layer, QuantizedLinear):
        return None
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, layer)
    uses = Counter(id(parameter) for _, parameter in
                   model.named_parameters(remove_duplicate=False))
    if uses[id(weight)]:
        logger.info("the tied LM head runs on an int8 copy of its weight (%s kernel): "
                    "%.1f MiB more memory", layer.kernel.name, layer.nbytes / 2**20)
    else:
        logger.info("the LM head runs quantized to int8 (%s kernel)", layer.kernel.name)
    return layer
