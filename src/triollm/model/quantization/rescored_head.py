"""``RescoredHead``: an LM head that ranks the vocabulary on an int4 copy of its weight and
computes the leading candidates' logits exactly, on the weight itself.

At one decode row the head reads its whole weight every step, and in the small models
served on CPUs it is a large share of the weights (Qwen2.5-0.5B: 136M of 494M
parameters). An int4 copy reads a quarter of a bf16 head's bytes. Its logits carry int4's
rounding error, so they serve to find the candidates: the vocabulary's columns are dealt
into ``CHUNK``-column chunks (``candidates``), and every logit of the ``CHUNKS`` chunks
with the largest maxima (256 a row) is recomputed on the full-precision rows. They hold
the copy's ``CHUNKS`` largest logits; at Qwen2.5-0.5B's shape the copy errs by about a
tenth of the logits' spread, and over 256 random rows the full head's greedy token was
always among them (benchmarks/lm_head.py). The greedy token and the leading candidates'
logits are then the full head's; a token outside them keeps the copy's logit.

Where every logit must be the full head's (``exact_logits``: the runner asks for it in a
step with a request wanting logprobs or prompt logprobs) and for more rows than the copy
ranks (``MAX_ROWS_ON_TILES`` where the full weight runs on AMX tiles, cpu/tied_head.py,
else ``MAX_ROWS`` on aten's ``linear``), the head computes on its full weight. A
compiled model calls the head as the opaque op ``triollm::rescored_head``, which reads
``exact_logits`` when it runs.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from triollm.model.ops import define_op
from triollm.model.quantization.kernels import QuantizedKernel

__all__ = ["CHUNK", "CHUNKS", "MAX_ROWS", "MAX_ROWS_ON_TILES", "RescoredHead", "candidates",
           "exact_logits", "rescored_head"]

#: The logits a chunk holds, and the chunks whose logits are all recomputed.
CHUNK = 16
CHUNKS = 16
#: The most rows the int4 copy ranks; more (prompt logprobs, large batches) compute on
#: the full weight, whose cost per row falls as rows are added: on AMX tiles from a few
#: rows on (at 16 rows of Qwen2.5-0.5B's head, 15-17 ms against the int4 copy's 22 ms;
#: at 4, 16-17 ms against 7-7.5), on aten's ``linear`` from a few dozen.
MAX_ROWS = 64
MAX_ROWS_ON_TILES = 8

_step = threading.local()


@contextlib.contextmanager
def exact_logits(wanted: bool) -> Iterator[None]:
    """While it lasts, heads on this thread compute every logit on the full weight
    (``wanted``) or rank on their int4 copy (the default)."""
    _step.exact = wanted
    try:
        yield
    finally:
        _step.exact = False


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


class _Compute:
    """The head's product, held apart from the module so that the op's registry does not
    keep the module alive."""

    def __init__(self, coarse: QuantizedKernel, weight: torch.Tensor,
                 bias: torch.Tensor | None, exact: Callable[[torch.Tensor], torch.Tensor],
                 max_rows: int) -> None:
        self.coarse = coarse
        self.weight = weight
        self.bias = bias
        self.exact = exact
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if (getattr(_step, "exact", False) or rows.shape[0] > self.max_rows
                or not rows.shape[0]):
            return self.exact(x)
        logits = self.coarse(rows)
        if self.bias is not None:
            logits = logits + self.bias
        index = candidates(logits)
        picked = self.weight.index_select(0, index.flatten()).view(
            *index.shape, rows.shape[1])
        recomputed = torch.bmm(picked, rows.to(picked.dtype)[:, :, None])[..., 0]
        if self.bias is not None:
            recomputed = recomputed + self.bias[index]
        flat = index + torch.arange(0, logits.numel(), logits.shape[1],
                                    device=index.device)[:, None]
        logits.view(-1)[flat.flatten()] = recomputed.flatten().to(logits.dtype)
        return logits.view(*x.shape[:-1], logits.shape[1])


class RescoredHead(nn.Module):
    """``y = x @ weight.T + bias`` with the logits outside each row's candidates
    (``candidates``) from ``coarse``, an int4 copy of ``weight``, up to ``max_rows``
    rows; ``exact`` computes them all on ``weight``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 coarse: QuantizedKernel, exact: Callable[[torch.Tensor], torch.Tensor],
                 max_rows: int = MAX_ROWS) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.coarse_kernel = coarse.name
        self._compute = _Compute(coarse, weight.detach(), self.bias, exact, max_rows)
        self.handle = next(_handles)
        _registered[self.handle] = self._compute
        weakref.finalize(self, _registered.pop, self.handle, None)

    @property
    def nbytes(self) -> int:
        """The bytes of the int4 copy (its packed weight, scales and zero points)."""
        return self._compute.coarse.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return rescored_head(x, self.handle, self.out_features)
        return self._compute(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, ranked by {self.coarse_kernel}, "
                f"{CHUNKS} chunks of {CHUNK} recomputed")


_handles = itertools.count()
#: handle -> the product of every live ``RescoredHead``.
_registered: dict[int, _Compute] = {}


def _rescored_head(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return _registered[handle](x)


def _rescored_head_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


#: ``RescoredHead`` number ``handle``'s logits, as an op a compiled graph can call.
rescored_head = define_op(
    "rescored_head(Tensor x, int handle, int out_features) -> Tensor",
    _rescored_head, _rescored_head_fake)
