/* bf16 GEMM for CPUs with AVX2 and FMA but no AVX512-BF16 (model/cpu/gemm_avx2.py), over
   gemm.c's packed layout [out/16][in/2][16][2], on OpenMP or the helper pool; an empty
   library off AVX2+FMA.

   A 32-bit lane of the layout holds one output's weights for two adjacent inputs, so
   a 256-bit load gives 8 outputs' pair: shifted left 16 bits it is the even input's
   fp32 weights, masked to its high half the odd input's. The rows are converted to
   fp32 once per call; each weight vector is multiplied by a broadcast input of every
   row of the tile. Sums are fp32, rounded to bf16 once (to nearest even). */
#include "pool.h"

#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROWS 6

int triollm_gemm_avx2_supported(void) { return 1; }

/* 8 fp32 sums -> 8 bf16 in the low 16 bits of each lane, rounded to nearest even. */
static inline __m256i to_bf16_lanes(__m256 sums) {
    const __m256i bits = _mm256_castps_si256(sums);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(sums, sums, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

static inline void store_row(uint16_t* y, __m256 lo, __m256 hi, const float* bias) {
    if (bias) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    /* packus interleaves 128-bit halves: [lo0-3 hi0-3 lo4-7 hi4-7] -> in order */
    const __m256i packed = _mm256_packus_epi32(to_bf16_lanes(lo), to_bf16_lanes(hi));
    _mm256_storeu_si256((__m256i*)y, _mm256_permute4x64_epi64(packed, 0xD8));
}

/* Rows [m0, m0 + rows) of the fp32 inputs `xf` times the 16-wide output block at `w`.
   Always inlined and called with a constant `rows`, so the sums stay in registers. Up
   to 3 rows, the even and odd inputs' products go to separate sums (4 per row), so a
   row's dependency chains are short enough to stream weights at memory speed. */
static inline __attribute__((always_inline)) void tile(
    const float* xf, const uint16_t* w, uint16_t* y, const float* bias, int64_t m0,
    const int rows, int64_t n, int64_t k, int64_t column, pool_job* job, int64_t unit)
{
    const int split = rows <= 3;
    __m256 lo[ROWS], hi[ROWS], lo_odd[ROWS], hi_odd[ROWS];
    const float* xr[ROWS];
    for (int r = 0; r < rows; r++) {
        lo[r] = hi[r] = lo_odd[r] = hi_odd[r] = _mm256_setzero_ps();
        xr[r] = xf + (m0 + r) * k;
    }
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const __m256i a = _mm256_loadu_si256((const __m256i*)(w + 32 * p));
        const __m256i b = _mm256_loadu_si256((const __m256i*)(w + 32 * p + 16));
        _mm_prefetch((const char*)(w + 32 * p) + 2048, _MM_HINT_T0);
        const __m256 a_even = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
        const __m256 b_even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        for (int r = 0; r < rows; r++) {
            const __m256 x = _mm256_broadcast_ss(xr[r] + 2 * p);
            lo[r] = _mm256_fmadd_ps(a_even, x, lo[r]);
            hi[r] = _mm256_fmadd_ps(b_even, x, hi[r]);
        }
        const __m256 a_odd = _mm256_castsi256_ps(_mm256_and_si256(a, high));
        const __m256 b_odd = _mm256_castsi256_ps(_mm256_and_si256(b, high));
        for (int r = 0; r < rows; r++) {
            const __m256 x = _mm256_broadcast_ss(xr[r] + 2 * p + 1);
            if (split) {
                lo_odd[r] = _mm256_fmadd_ps(a_odd, x, lo_odd[r]);
                hi_odd[r] = _mm256_fmadd_ps(b_odd, x, hi_odd[r]);
            } else {
                lo[r] = _mm256_fmadd_ps(a_odd, x, lo[r]);
                hi[r] = _mm256_fmadd_ps(b_odd, x, hi[r]);
            }
        }
    }
    if (job && !pool_commit(job, unit)) return;
    for (int r = 0; r < rows; r++) {
        if (split) {
            lo[r] = _mm256_add_ps(lo[r], lo_odd[r]);
            hi[r] = _mm256_add_ps(hi[r], hi_odd[r]);
        }
        store_row(y + (m0 + r) * n + column, lo[r], hi[r], bias ? bias + column : 0);
    }
}

/* One unit of work: the tile of row chunk c and output block u. */
static inline void gemm_unit(const float* xf, const uint16_t* packed, const float* bias,
                             uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t u,
                             int64_t c, pool_job* job, int64_t unit)
{
    const int64_t m0 = c * ROWS;
    const int rows = m - m0 < ROWS ? (int)(m - m0) : ROWS;
    const uint16_t* w = packed + u * 16 * k;
    switch (rows) {
    case 1: tile(xf, w, y, bias, m0, 1, n, k, 16 * u, job, unit); break;
    case 2: tile(xf, w, y, bias, m0, 2, n, k, 16 * u, job, unit); break;
    case 3: tile(xf, w, y, bias, m0, 3, n, k, 16 * u, job, unit); break;
    case 4: tile(xf, w, y, bias, m0, 4, n, k, 16 * u, job, unit); break;
    case 5: tile(xf, w, y, bias, m0, 5, n, k, 16 * u, job, unit); break;
    default: tile(xf, w, y, bias, m0, ROWS, n, k, 16 * u, job, unit); break;
    }
}

/* x (bf16) -> fp32, 8 at a time. */
static void widen(const uint16_t* x, float* xf, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i)));
        _mm256_storeu_ps(xf + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; i < count; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, sizeof bits);
    }
}

static void gemm_plain(const float* xf, const uint16_t* packed, const float* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads)
{
    const int64_t blocks = n / 16, chunks = (m + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t u = 0; u < blocks; u++)
        for (int64_t c = 0; c < chunks; c++)
            gemm_unit(xf, packed, bias, y, m, n, k, u, c, NULL, 0);
}

#define STACK_FLOATS 16384

/* y[m, n] = x[m, k] @ W^T (+ bias), bf16 in and out; W packed [n/16][k/2][16][2]. */
void triollm_gemm_avx2_bf16(const uint16_t* x, const uint16_t* packed, const float* bias,
                            uint16_t* y, int64_t m, int64_t n, int64_t k, int threads)
{
    float stack[STACK_FLOATS];
    float* xf = m * k <= STACK_FLOATS ? stack
                                      : (float*)malloc((size_t)(m * k) * sizeof(float));
    if (xf != NULL) {
        widen(x, xf, m * k);
        gemm_plain(xf, packed, bias, y, m, n, k, threads);
        if (xf != stack) free(xf);
        return;
    }
    /* out of memory: as many rows at a time as the stack buffer holds */
    const int64_t group = STACK_FLOATS / k;
    if (group == 0) abort();
    for (int64_t r = 0; r < m; r += group) {
        const int64_t rows = m - r < group ? m - r : group;
        widen(x + r * k, stack, rows * k);
        gemm_plain(stack, packed, bias, y + r * n, rows, n, k, threads);
    }
}

typedef struct {
    pool_job base;
    const float* xf;  /* the job's own fp32 copy: a helper may read it after the call */
    const uint16_t* packed;
    const float* bias;
    uint16_t* y;
    int64_t m, n, k, chunks;
} gemm_job;

static void gemm_job_unit(pool_job* base, int64_t unit, int helper) {
    const gemm_job* job = (const gemm_job*)base;
    gemm_unit(job->xf, job->packed, job->bias, job->y, job->m, job->n, job->k,
              unit / job->chunks, unit % job->chunks, helper ? base : NULL, unit);
}

/* triollm_gemm_avx2_bf16 on the calling thread and up to `helpers` pool helpers
   (model/cpu/helpers.py); `packed` and `bias` must outlive the pool's next drain. */
void triollm_gemm_avx2_bf16_pooled(const uint16_t* x, const uint16_t* packed,
                                   const float* bias, uint16_t* y, int64_t m, int64_t n,
                                   int64_t k, int helpers)
{
    const int64_t chunks = (m + ROWS - 1) / ROWS, units = n / 16 * chunks;
    const size_t head = (sizeof(gemm_job) + (size_t)units + 63) & ~(size_t)63;
    gemm_job* job = (gemm_job*)malloc(head + (size_t)(m * k) * sizeof(float));
    if (job == NULL) {
        triollm_gemm_avx2_bf16(x, packed, bias, y, m, n, k, 1);
        return;
    }
    job->base.run = gemm_job_unit;
    job->base.units = units;
    job->base.state = (_Atomic unsigned char*)(job + 1);
    float* copy = (float*)((char*)job + head);
    widen(x, copy, m * k);
    job->xf = copy;
    job->packed = packed;
    job->bias = bias;
    job->y = y;
    job->m = m;
    job->n = n;
    job->k = k;
    job->chunks = chunks;
    triollm_pool_run(&job->base, helpers);
}

#else
/* Stubs with the same signatures, never called (triollm_gemm_avx2_supported says so). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
int triollm_gemm_avx2_supported(void) { return 0; }
void triollm_gemm_avx2_bf16(const uint16_t* x, const uint16_t* packed, const float* bias,
                            uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {}
void triollm_gemm_avx2_bf16_pooled(const uint16_t* x, const uint16_t* packed,
                                   const float* bias, uint16_t* y, int64_t m, int64_t n,
                                   int64_t k, int helpers) {}
#pragma GCC diagnostic pop
#endif
