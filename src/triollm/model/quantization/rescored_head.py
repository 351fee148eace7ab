"""``RescoredHead``: a tied LM head whose greedy rows rank the vocabulary on an int4 copy
and recompute the leading candidates on the weight itself; every other row computes on
an int8 copy.

At one decode row the head reads its whole weight every step, and in the small models
served on CPUs it is a large share of the weights (Qwen2.5-0.5B: 136M of 494M
parameters). An int8 copy reads half a bf16 head's bytes, an int4 copy a quarter, but
int4's rounding (about a tenth of the logits' spread at Qwen2.5-0.5B's shape, against
int8's hundredth: benchmarks/lm_head.py) is too coarse for logits that are reported or
sampled from. A row whose request wants only the argmax of its logits (greedy, no
logprobs, nothing that changes the logits first: ``ScheduledRequest.wants_only_the_argmax``,
which the runner passes as ``argmax_rows``) needs them only to find the largest: its
int4 logits find the candidates (``candidates``: 256 a row, which hold the copy's 16
largest), and those are recomputed on the full-precision weight. Its greedy token is then
the full head's wherever the full head's largest logit is among the candidates, which
it was in every one of 256 random rows at Qwen2.5-0.5B's shape (benchmarks/lm_head.py).
Every other row (sampled, reporting logprobs, under a grammar, penalties, a bias or
allowed tokens, and any row outside a runner's step) computes on the int8 copy. Which
path a row takes depends on its own request only, so a row's logits do not depend on
the rest of its batch.

The head runs eagerly after the compiled decoder (runners/compile.py compiles the model
less its head).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from triollm.model.quantization.kernels import QuantizedKernel

__all__ = ["CHUNK", "CHUNKS", "RescoredHead", "argmax_rows", "candidates"]

#: The columns a chunk holds, and the chunks whose logits are all recomputed.
CHUNK = 16
CHUNKS = 16

_step = threading.local()


@contextlib.contextmanager
def argmax_rows(rows: Sequence[bool] | None) -> Iterator[None]:
    """While it lasts, ``RescoredHead`` calls on this thread take, for each row of their
    input, whether only the argmax of its logits is wanted (None: of no row)."""
    previous = getattr(_step, "rows", None)
    _step.rows = rows
    try:
        yield
    finally:
        _step.rows = previous


def candidates(logits: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` indices into ``logits`` ``[rows, vocab]``: every member of the
    ``CHUNKS`` chunks with the largest maxima, and the columns past the last whole
    stride. Chunk ``j`` is the ``CHUNK`` columns ``j, j + stride, j + 2 * stride, ...``
    (``stride = vocab // CHUNK``), whose maxima are an elementwise maximum over ``CHUNK``
    contiguous spans. The chunks with the largest maxima hold each row's ``CHUNKS``
    largest logits."""
    rows, vocab = logits.shape
    if vocab <= CHUNK * CHUNKS:
        return torch.arange(vocab, device=logits.device).expand(rows, -1)
    stride = vocab // CHUNK
    whole = stride * CHUNK
    spans = logits.as_strided((rows, CHUNK, stride), (logits.stride(0), stride, 1))
    best = spans.amax(1).topk(CHUNKS, dim=-1, sorted=False).indices
    offsets = torch.arange(0, whole, stride, device=logits.device)
    index = (best[..., None] + offsets).flatten(1)
    if whole == vocab:
        return index
    tail = torch.arange(whole, vocab, device=logits.device).expand(rows, -1)
    return torch.cat([index, tail], dim=1)


class RescoredHead(nn.Module):
    """``y = x @ weight.T + bias``: on ``ranking`` (an int4 copy of ``weight``) with each
    row's candidates recomputed on ``weight`` for the rows ``argmax_rows`` marks, on
    ``copy`` (an int8 copy) for the others."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 ranking: QuantizedKernel, copy: QuantizedKernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.ranking = ranking
        self.copy = copy

    @property
    def nbytes(self) -> int:
        """The bytes of the two copies (packed weights, scales and zero points) and the
        bias."""
        return (self.ranking.nbytes + self.copy.nbytes
                + (0 if self.bias is None else self.bias.nbytes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        marks = getattr(_step, "rows", None)
        if marks is None or len(marks) != rows.shape[0] or not any(marks):
            logits = self._copied(rows)
        elif all(marks):
            logits = self._ranked(rows)
        else:
            index = torch.tensor([i for i, mark in enumerate(marks) if mark],
                                 device=rows.device)
            others = torch.tensor([i for i, mark in enumerate(marks) if not mark],
                                  device=rows.device)
            first = self._ranked(rows[index])
            logits = first.new_empty((rows.shape[0], self.out_features))
            logits[index] = first
            logits[others] = self._copied(rows[others])
        return logits.view(*x.shape[:-1], self.out_features)

    def _copied(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.copy(rows)
        return logits if self.bias is None else logits + self.bias

    def _ranked(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.ranking(rows)
        if self.bias is not None:
            logits = logits + self.bias
        index = candidates(logits)
        weight = self.weight.detach()
        picked = weight.index_select(0, index.flatten()).view(*index.shape, rows.shape[1])
        recomputed = torch.bmm(picked, rows.to(picked.dtype)[:, :, None])[..., 0]
        if self.bias is not None:
            recomputed = recomputed + self.bias[index]
        flat = index + torch.arange(0, logits.numel(), logits.shape[1],
                                    device=index.device)[:, None]
        logits.view(-1)[flat.flatten()] = recomputed.flatten().to(logits.dtype)
        return logits

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, argmax rows ranked by {self.ranking.name} "
                f"({CHUNKS} chunks of {CHUNK} recomputed), others on {self.copy.name}")
