"""Weight-only int4 and int8 products on integer dot products, for CPUs with
AVX512-VNNI and VBMI (Ice Lake and later Xeons, Zen 4), where the fp32 AVX-512 kernel
(avx512_kernels.py) is bound by turning each weight into a float (docs/benchmarks.md).

The C library (``csrc/qgemm_vnni.c``) takes the AVX2 kernel's layouts, so a layer packs
as for the other kernels: ``VnniInt4Kernel`` and ``VnniInt8Kernel`` are the AVX2
kernels on this library. Each call turns the bf16 inputs into 15-bit integers, a
power-of-two scale per row and block of up to 128 inputs, split into two signed bytes,
and multiplies them with the weight's bytes in exact int32 dot products (``vpdpbusd``,
64 products an instruction). The rounding that adds is at most 2^-14 of the block's
largest input, and none for the inputs within seven binades of it, against bf16's own
2^-9 of every input: the products agree with the fp32 kernel's to bf16's precision.
From a few dozen rows on an AMX CPU the layer is dequantized for torch's ``linear`` as
``Avx512Gemm`` does; int8 weights whose width is not a multiple of 8 stay on the fp32
kernel. Built and checked against the dequantized product at load (build.py's
``load_checked``) where the CPU has AVX-512 F, BW, VL, VBMI and VNNI.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from triollm.model.cpu.build import load_checked
from triollm.model.quantization.avx2_kernels import (
    Avx2Int4Kernel,
    Avx2Int8Kernel,
    agrees_with_dequantized,
    native_kernel_for,
)
from triollm.model.quantization.avx512_kernels import Avx512Gemm, load_avx512_gemm
from triollm.model.quantization.kernels import QuantizedKernel
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["VnniGemm", "VnniInt4Kernel", "VnniInt8Kernel", "load_vnni_gemm",
           "vnni_kernel_for"]


class VnniGemm(Avx512Gemm):
    """The VNNI library's product, with the fp32 AVX-512 kernel (``fp32``) for int8
    widths that are not a multiple of 8 and its dequantization for many rows."""

    def __init__(self, library: ctypes.CDLL, fp32: Avx512Gemm) -> None:
        super().__init__(fp32.library, "triollm_qgemm_vnni", library)
        self.fp32 = fp32

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 out_features: int, group_size: int) -> torch.Tensor:
        if not group_size and x.shape[-1] % 8:
            return self.fp32(x, weight, scales, out_features, group_size)
        return super().__call__(x, weight, scales, out_features, group_size)


class VnniInt4Kernel(Avx2Int4Kernel):
    """A weight of at most 4 bits in equal groups, on the VNNI kernel."""

    name = "int4-vnni"


class VnniInt8Kernel(Avx2Int8Kernel):
    """A per-channel weight of at most 8 bits with integer zeros, on the VNNI kernel."""

    name = "int8-vnni"


@cache
def load_vnni_gemm() -> VnniGemm | None:
    """The kernel for this machine, built on first use and checked against the
    dequantized product; None where the CPU lacks AVX-512 F, BW, VL, VBMI or VNNI, the
    AVX-512 kernel is not there, there is no C compiler, or it disagrees."""
    fp32 = load_avx512_gemm()
    if not isinstance(fp32, Avx512Gemm):
        return None
    return load_checked("qgemm_vnni", "VNNI int4/int8 kernel",
                        lambda library: VnniGemm(library, fp32),
                        lambda gemm: agrees_with_dequantized(
                            gemm, VnniInt4Kernel.build, VnniInt8Kernel.build),
                        fallback="the fp32 AVX-512 int4/int8 kernel")


def vnni_kernel_for(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedKernel | None:
    """avx2_kernels.py's ``native_kernel_for`` on the VNNI kernel."""
    return native_kernel_for(weight, dtype, load_vnni_gemm, VnniInt4Kernel, VnniInt8Kernel)
