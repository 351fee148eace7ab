"""Weight-only int4 and int8 products in bf16 on CPUs with AVX-512 (F and BW), where
torch's kernels (kernels.py) are bound by unpacking, far below memory speed
(docs/benchmarks.md).

The C library (``csrc/qgemm_avx512.c``) takes the AVX2 kernel's layouts
(avx2_kernels.py: ``Avx512Int4Kernel`` and ``Avx512Int8Kernel`` are its kernels on this
library) and multiplies in fp32 FMAs, 16 outputs an instruction: a nibble becomes its
float by a table lookup after a shift, an int8 by a widening and a conversion. A unit
of work is one block of 16 outputs for up to 16 rows, 4 at a time. On a CPU with AMX,
from 16 rows (``TILES_FROM_ROWS``) each thread dequantizes 32 outputs at a time into
bf16 in a panel that stays in its cache and multiplies every row by it on AMX tiles
(csrc/gemm_amx.h); a layer whose inputs are not a multiple of 32 wide is dequantized
instead from a few dozen rows (``DEQUANTIZE_INT4_FROM_ROWS``), a slice of outputs at a
time, for torch's ``linear`` (oneDNN, on AMX). Threads split the units: torch's OpenMP
threads, or the helper pool (helpers.py) where the thread policy computes on one
thread. Built where the CPU has
AVX-512 F and BW and checked against the dequantized fp32 product at load (build.py's
``load_checked``); elsewhere, where it disagrees, and for float32 or float16
activations, the AVX2 kernel or torch's kernels run.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

import torch

from triollm.model.cpu.build import cpu_flags, load_checked
from triollm.model.cpu.helpers import spare_threads
from triollm.model.quantization.avx2_kernels import (
    Avx2Int4Kernel,
    Avx2Int8Kernel,
    QuantizedGemm,
    agrees_with_dequantized,
    native_kernel_for,
)
from triollm.model.quantization.kernels import QuantizedKernel
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["DEQUANTIZE_INT4_FROM_ROWS", "DEQUANTIZE_INT8_FROM_ROWS", "TILES_FROM_ROWS",
           "Avx512Gemm",
           "Avx512Int4Kernel", "Avx512Int8Kernel", "avx512_kernel_for", "load_avx512_gemm"]

#: On a CPU with AMX, from this many rows a layer's weight is dequantized into bf16, a
#: slice of outputs at a time, and multiplied by torch's bf16 ``linear`` (oneDNN, on
#: AMX), which then outruns unpacking the weight once per 4 rows (measured on a
#: Sapphire Rapids-class Xeon, Qwen2.5-0.5B's layer shapes: int4 even at 24-28 rows,
#: 1.16x ahead at 32; int8 even at 16, 1.28x ahead at 24). Without AMX the kernel
#: computes every row count (oneDNN's bf16 there was not measured against it).
DEQUANTIZE_INT4_FROM_ROWS = 32
DEQUANTIZE_INT8_FROM_ROWS = 20
#: On a CPU with AMX, from this many rows a layer whose inputs are a multiple of 32 wide
#: is multiplied on AMX tiles instead, a panel of 32 outputs dequantized at a time into
#: the thread's cache (``triollm_qgemm_amx``): measured over a decode token's layers of
#: Qwen2.5-0.5B's shape (int4 and int8 alike) it trails the kernel at 12 rows and leads
#: it by 1.3x at 16, 1.6x at 32 and 2.1x at 64 (docs/benchmarks.md).
TILES_FROM_ROWS = 16
#: The most bf16 elements one slice of a dequantized weight takes (16 MiB).
SLICE_ELEMENTS = 8 * 1024 * 1024


class Avx512Gemm(QuantizedGemm):
    """The library's product, and its dequantization into bf16 for many rows."""

    def __init__(self, library: ctypes.CDLL, entry: str = "triollm_qgemm_avx512",
                 product_library: ctypes.CDLL | None = None) -> None:
        """``library``: qgemm_avx512's, whose dequantization this takes; the product is
        ``entry`` of ``product_library`` (default: the same library)."""
        super().__init__(product_library or library, entry)
        self.library = library
        self._dequantize = library.triollm_qdequantize_avx512
        self._dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [
            ctypes.c_int]
        self._dequantize.restype = None
        self._scratch = threading.local()
        #: Rows from which a layer is dequantized for torch's ``linear``, by layout
        #: (None: never).
        amx = "amx_bf16" in cpu_flags()
        self.dequantize_int4_from: int | None = DEQUANTIZE_INT4_FROM_ROWS if amx else None
        self.dequantize_int8_from: int | None = DEQUANTIZE_INT8_FROM_ROWS if amx else None
        #: The C product on AMX tiles (``triollm_qgemm_amx``).
        self.tiles = library.triollm_qgemm_amx
        self.tiles.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self.tiles.restype = None
        #: Rows from which a product whose inputs are a multiple of 32 wide runs on AMX
        #: tiles, a dequantized panel of 32 outputs at a time (None: never; the layer
        #: then takes the thresholds above).
        self.tiles_from: int | None = (
            TILES_FROM_ROWS if amx and library.triollm_qgemm_amx_supported() else None)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 out_features: int, group_size: int) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.numel() // in_features
        tiles = self.tiles_from is not None and in_features % 32 == 0
        threshold = (self.tiles_from if tiles else
                     self.dequantize_int4_from if group_size else self.dequantize_int8_from)
        # with pool helpers (a busy neighbour) these would compute on one thread
        if threshold is None or rows < threshold or in_features % 8 or spare_threads():
            return super().__call__(x, weight, scales, out_features, group_size)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.entry} takes bf16 inputs, got {x.dtype}")
        x2 = x.reshape(rows, in_features)
        if tiles:
            out = x2.new_empty((rows, out_features))
            x2 = x2.contiguous()
            threads = torch.get_num_threads()
            panels = self._scratch_of(threads * 32 * in_features)
            self.tiles(x2.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(),
                        panels.data_ptr(), rows, out_features, in_features, group_size,
                        threads)
            return out.view(*x.shape[:-1], out_features)
        blocks = out_features // 16
        per_slice = max(1, SLICE_ELEMENTS // (16 * in_features))
        scratch = self._scratch_of(16 * min(per_slice, blocks) * in_features)
        threads = torch.get_num_threads()

        def product(first: int, count: int) -> torch.Tensor:
            dense = scratch[:16 * count * in_features].view(16 * count, in_features)
            self._dequantize(weight.data_ptr(), scales.data_ptr(), dense.data_ptr(), first,
                             count, in_features, group_size, threads)
            return torch.nn.functional.linear(x2, dense)

        if per_slice >= blocks:
            return product(0, blocks).view(*x.shape[:-1], out_features)
        out = x2.new_empty((rows, out_features))
        for first in range(0, blocks, per_slice):
            count = min(per_slice, blocks - first)
            out[:, 16 * first:16 * (first + count)] = product(first, count)
        return out.view(*x.shape[:-1], out_features)

    def _scratch_of(self, elements: int) -> torch.Tensor:
        """This thread's bf16 scratch of at least ``elements`` (at most
        ``SLICE_ELEMENTS``, one block of 16 outputs, or a panel of 32 per OpenMP thread),
        kept for its next call: a model thread's prefill reuses it rather than fault in
        fresh pages per layer."""
        scratch: torch.Tensor | None = getattr(self._scratch, "tensor", None)
        if scratch is None or scratch.numel() < elements:
            scratch = torch.empty(elements, dtype=torch.bfloat16)
            self._scratch.tensor = scratch
        return scratch


class Avx512Int4Kernel(Avx2Int4Kernel):
    """A weight of at most 4 bits in equal groups, on the AVX-512 kernel (the AVX2
    kernel's layout)."""

    name = "int4-avx512"


class Avx512Int8Kernel(Avx2Int8Kernel):
    """A per-channel weight of at most 8 bits with integer zeros, on the AVX-512 kernel
    (the AVX2 kernel's layout)."""

    name = "int8-avx512"


@cache
def load_avx512_gemm() -> QuantizedGemm | None:
    """The kernel for this machine, built on first use and checked against the
    dequantized product; None where the CPU lacks AVX-512 F or BW, there is no C
    compiler, or it disagrees."""
    return load_checked("qgemm_avx512", "AVX-512 int4/int8 kernel", Avx512Gemm,
                        lambda gemm: agrees_with_dequantized(
                            gemm, Avx512Int4Kernel.build, Avx512Int8Kernel.build),
                        fallback="the AVX2 or torch's int4/int8 kernels")


def avx512_kernel_for(weight: QuantizedWeight, dtype: torch.dtype
                      ) -> QuantizedKernel | None:
    """avx2_kernels.py's ``native_kernel_for`` on the AVX-512 kernel."""
    return native_kernel_for(weight, dtype, load_avx512_gemm, Avx512Int4Kernel,
                             Avx512Int8Kernel)
