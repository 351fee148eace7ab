"""Weight-only int4 and int8 products in bf16 on CPUs with AVX2, FMA and F16C but no
AVX-512, where torch's kernels (kernels.py) read the weights well below memory speed.

The C library (``csrc/qgemm_avx2.c``) holds a weight per block of 16 outputs:

- ``Avx2Int4Kernel``: 4-bit values in equal groups (any size that is a multiple of 8,
  per channel included; GPTQ's ``desc_act`` columns permuted as for torch's kernel),
  8 nibbles of one output per 32-bit lane, and each group's scale and zero term
  ``scale * zero`` in fp16 (a weight whose scales fp16 would not hold stays on torch's
  kernel);
- ``Avx2Int8Kernel``: signed bytes (``q - zero``), a fp32 scale per output.

A unit of work is one block's product for up to 16 rows, 4 at a time (its weights
read from memory once, from cache for the further rows). At one row int8 runs near
memory speed on one core and int4 about half as fast per byte (unpacking nibbles is
its bound; more threads share it); it stays faster than gemm_avx2.py's bf16 kernel at
prefill's hundreds of rows too (docs/benchmarks.md), so it takes every row count.
Threads split the units: torch's OpenMP threads, or the helper pool (helpers.py)
where the thread policy computes on one thread.

Built where the CPU has AVX2, FMA and F16C and checked against the dequantized fp32
product at load (build.py's ``load_checked``); on AVX-512 CPUs, where the C build is
unavailable or disagrees, and for float32 or float16 activations, torch's kernels run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch

from triollm.model.cpu.build import cpu_flags, load_checked
from triollm.model.cpu.helpers import PooledFunction
from triollm.model.quantization.kernels import QuantizedKernel, _equal_groups
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["Avx2Int4Kernel", "Avx2Int8Kernel", "QuantizedGemm", "agrees_with_dequantized",
           "avx2_kernel_for", "fits_fp16", "fp16_scales", "load_quantized_gemm",
           "native_kernel_for"]

_FP16_TINY = 2.0 ** -14  # fp16's smallest normal number
_FP16_MAX = 65504.0


class QuantizedGemm:
    """A C library's product over either of its layouts (``entry``: the name of its
    plain C function)."""

    def __init__(self, library: ctypes.CDLL, entry: str = "triollm_qgemm_avx2") -> None:
        self.entry = entry
        #: The C product, on OpenMP or the helper pool.
        self.product = PooledFunction(library, entry,
                                       [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
                                       + [ctypes.c_int], ctypes.c_int)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 out_features: int, group_size: int) -> torch.Tensor:
        """bf16 ``x [..., in] @ W.T`` for the weight packed in ``weight`` and ``scales``
        (``group_size``: int4's; 0 for int8)."""
        in_features = x.shape[-1]
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.entry} takes bf16 inputs, got {x.dtype}")
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // in_features
        out = x.new_empty((*x.shape[:-1], out_features))
        if rows and not self.product(x.data_ptr(), weight.data_ptr(), scales.data_ptr(),
                                      out.data_ptr(), rows, out_features, in_features,
                                      group_size):
            raise MemoryError(f"no memory for {self.entry}'s scratch inputs")
        return out


class Avx2Int4Kernel(QuantizedKernel):
    """A weight of at most 4 bits in equal groups, on the AVX2 kernel."""

    name = "int4-avx2"

    def __init__(self, gemm: QuantizedGemm, weight: QuantizedWeight,
                 permutation: torch.Tensor | None, group_size: int) -> None:
        q = weight.qweight if permutation is None else weight.qweight[:, permutation]
        n, k = q.shape
        nibbles = q.to(torch.int64).reshape(n // 16, 16, k // 8, 8).permute(0, 2, 1, 3)
        words = (nibbles << torch.arange(0, 32, 4)).sum(-1)
        self.weight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        self.scales = fp16_scales(weight).contiguous()
        self.gemm = gemm
        self.permutation = permutation
        self.group_size = group_size
        self.out_features = n
        self.nbytes = (self.weight.nbytes + self.scales.nbytes
                       + (0 if permutation is None else permutation.nbytes))

    @classmethod
    def build(cls, gemm: QuantizedGemm, weight: QuantizedWeight) -> Avx2Int4Kernel | None:
        """The kernel for ``weight``, or None where its shape, groups or scales do not
        fit."""
        if weight.bits > 4 or weight.out_features % 16 or not fits_fp16(weight):
            return None
        groups = _equal_groups(weight)
        if groups is None or groups[1] % 8:
            return None
        return cls(gemm, weight, *groups)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.permutation is not None:
            x = x.index_select(-1, self.permutation)
        return self.gemm(x, self.weight, self.scales, self.out_features, self.group_size)


class Avx2Int8Kernel(QuantizedKernel):
    """A per-channel weight of at most 8 bits with integer zeros, on the AVX2 kernel."""

    name = "int8-avx2"

    def __init__(self, gemm: QuantizedGemm, weight: QuantizedWeight) -> None:
        signed = (weight.qweight.to(torch.int32) - weight.zeros.to(torch.int32)).to(torch.int8)
        n, k = signed.shape
        self.weight = signed.reshape(n // 16, 16, k).permute(0, 2, 1).contiguous()
        self.scales = weight.scales[:, 0].float().contiguous()
        self.gemm = gemm
        self.out_features = n
        self.nbytes = self.weight.nbytes + self.scales.nbytes

    @classmethod
    def build(cls, gemm: QuantizedGemm, weight: QuantizedWeight) -> Avx2Int8Kernel | None:
        """The kernel for ``weight``, or None where it has more than one group per
        channel, zero points that do not fit a signed byte, or an odd shape."""
        if (weight.bits > 8 or weight.scales.shape[1] != 1 or weight.out_features % 16
                or weight.in_features % 2):
            return None
        zeros = weight.zeros
        if not bool((zeros == zeros.round()).all()):
            return None
        if (int(weight.qweight.min()) - int(zeros.max()) < -128
                or int(weight.qweight.max()) - int(zeros.min()) > 127):
            return None
        return cls(gemm, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.scales, self.out_features, 0)


def fp16_scales(weight: QuantizedWeight) -> torch.Tensor:
    """``[out/16, groups, 2, 16]`` fp16: each group's scales, then its zero terms."""
    scales = weight.scales.float()
    terms = scales * weight.zeros.float()
    n, groups = scales.shape
    both = torch.stack([scales, terms]).reshape(2, n // 16, 16, groups)
    return both.permute(1, 3, 0, 2).to(torch.float16)


def fits_fp16(weight: QuantizedWeight) -> bool:
    """Whether fp16 holds every scale and zero term to its full precision."""
    for values in (weight.scales.float(), weight.scales.float() * weight.zeros.float()):
        magnitude = values.abs()
        if bool(((magnitude != 0) & (magnitude < _FP16_TINY)).any()) or bool(
                (magnitude > _FP16_MAX).any()):
            return False
    return True


def agrees_with_dequantized(
        gemm: QuantizedGemm,
        int4: Callable[[QuantizedGemm, QuantizedWeight], QuantizedKernel | None],
        int8: Callable[[QuantizedGemm, QuantizedWeight], QuantizedKernel | None]) -> bool:
    """A library's two layouts (built by ``int4`` and ``int8``) against the dequantized
    fp32 product: one row, partial and full chunks and units of 16 rows, groups of 8 to
    per channel, odd widths."""
    from triollm.model.quantization.quantize import quantize_weight

    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features, bits, group in (
            (1, 32, 64, 4, 32), (3, 16, 48, 4, 8), (16, 48, 128, 4, -1),
            (19, 32, 64, 4, 16), (1, 16, 30, 8, -1), (7, 32, 64, 8, -1),
            (34, 16, 34, 8, -1), (13, 32, 256, 4, 128), (37, 16, 64, 8, -1),
            (70, 32, 256, 4, 64), (66, 48, 64, 8, -1)):
        quantized = quantize_weight(torch.randn(out_features, in_features,
                                                generator=generator), bits, group)
        kernel = int4(gemm, quantized) if bits == 4 else int8(gemm, quantized)
        if kernel is None:
            return False
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x.float(), quantized.dequantize())
        got = kernel(x).float()
        if not torch.allclose(got, expected, rtol=1e-2,
                              atol=1e-2 * float(expected.abs().max())):
            return False
    return True


@cache
def load_quantized_gemm() -> QuantizedGemm | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where the CPU lacks AVX2, FMA or F16C, has AVX-512 (torch's kernels are its
    fast path there), there is no C compiler, or it disagrees."""
    if "avx512f" in cpu_flags():
        return None
    return load_checked("qgemm_avx2", "AVX2 int4/int8 kernel", QuantizedGemm,
                        lambda gemm: agrees_with_dequantized(
                            gemm, Avx2Int4Kernel.build, Avx2Int8Kernel.build),
                        fallback="torch's int4/int8 kernels")


def native_kernel_for(weight: QuantizedWeight, dtype: torch.dtype,
                      load: Callable[[], QuantizedGemm | None], int4: type[Avx2Int4Kernel],
                      int8: type[Avx2Int8Kernel]) -> QuantizedKernel | None:
    """The kernel of the library ``load`` gives for ``weight`` computing in ``dtype``
    (``int4``'s where it fits, else ``int8``'s), or None: not bf16, not this CPU, or a
    weight neither takes."""
    if dtype != torch.bfloat16 or weight.qweight.device.type != "cpu":
        return None
    gemm = load()
    if gemm is None:
        return None
    return int4.build(gemm, weight) or int8.build(gemm, weight)


def avx2_kernel_for(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedKernel | None:
    """``native_kernel_for`` on the AVX2 kernel."""
    return native_kernel_for(weight, dtype, load_quantized_gemm, Avx2Int4Kernel,
                             Avx2Int8Kernel)
