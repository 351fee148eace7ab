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

Built only where the CPU has AVX2 and FMA; speeds in docs/benchmarks.md
(``benchmarks/packed_linear.py --shapes qwen0.5b``).
"""

from __future__ import annotations

from functools import cache, partial

from triollm.model.cpu.build import load_checked
from triollm.model.cpu.gemm import CpuGemm, agrees_with_torch

__all__ = ["load_avx2_gemm"]


@cache
def load_avx2_gemm() -> CpuGemm | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where the CPU lacks AVX2 or FMA, there is no C compiler, or it disagrees."""
    return load_checked("gemm_avx2", "AVX2 bf16 GEMM kernel",
                        lambda library: CpuGemm(library, "triollm_gemm_avx2_bf16"),
                        partial(agrees_with_torch, tile_rows=6), fallback="aten's bf16 linear")
