"""The LM head of a model quantized on the fly (``--quantization int8`` / ``int4``): a
``RescoredHead`` (rescored_head.py) over the head's own weight and an int4 copy of it.

At one decode row the head is read whole every step, and in a small model it is a
large share of the weights (Qwen2.5-0.5B: 136M of 494M parameters), so a full-precision
head bounds what quantizing the decoder gains (docs/benchmarks.md). On-the-fly
quantization therefore ranks the vocabulary on an int4 copy (``HEAD_BITS`` bits in groups
of ``HEAD_GROUP_SIZE``) whatever the decoder's bits, and computes the leading candidates'
logits, and every logit where logprobs are asked for, on the weight as loaded. The head
keeps that weight (a tied head shares it with the embedding), so the copy adds to the
memory; the start-up log states how much. Checkpoints (GPTQ, AWQ, compressed-tensors)
keep their head as stored, as vLLM does.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from triollm.model.cpu.tied_head import tied_head_on_tiles
from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.rescored_head import (
    CHUNK,
    CHUNKS,
    MAX_ROWS,
    MAX_ROWS_ON_TILES,
    RescoredHead,
)

__all__ = ["HEAD_BITS", "HEAD_GROUP_SIZE", "lm_head_name", "quantize_lm_head"]

logger = logging.getLogger(__name__)

#: The bits and group size of the copy that ranks the vocabulary.
HEAD_BITS = 4
HEAD_GROUP_SIZE = 64


def lm_head_name(model: nn.Module) -> str | None:
    """The module name of ``model``'s LM head where it is a plain ``nn.Linear``; None
    where it has none (a pooling model) or another kind of layer."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return None
    return next(name for name, module in model.named_modules() if module is head)


@torch.no_grad()
def quantize_lm_head(model: nn.Module) -> RescoredHead | None:
    """Replace ``model``'s LM head (``lm_head_name``) by a ``RescoredHead`` over its
    weight, in place. Returns the new head, or None where there is no such head or no
    kernel takes its int4 copy (the head stays)."""
    name = lm_head_name(model)
    if name is None:
        return None
    head = model.get_submodule(name)
    assert isinstance(head, nn.Linear)
    weight = head.weight
    coarse = quantized_or_plain(quantize_weight(weight, HEAD_BITS, HEAD_GROUP_SIZE), None,
                                weight.dtype)
    if not isinstance(coarse, QuantizedLinear):
        return None
    tiles = tied_head_on_tiles(head)
    layer = RescoredHead(weight, head.bias, coarse.kernel, tiles or head,
                         MAX_ROWS if tiles is None else MAX_ROWS_ON_TILES)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, layer)
    uses = Counter(id(parameter) for _, parameter in
                   model.named_parameters(remove_duplicate=False))
    logger.info("the %sLM head ranks the vocabulary on an int%d copy of its weight in "
                "groups of %d (%s kernel, %.1f MiB more memory); %d logits a row and "
                "every logit of a step wanting logprobs are computed on the weight",
                "tied " if uses[id(weight)] > 1 else "", HEAD_BITS, coarse.group_size,
                coarse.kernel.name, layer.nbytes / 2**20, CHUNK * CHUNKS)
    return layer
