"""bf16 linear layers on CPUs with AVX2 and FMA but neither AVX512-BF16 (gemm.py's
kernel) nor what oneDNN needs to pack bf16 weights (avx512bw or avx_ne_convert): there
every bf16 layer would run aten's bf16 linear, which reads the weights at memory speed
for one row but costs about as much again for every further row (a prefill chunk of
512 rows runs ~8x slower than the same layer in fp32).

The kernel (``csrc/gemm_avx2.c``) reads gemm.py's packed layout ``[out/16][in/2][16][2]``:
a 32-bit lane holds one output's weights for two adjacent inputs, so each 256-bit load
is shifted (even input) and masked (odd input) into two fp32 vectors of 8 outputs, and
multiplied by broadcast fp32 inputs (the rows are widened to fp32 once per call). A
tile is 6 rows by 16 outputs (12 sums of the 16 ymm registers); with 1-3 rows the even
and odd inputs sum apart, so a row's dependency chains keep up with memory. Threads
split the output blocks and row tiles as gemm.c's do, on OpenMP or helpers.py's pool.
Sums are fp32, rounded to bf16 once.

A second entry point takes the weight unpacked, ``[out, in]`` row-major: a tied LM head
(whose weight is its embedding's) runs on it without a second copy of the vocabulary
matrix (tiles of 4 outputs by 3 rows of 8-wide dot products). Both are built only where
the CPU has AVX2 and FMA; speeds in docs/benchmarks.md (``benchmarks/packed_linear.py
--shapes qwen0.5b``).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from triollm.model.cpu.build import load_checked
from triollm.model.cpu.gemm import CpuGemm
from triollm.model.cpu.helpers import PooledFunction

__all__ = ["Avx2Gemm", "load_avx2_gemm"]


class Avx2Gemm(CpuGemm):
    """bf16 ``x @ weight.T + bias`` on AVX2+FMA, over gemm.py's packed layout (``pack``,
    calling the object) or an unpacked weight (``unpacked``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "triollm_gemm_avx2_bf16")
        self._unpacked = PooledFunction(
            library, "triollm_gemm_avx2_bf16_unpacked",
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], None)

    @staticmethod
    def fits_unpacked(weight: torch.Tensor) -> bool:
        """Whether ``unpacked`` takes this ``[out, in]`` weight: bf16, contiguous, out a
        multiple of 4 and in of 8."""
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.is_contiguous() and weight.shape[0] % 4 == 0
                and weight.shape[1] % 8 == 0)

    def unpacked(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        """``x @ weight.T + bias`` with ``weight`` as it is (``fits_unpacked``), ``bias``
        fp32 or None, ``x`` bf16 ``[..., in]``."""
        out_features, in_features = weight.shape
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"the bf16 GEMM takes bf16 [..., {in_features}] inputs, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty((*x.shape[:-1], out_features))
        if rows:
            self._unpacked(x.data_ptr(), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(),
                           rows, out_features, in_features)
        return out


def _agrees_with_torch(gemm: Avx2Gemm) -> bool:
    """Both entry points against fp32 ``F.linear``: one row, full and partial row tiles,
    one and several output blocks, with and without a bias."""
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features, with_bias in (
            (1, 48, 30, True), (6, 64, 64, False), (13, 16, 128, True), (40, 96, 34, False)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
        bias = torch.randn(out_features, generator=generator) if with_bias else None
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias)
        tolerance = 1e-2 * float(expected.abs().max())
        answers = [gemm(x, gemm.pack(weight), bias)]
        if gemm.fits_unpacked(weight):
            answers.append(gemm.unpacked(x, weight, bias))
        if not all(torch.allclose(got.float(), expected, rtol=1e-2, atol=tolerance)
                   for got in answers):
            return False
    return True


@cache
def load_avx2_gemm() -> Avx2Gemm | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where the CPU lacks AVX2 or FMA, there is no C compiler, or it disagrees."""
    return load_checked("gemm_avx2", "AVX2 bf16 GEMM kernel", Avx2Gemm, _agrees_with_torch,
                        fallback="aten's bf16 linear")
