"""bf16 linear layers on CPUs with AVX512-BF16, as a small C kernel over weights packed
once into the layout its dot-product instruction reads.

A decode step multiplies a few rows by every weight of the model, so its time is the
time to stream the weights from memory, and oneDNN's packed bf16 product
(packed_linear.py) reads them well below the memory's bandwidth. This kernel holds each weight as
``[out/16][in/2][16][2]``: one 64-byte load gives two input columns of 16 outputs, which
``vdpbf16ps`` multiplies by one broadcast pair of a row's inputs into 16 fp32 sums. A
tile is 8 rows by 32 outputs (16 accumulators in registers); threads split the output
columns (and, with many rows, the row tiles): torch's OpenMP threads, or, while the
thread policy computes on one thread beside busy cores, helpers.py's pool. The same
layout is what an AMX tile multiply reads as its second operand: on CPUs with AMX-BF16
(Sapphire Rapids and later Xeons) every row count runs on tiles instead, 32 rows by 32
outputs a unit (``csrc/gemm_amx.h``): as fast as ``vdpbf16ps`` at 1-4 rows, 1.5x
faster at 8, 2.4-4.4x at 16-64 (a token's weights from memory) and 4-5.6x at prefill's
hundreds (from cache). Its speed against oneDNN
(``benchmarks/packed_linear.py``) is in docs/benchmarks.md.

The library (``csrc/gemm.c``) is built for the CPU it runs on (build.py) and only where the
compiler targets AVX512-BF16; elsewhere ``load_gemm`` returns None and bf16 layers stay
on oneDNN. Sums are fp32, the output is rounded to bf16 once, as oneDNN does.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from triollm.model.cpu.build import load_checked
from triollm.model.cpu.helpers import PooledFunction

__all__ = ["CpuGemm", "agrees_with_torch", "load_gemm"]

class CpuGemm:
    """bf16 ``x @ weight.T + bias`` over a weight packed by ``pack``."""

    def __init__(self, library: ctypes.CDLL, name: str = "triollm_gemm_bf16") -> None:
        """``name``: the C entry point (gemm.c's, or gemm_avx2.c's over the same
        layout)."""
        self._function = PooledFunction(
            library, name,
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], None)
        self._tiles_from = getattr(library, "triollm_gemm_amx_from_rows", None)
        supported = getattr(library, "triollm_gemm_amx_supported", None)
        #: Whether products of enough rows run on AMX tiles (gemm_amx.h).
        self.has_tiles = bool(supported is not None and supported())
        self._rows = getattr(library, "triollm_gemm_rows_bf16", None) if self.has_tiles else None
        if self._rows is not None:
            self._rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            self._rows.restype = ctypes.c_int

    def use_tiles_from(self, rows: int) -> int:
        """Tests and benchmarks: AMX tiles take products from ``rows`` rows on (0:
        none), where the library has them, process-wide; returns the count before."""
        return int(self._tiles_from(rows)) if self._tiles_from is not None else 0

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the kernel takes this ``[out, in]`` weight: bf16, out a multiple of
        16 and in of 2."""
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` → ``[out/16, in/2, 16, 2]``, contiguous."""
        out_features, in_features = weight.shape
        return (weight.detach().reshape(out_features // 16, 16, in_features // 2, 2)
                .permute(0, 2, 1, 3).contiguous())

    def takes_row_major(self, weight: torch.Tensor) -> bool:
        """Whether ``row_major`` multiplies by this ``[out, in]`` weight as it is: on AMX
        tiles, bf16, contiguous, out a multiple of 16 and in of 32."""
        return (self._rows is not None and weight.dtype == torch.bfloat16
                and weight.dim() == 2 and weight.is_contiguous()
                and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0)

    def row_major(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
        """bf16 ``x @ weight.T + bias`` over a row-major weight that ``takes_row_major``
        (csrc/gemm_rows_amx.h), on torch's thread count; ``bias`` is fp32 (or None)."""
        out_features, in_features = weight.shape
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"the bf16 GEMM takes bf16 [..., {in_features}] inputs, got "
                             f"{x.dtype} {tuple(x.shape)}")
        assert self._rows is not None and self.takes_row_major(weight)
        if not x.is_contiguous():
            x = x.contiguous()
        out = x.new_empty((*x.shape[:-1], out_features))
        failed = self._rows(x.data_ptr(), weight.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(),
                            x.numel() // in_features, out_features, in_features,
                            torch.get_num_threads())
        if failed == 2:
            raise MemoryError("no memory for the bf16 GEMM's transposed inputs")
        if failed:
            raise RuntimeError("the AMX tiles refused a row-major product")
        return out

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        """``bias`` is fp32 (or None); ``x`` is bf16 ``[..., in]``."""
        blocks, pairs, _, _ = packed.shape
        out_features, in_features = 16 * blocks, 2 * pairs
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"the bf16 GEMM takes bf16 [..., {in_features}] inputs, got "
                             f"{x.dtype} {tuple(x.shape)}")
        # Called ~60 times a decode step: no reshaping copies or views (each costs ~1 µs).
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty((*x.shape[:-1], out_features))
        if rows:
            self._function(x.data_ptr(), packed.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(),
                           rows, out_features, in_features)
        return out


def agrees_with_torch(gemm: CpuGemm, tile_rows: int = 8) -> bool:
    """A kernel over the packed layout against fp32 ``F.linear`` on random shapes: one
    row, one and two output blocks per tile, full and partial tiles of ``tile_rows``
    rows (and of AMX's 16 and 32), with and without a bias; where it has AMX tiles, with
    and without them."""
    if not gemm.has_tiles:
        return _agrees_on_shapes(gemm, tile_rows)
    tiles_from = gemm.use_tiles_from(0)
    try:
        if not _agrees_on_shapes(gemm, tile_rows):
            return False
    finally:
        gemm.use_tiles_from(tiles_from)
    return _agrees_on_shapes(gemm, tile_rows)


def _agrees_on_shapes(gemm: CpuGemm, tile_rows: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features, with_bias in (
            (1, 48, 30, True), (tile_rows, 64, 64, False), (13, 16, 128, True),
            (40, 96, 34, False), (50, 48, 96, True), (64, 32, 64, False)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
        bias = torch.randn(out_features, generator=generator) if with_bias else None
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias)
        got = gemm(x, gemm.pack(weight), bias).float()
        if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max())):
            return False
    return True


@cache
def load_gemm() -> CpuGemm | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where the CPU lacks AVX512-BF16, there is no C compiler, or it disagrees."""
    return load_checked("gemm", "bf16 GEMM kernel", CpuGemm, agrees_with_torch,
                        fallback="oneDNN's packed bf16 linear")
