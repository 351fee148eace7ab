/* bf16 GEMM over weights packed [out/16][in/2][16][2] for vdpbf16ps (model/cpu/gemm.py),
   or from AMX_FROM_ROWS rows on AMX tiles where the CPU has them (gemm_amx.h), on
   OpenMP or the helper pool; an empty library off AVX512-BF16. */
#define _DEFAULT_SOURCE  /* syscall(), for the AMX permission */
#include "pool.h"

#include <stdlib.h>
#include <string.h>
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "gemm_amx.h"
#include "gemm_rows_amx.h"

/* y[m, n] = x[m, k] @ w^T (+ bias) over a row-major bf16 w [n][k] on AMX tiles
   (gemm_rows_amx.h): 0 done, 1 not taken (k not a multiple of 32, n of 16, or no
   tiles; nothing written), 2 out of memory. */
int triollm_gemm_rows_bf16(const uint16_t* x, const uint16_t* w, const float* bias,
                           uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
    return rows_gemm(x, w, bias, y, m, n, k, threads);
}
/* The tiles outrun vdpbf16ps from one row on, streaming the weights from memory and
   from cache alike (docs/benchmarks.md). */
#define AMX_FROM_ROWS 1

static int amx_from_rows = AMX_FROM_ROWS;

/* Tests and benchmarks: the tiles take calls from `rows` rows on (0: none); returns
   the row count they took calls from before. */
int triollm_gemm_amx_from_rows(int rows) {
    const int previous = amx_from_rows;
    amx_from_rows = rows;
    return previous;
}

int triollm_gemm_amx_supported(void) { return amx_usable(); }

static inline int amx_takes(int64_t m, int64_t k) {
    return amx_from_rows > 0 && m >= amx_from_rows && k % 32 == 0 && amx_usable();
}

/* The tile unit of row chunk c and output block pair u. */
static inline void tile_unit(const uint16_t* x, const uint16_t* packed, const float* bias,
                             uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t u,
                             int64_t c, pool_job* job, int64_t unit) {
    const int64_t b = 2 * u, m0 = c * AMX_ROWS;
    const uint16_t* w0 = packed + b * 16 * k;
    amx_unit(x, w0, b + 1 < n / 16 ? w0 + 16 * k : 0, bias, y, m0,
             m - m0 < AMX_ROWS ? (int)(m - m0) : AMX_ROWS, n, k, 16 * b, job, unit);
}
#else
#define AMX_ROWS ROWS
int triollm_gemm_rows_bf16(const uint16_t* x, const uint16_t* w, const float* bias,
                           uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return 1;
}
int triollm_gemm_amx_from_rows(int rows) { (void)rows; return 0; }
int triollm_gemm_amx_supported(void) { return 0; }
static inline int amx_takes(int64_t m, int64_t k) { (void)m; (void)k; return 0; }
static inline void release_tiles(void) {}
static inline void tile_unit(const uint16_t* x, const uint16_t* packed, const float* bias,
                             uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t u,
                             int64_t c, pool_job* job, int64_t unit) {
    (void)x; (void)packed; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)u;
    (void)c; (void)job; (void)unit;
}
#endif

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
    const int amx = amx_takes(m, k);
    const int64_t units = (n / 16 + 1) / 2, rows = amx ? AMX_ROWS : ROWS;
    const int64_t chunks = (m + rows - 1) / rows;
    #pragma omp parallel num_threads(threads)
    {
        /* a thread's units share their weights: it goes down the rows of each pair */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t u = 0; u < units; u++)
            for (int64_t c = 0; c < chunks; c++) {
                if (amx) tile_unit(x, packed, bias, y, m, n, k, u, c, NULL, 0);
                else gemm_unit(x, packed, bias, y, m, n, k, u, c, NULL, 0);
            }
        if (amx) release_tiles();
    }
}

typedef struct {
    pool_job base;
    const uint16_t* x;  /* the job's own copy: a helper may read it after the call */
    const uint16_t* packed;
    const float* bias;
    uint16_t* y;
    int64_t m, n, k, chunks;
    int amx;
} gemm_job;

static void gemm_job_unit(pool_job* base, int64_t unit, int helper) {
    const gemm_job* job = (const gemm_job*)base;
    if (job->amx) {
        tile_unit(job->x, job->packed, job->bias, job->y, job->m, job->n, job->k,
                 unit / job->chunks, unit % job->chunks, helper ? base : NULL, unit);
        release_tiles();
        return;
    }
    gemm_unit(job->x, job->packed, job->bias, job->y, job->m, job->n, job->k,
              unit / job->chunks, unit % job->chunks, helper ? base : NULL, unit);
}

/* triollm_gemm_bf16 on the calling thread and up to `helpers` pool helpers
   (model/cpu/helpers.py); `packed` and `bias` must outlive the pool's next drain. */
void triollm_gemm_bf16_pooled(const uint16_t* x, const uint16_t* packed, const float* bias,
                              uint16_t* y, int64_t m, int64_t n, int64_t k, int helpers)
{
    const int amx = amx_takes(m, k);
    const int64_t rows = amx ? AMX_ROWS : ROWS;
    const int64_t chunks = (m + rows - 1) / rows, units = (n / 16 + 1) / 2 * chunks;
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
    job->amx = amx;
    triollm_pool_run(&job->base, helpers);
}
#else
/* Stubs with the same signatures, never called (triollm_gemm_supported says so). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
int triollm_gemm_supported(void) { return 0; }
int triollm_gemm_amx_from_rows(int rows) { return 0; }
int triollm_gemm_amx_supported(void) { return 0; }
int triollm_gemm_rows_bf16(const uint16_t* x, const uint16_t* w, const float* bias,
                           uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
    return 1;
}
void triollm_gemm_bf16(const uint16_t* x, const uint16_t* packed, const float* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {}
void triollm_gemm_bf16_pooled(const uint16_t* x, const uint16_t* packed, const float* bias,
                              uint16_t* y, int64_t m, int64_t n, int64_t k, int helpers) {}
#pragma GCC diagnostic pop
#endif
