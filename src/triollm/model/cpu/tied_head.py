"""A tied LM head on AMX tiles over its embedding's own weight, without a copy.

A model whose LM head shares its weight with the token embeddings (Qwen2.5-0.5B to 3B,
Llama-3.2-1B and 3B: the models served on CPUs) reads that weight whole at every decode
step, and at the small sizes it is a large share of the weights: 136M of Qwen2.5-0.5B's
494M parameters. The embedding looks rows up in it, so it stays row-major and cannot be
packed into gemm.py's layout without a copy of its own. aten's ``linear`` reads it at
about half the memory's bandwidth; on CPUs with AMX-BF16 the C kernel
(``csrc/gemm_rows_amx.h``) reads the row-major weight in place at 1.7-1.8x that, one to
16 rows a call, 1.4x at 64 (docs/benchmarks.md); more rows than that (prompt logprobs,
large decode batches) go to aten's ``linear``. Elsewhere the head stays as it is (or,
where gemm_avx2.py's kernel is the bf16 one, gets a packed copy: packed_linear.py).

The head runs eagerly, after the compiled decoder, on torch's thread count; traced by
``torch.compile`` it is aten's ``linear`` again.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from triollm.model.cpu.gemm import CpuGemm, load_gemm

__all__ = ["MAX_ROWS", "TiedHead", "tied_head_on_tiles"]

logger = logging.getLogger(__name__)

#: The most rows a call takes to the tiles; more go to aten's ``linear``. From a few
#: dozen rows the kernel re-reads each unit's weights from cache per 16 rows, and at
#: 128-1024 rows it was 0.86-1.06x aten (docs/benchmarks.md).
MAX_ROWS = 64


class TiedHead(nn.Module):
    """``y = x @ weight.T + bias`` over ``weight`` as it is (shared with the
    embeddings), on AMX tiles."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 gemm: CpuGemm) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self._fp32_bias = None if bias is None else bias.detach().float()
        self._gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_dynamo_compiling() or x.dtype != torch.bfloat16
                or x.numel() > MAX_ROWS * self.in_features):
            return nn.functional.linear(x, self.weight, self.bias)
        return self._gemm.row_major(x, self.weight.detach(), self._fp32_bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, AMX tiles over the embedding's weight")


def tied_head_on_tiles(head: nn.Module) -> TiedHead | None:
    """A ``TiedHead`` for a tied ``nn.Linear`` head whose weight the AMX kernel takes as
    it is (CPU, bf16, contiguous, out a multiple of 16 and in of 32) and that gives what
    aten's ``linear`` gives on a random input; else None."""
    gemm = load_gemm()
    weight = head.weight
    if (type(head) is not nn.Linear or weight.device.type != "cpu" or gemm is None
            or not gemm.takes_row_major(weight.detach())):
        return None
    tied = TiedHead(weight, head.bias, gemm)
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)
                        ).bfloat16()
    with torch.no_grad():  # in bf16: an fp32 copy of a vocabulary's weight is large
        expected = nn.functional.linear(probe, weight, head.bias).float()
        got = tied(probe).float()
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max())):
        logger.warning("the AMX row-major kernel disagrees with aten's linear for the tied "
                       "LM head of shape %s; keeping aten's linear", tuple(weight.shape))
        return None
    return tied
