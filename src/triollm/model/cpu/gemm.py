"""bf16 linear layers on CPUs with AVX512-BF16, as a small C kernel over weights packed
once into the layout its dot-product instruction reads.

A decode step multiplies a few rows by every weight of the model, so its time is the
time to stream the weights from memory. oneDNN's packed bf16 product (packed_linear.py)
reads them at 10-18 GB/s on this project's 2-core machine, where a plain sum reads at 19
GB/s on one core and 28 GB/s on two. This kernel holds each weight as
``[out/16][in/2][16][2]``: one 64-byte load gives two input columns of 16 outputs, which
``vdpbf16ps`` multiplies by one broadcast pair of a row's inputs into 16 fp32 sums. A
tile is 8 rows by 32 outputs (16 accumulators in registers); threads split the output
columns (and, with many rows, the row tiles): torch's OpenMP threads, or, while the
thread policy computes on one thread beside busy cores, cpu_helpers.py's pool. Measured
against oneDNN on the 85m model's 84 layers (``benchmarks/packed_linear.py``): 1.35-1.6x
for 1-16 rows and about 1.1x for 64-256 rows, on one thread and on two.

The library is built for the CPU it runs on (native_build.py) and only where the
compiler targets AVX512-BF16; elsewhere ``load_gemm`` returns None and bf16 layers stay
on oneDNN. Sums are fp32, the output is rounded to bf16 once, as oneDNN does.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from triollm.model.cpu.build import load_checked
from triollm.model.cpu.helpers import POOL_SOURCE, PooledFunction

__all__ = ["CpuGemm", "load_gemm"]

_SOURCE = POOL_SOURCE + r"""
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ROWS 8

int triollm_gemm_supported(void) { return 1; }

static inline __m512bh pair_of(const uint16_t* row, int64_t k) {
    return (__m512bh)_mm512_set1_epi32(*(const int32_t*)(row + 2 * k));
}

static inline void store_row(uint16_t* y, __m512 sums, const float* bias) {
    if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(sums));
}

/* Rows [m0, m0 + rows) times the 16-wide output blocks at w0 and w1 (w1 NULL: one
   block). Always inlined, so the calls with rows == ROWS get loops of constant trip
   count and the sums stay in registers. A pool helper (job != NULL) stores only once
   pool_commit says the unit is still its own. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t* x, const uint16_t* w0, const uint16_t* w1, uint16_t* y,
    const float* bias, int64_t m0, int rows, int64_t n, int64_t k, int64_t column,
    pool_job* job, int64_t unit)
{
    __m512 s0[ROWS], s1[ROWS];
    const uint16_t* xr[ROWS];
    for (int r = 0; r < ROWS; r++) {
        s0[r] = _mm512_setzero_ps();
        s1[r] = _mm512_setzero_ps();
        xr[r] = x + (m0 + (r < rows ? r : 0)) * k;
    }
    const int64_t pairs = k / 2;
    if (w1) {
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + 32 * p);
            const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w1 + 32 * p);
            _mm_prefetch((const char*)(w0 + 32 * p) + 2048, _MM_HINT_T0);
            _mm_prefetch((const char*)(w1 + 32 * p) + 2048, _MM_HINT_T0);
            for (int r = 0; r < ROWS; r++) {
                if (r < rows) {
                    const __m512bh xv = pair_of(xr[r], p);
                    s0[r] = _mm512_dpbf16_ps(s0[r], xv, v0);
                    s1[r] = _mm512_dpbf16_ps(s1[r], xv, v1);
                }
            }
        }
    } else {
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + 32 * p);
            for (int r = 0; r < ROWS; r++)
                if (r < rows) s0[r] = _mm512_dpbf16_ps(s0[r], pair_of(xr[r], p), v0);
        }
    }
    if (job && !pool_commit(job, unit)) return;
    for (int r = 0; r < rows; r++) {
        store_row(y + (m0 + r) * n + column, s0[r], bias ? bias + column : 0);
        if (w1) store_row(y + (m0 + r) * n + column + 16, s1[r], bias ? bias + column + 16 : 0);
    }
}

/* One unit of work: the tile of row chunk c and output block pair u. */
static inline void gemm_unit(const uint16_t* x, const uint16_t* packed, const float* bias,
                             uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t u,
                             int64_t c, pool_job* job, int64_t unit)
{
    const int64_t blocks = n / 16, b = 2 * u, m0 = c * ROWS;
    const int rows = m - m0 < ROWS ? (int)(m - m0) : ROWS;
    const uint16_t* w0 = packed + b * 16 * k;
    const uint16_t* w1 = b + 1 < blocks ? w0 + 16 * k : 0;
    if (w1 && rows == ROWS)
        tile(x, w0, w1, y, bias, m0, ROWS, n, k, 16 * b, job, unit);
    else
        tile(x, w0, w1, y, bias, m0, rows, n, k, 16 * b, job, unit);
}

/* y[m, n] = x[m, k] @ W^T (+ bias), bf16 in and out; W packed [n/16][k/2][16][2]. */
void triollm_gemm_bf16(const uint16_t* x, const uint16_t* packed, const float* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads)
{
    const int64_t units = (n / 16 + 1) / 2, chunks = (m + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t u = 0; u < units; u++)
        for (int64_t c = 0; c < chunks; c++)
            gemm_unit(x, packed, bias, y, m, n, k, u, c, NULL, 0);
}

typedef struct {
    pool_job base;
    const uint16_t* x;  /* the job's own copy: a helper may read it after the call */
    const uint16_t* packed;
    const float* bias;
    uint16_t* y;
    int64_t m, n, k, chunks;
} gemm_job;

static void gemm_job_unit(pool_job* base, int64_t unit, int helper) {
    const gemm_job* job = (const gemm_job*)base;
    gemm_unit(job->x, job->packed, job->bias, job->y, job->m, job->n, job->k,
              unit / job->chunks, unit % job->chunks, helper ? base : NULL, unit);
}

/* triollm_gemm_bf16 on the calling thread and up to `helpers` pool helpers
   (cpu_helpers.py); `packed` and `bias` must outlive the pool's next drain. */
void triollm_gemm_bf16_pooled(const uint16_t* x, const uint16_t* packed, const float* bias,
                              uint16_t* y, int64_t m, int64_t n, int64_t k, int helpers)
{
    const int64_t chunks = (m + ROWS - 1) / ROWS, units = (n / 16 + 1) / 2 * chunks;
    const size_t head = (sizeof(gemm_job) + (size_t)units + 63) & ~(size_t)63;
    gemm_job* job = (gemm_job*)malloc(head + (size_t)(m * k) * sizeof(uint16_t));
    if (job == NULL) {
        triollm_gemm_bf16(x, packed, bias, y, m, n, k, 1);
        return;
    }
    job->base.run = gemm_job_unit;
    job->base.units = units;
    job->base.state = (_Atomic unsigned char*)(job + 1);
    uint16_t* copy = (uint16_t*)((char*)job + head);
    memcpy(copy, x, (size_t)(m * k) * sizeof(uint16_t));
    job->x = copy;
    job->packed = packed;
    job->bias = bias;
    job->y = y;
    job->m = m;
    job->n = n;
    job->k = k;
    job->chunks = chunks;
    pool_run(&job->base, helpers);
}
#else
int triollm_gemm_supported(void) { return 0; }
void triollm_gemm_bf16(const uint16_t* x, const uint16_t* packed, const float* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {}
void triollm_gemm_bf16_pooled(const uint16_t* x, const uint16_t* packed, const float* bias,
                              uint16_t* y, int64_t m, int64_t n, int64_t k, int helpers) {}
#endif
"""


class CpuGemm:
    """bf16 ``x @ weight.T + bias`` over a weight packed by ``pack``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = PooledFunction(
            library, "triollm_gemm_bf16",
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int], None)

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


def _agrees_with_torch(gemm: CpuGemm) -> bool:
    """The kernel against fp32 ``F.linear`` on random shapes: one and two output blocks
    per tile, full and partial row tiles, with and without a bias."""
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features, with_bias in (
            (1, 48, 30, True), (8, 64, 64, False), (13, 16, 128, True), (40, 96, 34, False)):
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
    return load_checked("gemm_bf16", _SOURCE, "bf16 GEMM kernel", CpuGemm, _agrees_with_torch,
                        supported="triollm_gemm_supported")  # else oneDNN it is
