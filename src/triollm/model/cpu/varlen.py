"""Prompt attention for pooling steps on CPUs with AVX-512, as a small C kernel.

A pooling step holds whole prompts packed into one row (model/attention/varlen.py), and
each prompt attends only to itself. torch's CPU SDPA takes one call per prompt, after a
copy of q, k and v to fp32; this kernel does one call per layer for every prompt of the
step, split over (prompt, KV head) pairs on torch's OpenMP threads. It runs fp32 on
AVX-512 and bf16 on AVX512-BF16. In bf16, per pair it packs the keys as
``[keys/16][dim/2][16][2]`` and the values as ``[dim/16][keys/2][16][2]``, the layout
``vdpbf16ps`` reads, then per tile of 8 query rows: the scores in fp32 registers, an
exact softmax over the whole row (prompts are short enough to hold a tile's scores),
probabilities rounded to bf16 as flash attention does on GPUs, and the values summed
into the output rows in registers. Bidirectional or causal; grouped-query heads; sums
in fp32. Head sizes must be multiples of 16; the caller keeps SDPA for anything else
and for sliding windows.

Built from ``csrc/varlen.c`` for the CPU it runs on (build.py) and checked against SDPA
when it loads; ``load_varlen_kernel`` returns None on CPUs without AVX-512 or without a
compiler, or where it disagrees. Measured speed: docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F

from triollm.model.cpu.build import load_checked

__all__ = ["VarlenKernel", "load_varlen_kernel", "packed_sdpa"]

class VarlenKernel:
    """Every prompt of a packed row attending to itself, in one call per layer."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.triollm_varlen_attention
        function.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10
                             + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int])
        function.restype = ctypes.c_int
        self._function = function
        supported = library.triollm_varlen_supported()
        #: The element types this CPU runs (fp32 on AVX-512, bf16 also with AVX512-BF16).
        self.dtypes = frozenset(
            dtype for bit, dtype in ((1, torch.float32), (2, torch.bfloat16)) if supported & bit)

    def takes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the kernel runs these ``[1, heads, T, dim]`` CPU inputs: one element
        type it supports here, a head size that is a multiple of 16, whole groups of
        query heads per KV head, and the last dimension contiguous."""
        return (query.dtype in self.dtypes and key.dtype == query.dtype
                and value.dtype == query.dtype and query.shape[-1] % 16 == 0
                and query.shape[1] % key.shape[1] == 0
                and all(t.stride(-1) == 1 and t.shape[0] == 1 for t in (query, key, value)))

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 starts: torch.Tensor, lengths: torch.Tensor, scale: float, causal: bool
                 ) -> torch.Tensor:
        """``query`` ``[1, heads, T, dim]``, ``key`` and ``value`` ``[1, kv_heads, T,
        dim]``, all fp32 or all bf16, as ``takes`` says; ``starts`` and ``lengths``
        int64, one per prompt. Returns ``[1, T, heads, dim]`` in the inputs' dtype."""
        if not self.takes(query, key, value):
            raise ValueError(f"the varlen attention kernel does not take {query.dtype} "
                             f"{tuple(query.shape)} queries with {key.dtype} "
                             f"{tuple(key.shape)} keys here")
        _, heads, total, dim = query.shape
        out = torch.empty((1, total, heads, dim), dtype=query.dtype)
        if self._function(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
                          starts.data_ptr(), lengths.data_ptr(), starts.numel(), heads,
                          key.shape[1], dim, query.stride(2), query.stride(1),
                          key.stride(2), key.stride(1), value.stride(2), value.stride(1),
                          scale, int(causal), int(query.dtype == torch.bfloat16),
                          torch.get_num_threads()):
            raise MemoryError("the varlen attention kernel could not allocate its scratch")
        return out


def packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                lengths: list[int], scale: float, causal: bool) -> torch.Tensor:
    """What the kernel computes, by fp32 SDPA one prompt at a time (for checking it):
    ``[1, heads, T, dim]`` inputs, ``[1, T, heads, dim]`` fp32 out."""
    heads, kv_heads = query.shape[1], key.shape[1]
    parts, start = [], 0
    for length in lengths:
        part = slice(start, start + length)
        parts.append(F.scaled_dot_product_attention(
            query[:, :, part].float(), key[:, :, part].float(), value[:, :, part].float(),
            is_causal=causal, scale=scale, enable_gqa=heads != kv_heads).transpose(1, 2))
        start += length
    return torch.cat(parts, dim=1)


def _agrees_with_sdpa(kernel: VarlenKernel) -> bool:
    """The kernel against fp32 SDPA on random prompts, in each dtype it supports: head
    sizes 16, 32, 64 and 80, grouped-query heads, causal and not, lengths on and off the
    tile sizes."""
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 40, 1, 33, 8]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    total = sum(lengths)
    for dtype in kernel.dtypes:
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for dim, heads, kv_heads, causal in ((16, 4, 2, False), (32, 2, 2, True),
                                             (80, 3, 1, False), (64, 2, 1, True)):
            q, k, v = (torch.randn(1, count, total, dim, generator=generator).to(dtype)
                       for count in (heads, kv_heads, kv_heads))
            got = kernel(q, k, v, starts, torch.tensor(lengths), dim ** -0.5, causal)
            expected = packed_sdpa(q, k, v, lengths, dim ** -0.5, causal)
            if not torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance):
                return False
    return True


@cache
def load_varlen_kernel() -> VarlenKernel | None:
    """The kernel for this machine, built on first use and checked against SDPA; None
    where the CPU lacks AVX-512, there is no C compiler, or it disagrees (SDPA then)."""
    return load_checked("varlen", "varlen attention kernel", VarlenKernel, _agrees_with_sdpa,
                        fallback="torch's SDPA, one call per prompt,")
