"""Weight-only int4 and int8 products in bf16 on CPUs with AVX512-BF16, where torch's
kernels (kernels.py) are bound by unpacking, far below memory speed (docs/benchmarks.md).

The C library (``csrc/qgemm_avx512.c``) turns the integer weights into bf16 in
registers and multiplies them with ``vdpbf16ps``, the bf16 inputs used as they come.
Per block of 16 outputs:

- ``Avx512Int4Kernel``: 4-bit values in equal groups (any size that is a multiple of 8,
  per channel included; GPTQ's ``desc_act`` columns permuted as for torch's kernel); in
  a step of 8 inputs, 16-bit word ``2j + t`` holds output ``j``'s inputs ``2s + t`` in
  its nibbles ``s``; each group's scale and zero term ``scale * zero`` in fp16 (a
  weight whose scales fp16 would not hold stays on torch's kernel);
- ``Avx512Int8Kernel``: signed bytes (``q - zero``) in pairs of inputs per output, a
  fp32 scale per output.

A unit of work is one block's product for up to 16 rows, 8 at a time, so many rows
cost about what the packed bf16 GEMM costs them (the weights are unpacked once per 8
rows). Threads split the units: torch's OpenMP threads, or the helper pool
(helpers.py) where the thread policy computes on one thread. Built where the CPU has
AVX512-BF16 and checked against the dequantized fp32 product at load (build.py's
``load_checked``); elsewhere, where it disagrees, and for float32 or float16
activations, the AVX2 kernel (avx2_kernels.py) or torch's kernels run.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

import torch

from triollm.model.cpu.build import load_checked
from triollm.model.quantization.avx2_kernels import (
    QuantizedGemm,
    agrees_with_dequantized,
    fits_fp16,
    fp16_scales,
)
from triollm.model.quantization.kernels import QuantizedKernel, _equal_groups
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["DEQUANTIZE_FROM_ROWS", "Avx512Gemm", "Avx512Int4Kernel", "Avx512Int8Kernel",
           "avx512_kernel_for", "load_avx512_gemm"]

#: From this many rows a layer's weight is dequantized into bf16, a slice of outputs at a
#: time, and multiplied by torch's bf16 ``linear`` (oneDNN, on AMX where the CPU has it),
#: which outruns unpacking the weight once per 8 rows.
DEQUANTIZE_FROM_ROWS = 64
#: The most bf16 elements one slice of a dequantized weight takes (16 MiB).
SLICE_ELEMENTS = 8 * 1024 * 1024


class Avx512Gemm(QuantizedGemm):
    """The library's product, and its dequantization into bf16 for many rows."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "triollm_qgemm_avx512")
        self._dequantize = library.triollm_qdequantize_avx512
        self._dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [
            ctypes.c_int]
        self._dequantize.restype = None
        self._scratch = threading.local()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 out_features: int, group_size: int) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.numel() // in_features
        if rows < DEQUANTIZE_FROM_ROWS or in_features % 8:
            return super().__call__(x, weight, scales, out_features, group_size)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.entry} takes bf16 inputs, got {x.dtype}")
        x2 = x.reshape(rows, in_features)
        blocks = out_features // 16
        per_slice = max(1, SLICE_ELEMENTS // (16 * in_features))
        scratch = self._scratch_of(16 * min(per_slice, blocks) * in_features)
        threads = torch.get_num_threads()
        if per_slice >= blocks:
            dense = scratch[:out_features * in_features].view(out_features, in_features)
            self._dequantize(weight.data_ptr(), scales.data_ptr(), dense.data_ptr(), 0,
                             blocks, in_features, group_size, threads)
            return torch.nn.functional.linear(x2, dense).view(*x.shape[:-1], out_features)
        out = x2.new_empty((rows, out_features))
        for first in range(0, blocks, per_slice):
            count = min(per_slice, blocks - first)
            dense = scratch[:16 * count * in_features].view(16 * count, in_features)
            self._dequantize(weight.data_ptr(), scales.data_ptr(), dense.data_ptr(), first,
                             count, in_features, group_size, threads)
            out[:, 16 * first:16 * (first + count)] = torch.nn.functional.linear(x2, dense)
        return out.view(*x.shape[:-1], out_features)

    def _scratch_of(self, elements: int) -> torch.Tensor:
        """This thread's bf16 scratch of at least ``elements``, kept for its next call."""
        scratch: torch.Tensor | None = getattr(self._scratch, "tensor", None)
        if scratch is None or scratch.numel() < elements:
            scratch = torch.empty(elements, dtype=torch.bfloat16)
            self._scratch.tensor = scratch
        return scratch


class Avx512Int4Kernel(QuantizedKernel):
    """A weight of at most 4 bits in equal groups, on the AVX512-BF16 kernel."""

    name = "int4-avx512"

    def __init__(self, gemm: QuantizedGemm, weight: QuantizedWeight,
                 permutation: torch.Tensor | None, group_size: int) -> None:
        q = weight.qweight if permutation is None else weight.qweight[:, permutation]
        n, k = q.shape
        # [block, 16 outputs j, step, nibble s, t] -> [block, step, j, t, s]
        nibbles = q.to(torch.int32).reshape(n // 16, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3)
        words = (nibbles << torch.arange(0, 16, 4, dtype=torch.int32)).sum(-1)
        self.weight = torch.where(words >= 2**15, words - 2**16, words).to(
            torch.int16).reshape(n // 16, k // 8, 32).contiguous()
        self.scales = fp16_scales(weight).contiguous()
        self.gemm = gemm
        self.permutation = permutation
        self.group_size = group_size
        self.out_features = n
        self.nbytes = (self.weight.nbytes + self.scales.nbytes
                       + (0 if permutation is None else permutation.nbytes))

    @staticmethod
    def build(gemm: QuantizedGemm, weight: QuantizedWeight) -> Avx512Int4Kernel | None:
        """The kernel for ``weight``, or None where its shape, groups or scales do not
        fit."""
        if weight.bits > 4 or weight.out_features % 16 or not fits_fp16(weight):
            return None
        groups = _equal_groups(weight)
        if groups is None or groups[1] % 8:
            return None
        return Avx512Int4Kernel(gemm, weight, *groups)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.permutation is not None:
            x = x.index_select(-1, self.permutation)
        return self.gemm(x, self.weight, self.scales, self.out_features, self.group_size)


class Avx512Int8Kernel(QuantizedKernel):
    """A per-channel weight of at most 8 bits with integer zeros, on the AVX512-BF16
    kernel."""

    name = "int8-avx512"

    def __init__(self, gemm: QuantizedGemm, weight: QuantizedWeight) -> None:
        signed = (weight.qweight.to(torch.int32) - weight.zeros.to(torch.int32)).to(torch.int8)
        n, k = signed.shape
        self.weight = signed.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.scales = weight.scales[:, 0].float().contiguous()
        self.gemm = gemm
        self.out_features = n
        self.nbytes = self.weight.nbytes + self.scales.nbytes

    @staticmethod
    def build(gemm: QuantizedGemm, weight: QuantizedWeight) -> Avx512Int8Kernel | None:
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
        return Avx512Int8Kernel(gemm, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.scales, self.out_features, 0)


@cache
def load_avx512_gemm() -> QuantizedGemm | None:
    """The kernel for this machine, built on first use and checked against the
    dequantized product; None where the CPU lacks AVX512-BF16, there is no C compiler,
    or it disagrees."""
    return load_checked("qgemm_avx512", "AVX512-BF16 int4/int8 kernel", Avx512Gemm,
                        lambda gemm: agrees_with_dequantized(
                            gemm, Avx512Int4Kernel.build, Avx512Int8Kernel.build),
                        fallback="the AVX2 or torch's int4/int8 kernels")


def avx512_kernel_for(weight: QuantizedWeight, dtype: torch.dtype
                      ) -> QuantizedKernel | None:
    """The AVX512-BF16 kernel for ``weight`` computing in ``dtype`` (int4's where it
    fits, else int8's), or None: not bf16, not this CPU, or a weight neither takes."""
    if dtype != torch.bfloat16 or weight.qweight.device.type != "cpu":
        return None
    gemm = load_avx512_gemm()
    if gemm is None:
        return None
    return Avx512Int4Kernel.build(gemm, weight) or Avx512Int8Kernel.build(gemm, weight)
