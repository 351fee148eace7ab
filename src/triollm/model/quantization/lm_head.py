"""The LM head of a model quantized on the fly (``--quantization int8`` / ``int4``).

At one decode row the head is read whole every step, and in a small model it is a
large share of the weights (Qwen2.5-0.5B: 136M of 494M parameters), so a bf16 head
bounds what quantizing the decoder gains (docs/benchmarks.md). On-the-fly quantization
therefore also quantizes the head, whatever the decoder's bits: an int8 copy, one scale
per vocabulary row (its rounding per logit is that of an int8 layer). A tied head,
whose weight the embedding keeps anyway, becomes a ``RescoredHead``
(rescored_head.py): greedy rows rank on an int4 copy (``RANKING_BITS`` bits in groups
of ``RANKING_GROUP_SIZE``) and recompute their candidates on that weight, every other
row computes on the int8 copy. An untied head, and one no int4 kernel takes, is the
int8 copy alone (in place of its weight). The start-up log states the copies' memory.
Checkpoints (GPTQ, AWQ, compressed-tensors) keep their head as stored, as vLLM does.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.rescored_head import RescoredHead

__all__ = ["HEAD_BITS", "RANKING_BITS", "RANKING_GROUP_SIZE", "lm_head_name",
           "quantize_lm_head"]

logger = logging.getLogger(__name__)

#: The bits of the head's copy.
HEAD_BITS = 8
#: The bits and group size of a tied head's ranking copy.
RANKING_BITS = 4
RANKING_GROUP_SIZE = 64


def lm_head_name(model: nn.Module) -> str | None:
    """The module name of ``model``'s LM head where it is a plain ``nn.Linear``; None
    where it has none (a pooling model) or another kind of layer."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return None
    return next(name for name, module in model.named_modules() if module is head)


@torch.no_grad()
def quantize_lm_head(model: nn.Module) -> QuantizedLinear | RescoredHead | None:
    """Replace ``model``'s LM head (``lm_head_name``), in place: a tied one by a
    ``RescoredHead`` where kernels take both its copies, else by an int8
    ``QuantizedLinear`` computing in its dtype (the embedding keeps a tied weight).
    Returns the new head, or None where there is no such head or no kernel takes its
    int8 copy (the head stays)."""
    name = lm_head_name(model)
    if name is None:
        return None
    head = model.get_submodule(name)
    assert isinstance(head, nn.Linear)
    weight = head.weight
    copy = quantized_or_plain(quantize_weight(weight, HEAD_BITS, -1), head.bias, weight.dtype)
    if not isinstance(copy, QuantizedLinear):
        return None
    uses = Counter(id(parameter) for _, parameter in
                   model.named_parameters(remove_duplicate=False))
    tied = uses[id(weight)] > 1
    layer: QuantizedLinear | RescoredHead = copy
    ranking = quantized_or_plain(quantize_weight(weight, RANKING_BITS, RANKING_GROUP_SIZE),
                                 None, weight.dtype) if tied else None
    if isinstance(ranking, QuantizedLinear):
        layer = RescoredHead(weight, head.bias, ranking.kernel, copy.kernel)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, layer)
    if isinstance(layer, RescoredHead):
        logger.info("the tied LM head computes on an int8 copy of its weight (%s kernel), "
                    "greedy rows ranking on an int%d copy in groups of %d (%s kernel) "
                    "and recomputing their candidates on the weight: %.1f MiB more memory",
                    copy.kernel.name, RANKING_BITS, RANKING_GROUP_SIZE, layer.ranking.name,
                    layer.nbytes / 2**20)
    elif tied:
        logger.info("the tied LM head runs on an int8 copy of its weight (%s kernel): "
                    "%.1f MiB more memory", copy.kernel.name, copy.nbytes / 2**20)
    else:
        logger.info("the LM head runs quantized to int8 (%s kernel)", copy.kernel.name)
    return layer
