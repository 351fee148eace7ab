"""Decode attention on CPU as a small C kernel, built on first use with the machine's C
compiler and called through ctypes.

Each single-token query attends over exactly its own sequence's blocks, read in place
from the paged cache: no padding to the longest sequence of the batch, no gathered copy,
and a ctypes call's overhead instead of the guards and wrappers a ``torch.compile``'d
function spends per layer. Work is split over (sequence, KV head)
pairs on torch's OpenMP runtime with torch's thread count, so the compute-thread policy
(``threads.py``) governs it too; while that policy computes on one thread beside
busy cores, the AVX-512 path's pairs go to helpers.py's pool instead. Scores and
sums are fp32; the cache may be fp32, bf16, or 8-bit e5m2 or e4m3 (``--kv-cache-dtype``,
csrc/fp8.h: widened as loaded on the AVX-512 path; on the portable one each block is
widened to fp32 once for all the query heads of its group, not once per head).

Two paths share the source. Where the compiler targets AVX-512 and the head size is a
multiple of 16 (up to 256), one pass over the blocks keeps a query head's output row in
vector registers and folds each run of up to 16 scores into an online softmax with a
vector exp: no scratch memory, K and V each read once. Elsewhere a portable loop (auto-
vectorised by the compiler) writes all scores, takes the softmax, then sums V. Tests build
the portable one here too (``_build(portable=True)``), so CPUs without AVX-512 run code
that was checked.

A step of decodes only takes one call a layer (``decode_step``): the step's keys and values
are written into the cache (rounded to its element type as torch casts), the queries
read and the output written in the model's dtype with the strides the model's
projections give them, all in C. Around the kernel the layer's torch path makes about
ten calls (the cache writes, conversions, slicing, a copy out). Measured figures:
docs/benchmarks.md.

The kernel (``csrc/decode.c``) is compiled for the CPU it runs on (build.py). Without a
working compiler ``load_kernel`` returns None and the runner falls back to the compiled
or gathering path.
"""

from __future__ import annotations

import ctypes
from functools import cache, cached_property
from pathlib import Path

import torch

from triollm.model.cpu.build import FLAGS, build, load_checked
from triollm.model.cpu.helpers import PooledFunction
from triollm.model.cpu.kernel_ops import NativeDecodeStep

__all__ = ["CACHE_KINDS", "CpuDecodeKernel", "load_kernel"]

#: The cache element types the kernel reads, by the code csrc/decode.c knows them by.
CACHE_KINDS: dict[torch.dtype, int] = {
    torch.float32: 0, torch.bfloat16: 1, torch.float8_e5m2: 2, torch.float8_e4m3fn: 3}


def _build(portable: bool = False) -> Path:
    """The compiled kernel's path; ``portable`` leaves out the AVX-512 path, so a test
    can run here what a CPU without AVX-512 runs."""
    return build("decode", [*FLAGS, "-DTRIOLLM_PORTABLE"] if portable else FLAGS)


class CpuDecodeKernel:
    """``paged_decode_attention``'s signature, run by the C kernel."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._function = PooledFunction(
            library, "triollm_paged_decode",
            [pointer] * 6 + [i64] * 7 + [f32, i64, f32, ctypes.c_int, ctypes.c_int],
            ctypes.c_int)
        self._step = PooledFunction(
            library, "triollm_decode_step",
            ([pointer, i64, i64] * 4 + [pointer] * 5 + [i64] * 7
             + [f32, i64, f32, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
            ctypes.c_int)
        self._vectorized = library.triollm_paged_decode_vectorized
        self._vectorized.argtypes = [ctypes.c_int64]
        self._vectorized.restype = ctypes.c_int

    def decode_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                    softcap: float | None) -> torch.Tensor | None:
        """A layer's attention for a step of decodes only, in one call: ``key`` and
        ``value`` (``[Hkv, T, D]``) written into the caches at ``slot_mapping``, then the
        queries (``[Hq, T, D]``) over their sequences; returns ``[Hq, T, D]`` laid out
        as ``query`` is. The queries, keys and values must be fp32 or bf16, in the caches'
        dtype or over an 8-bit cache, with contiguous heads, and the tables and lengths
        int64 and contiguous; where they are not, returns None and writes nothing."""
        dtype, cache_dtype = query.dtype, key_cache.dtype
        if not (key.dtype == value.dtype == dtype and dtype in (torch.float32, torch.bfloat16)
                and value_cache.dtype == cache_dtype and cache_dtype in CACHE_KINDS
                and (cache_dtype == dtype or key_cache.element_size() == 1)
                and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and block_tables.dtype == context_lens.dtype == slot_mapping.dtype
                == torch.int64 and block_tables.is_contiguous()
                and context_lens.is_contiguous() and slot_mapping.is_contiguous()):
            return None
        out = torch.empty_like(query)  # query's strides, or contiguous: dim is contiguous
        q_heads, batch, dim = query.shape
        kv_heads, num_blocks, block_size, _ = key_cache.shape
        failed = self._step(
            query.data_ptr(), query.stride(0), query.stride(1),
            key.data_ptr(), key.stride(0), key.stride(1),
            value.data_ptr(), value.stride(0), value.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), context_lens.data_ptr(), batch, q_heads, kv_heads,
            num_blocks, block_size, dim, block_tables.shape[1], scale, sliding_window or 0,
            softcap or 0.0, int(dtype == torch.bfloat16), CACHE_KINDS[cache_dtype])
        if failed:
            raise MemoryError("the CPU decode kernel could not allocate its scratch space")
        return out

    @cached_property
    def native_step(self) -> NativeDecodeStep:
        """``decode_step``'s C functions, for the C++ op (kernel_ops.begin_decode_step)."""
        return NativeDecodeStep(*self._step.entry_points())

    def vectorized(self, head_size: int) -> bool:
        """Whether heads of ``head_size`` take the AVX-512 path (else the portable one)."""
        return bool(self._vectorized(head_size))

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor:
        """Single-token queries ``[B, Hq, D]`` over their sequences' blocks."""
        if key_cache.dtype not in CACHE_KINDS or value_cache.dtype != key_cache.dtype:
            raise TypeError(f"the CPU decode kernel takes fp32, bf16, float8_e5m2 or "
                            f"float8_e4m3fn caches, got {key_cache.dtype}")
        query = query.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the CPU decode kernel reads contiguous caches")
        batch, q_heads, dim = query.shape
        kv_heads, num_blocks, block_size, _ = key_cache.shape
        out = torch.empty_like(query)
        if batch == 0:
            return out
        failed = self._function(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, q_heads, kv_heads,
            num_blocks, block_size, dim, tables.shape[1], scale,
            sliding_window or 0, softcap or 0.0, CACHE_KINDS[key_cache.dtype])
        if failed:
            raise MemoryError("the CPU decode kernel could not allocate its scratch space")
        return out


def _agrees_with_torch(kernel: CpuDecodeKernel) -> bool:
    """The kernel's answer on small random inputs (GQA, a sliding window, softcap, fp32,
    bf16 and 8-bit caches, head sizes that take each path) against
    ``paged_decode_attention`` run eagerly."""
    from triollm.model.attention.torch_decode import paged_decode_attention

    generator = torch.Generator().manual_seed(0)
    cases = ((torch.float32, None, None), (torch.bfloat16, 9, 30.0),
             (torch.float8_e5m2, None, None), (torch.float8_e4m3fn, 9, None))
    for dim in (8, 16, 64, 128):
        for dtype, window, softcap in cases:
            query = torch.randn(3, 4, dim, generator=generator)
            keys = torch.randn(2, 8, 4, dim, generator=generator).to(dtype)
            values = torch.randn(2, 8, 4, dim, generator=generator).to(dtype)
            tables = torch.tensor([[5, 2, 7, 0], [1, 3, 0, 0], [6, 4, 0, 0]])
            lens = torch.tensor([15, 7, 1])
            expected = paged_decode_attention(query, keys.float(), values.float(), tables,
                                              lens, 0.25, window, softcap)
            got = kernel(query, keys, values, tables, lens, 0.25, window, softcap)
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                return False
    return True


@cache
def load_kernel() -> CpuDecodeKernel | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where it cannot be built (no C compiler, say) or disagrees, with the reason logged."""
    return load_checked("decode", "CPU decode attention kernel", CpuDecodeKernel,
                        _agrees_with_torch,
                        fallback="torch's decode attention (compiled, else gathering)")
