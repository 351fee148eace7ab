"""The collectives that make a sharded layer's output whole (Megatron's scheme, as vLLM's
model_executor/layers/linear.py and vocab_parallel_embedding.py use it).

- A row-parallel layer (o_proj, down_proj) holds a slice of its input columns: a
  forward hook sums the partial products over the ranks (one all-reduce), then adds
  the bias once (``RowParallelOutput``).
- The LM head holds a slice of the vocabulary's rows: a hook gathers the slices' logits
  in rank order and drops the padding past the vocabulary (``GatheredLogits``).
- ``VocabParallelEmbedding`` replaces the token embedding: each rank holds a slice of
  the vocabulary's rows, a token outside it embeds to zeros there, and an all-reduce
  fills it in.

Column-parallel layers (q/k/v, gate/up) need nothing: their weight is sliced in place
and the next row-parallel layer sums what they started. The hooks go on the modules
triollm computes with (packed or quantized), after ``prepare_for_cpu`` replaced them, so
the CPU kernels run on each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.model.parallel.group import RankGroup

__all__ = ["GatheredLogits", "RowParallelOutput", "VocabParallelEmbedding"]


class RowParallelOutput:
    """A forward hook: the layer's output summed over the ranks, plus ``bias``."""

    def __init__(self, group: RankGroup, bias: torch.Tensor | None) -> None:
        self.group = group
        self.bias = bias

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = self.group.all_reduce(output.contiguous())
        return output if self.bias is None else output + self.bias


class GatheredLogits:
    """A forward hook on the LM head: every rank's slice of the logits, joined."""

    def __init__(self, group: RankGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(output)[..., :self.vocab_size]


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of an embedding (``weight`` is padded to an equal
    share), summed over the ranks."""

    def __init__(self, weight: nn.Parameter, start: int, rows: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.rows = rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out.contiguous())
