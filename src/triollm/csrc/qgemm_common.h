/* What the int4/int8 kernels (qgemm_avx2.c, qgemm_avx512.c, qgemm_vnni.c) share around
   their tiles: the product's arguments, the inputs widened to fp32 with their group sums
   (the fp32 kernels' prepared inputs), a unit of work over fp32 inputs
   (QGEMM_PRODUCT_UNIT, over a kernel's tiles) and the plain (OpenMP) and pooled entry
   points over any kernel's product_unit and prepared inputs (QGEMM_ENTRY_POINTS); and
   for the AVX-512 kernels, fp32 to bf16 (to_bf16). */
#ifndef TRIOLLM_QGEMM_COMMON_H
#define TRIOLLM_QGEMM_COMMON_H

#include "pool.h"

#include <stdlib.h>
#include <string.h>
#include <stdint.h>

/* The product's arguments, as the plain call and the pooled job both hold them. */
typedef struct {
    const void* xin;       /* the prepared inputs: fp32 [m][k] for the fp32 kernels */
    const float* xs;       /* their per-row terms: fp32 kernels, int4: [m][k/gsize] input
                              sums per group */
    const void* w;         /* the packed weight */
    const void* scales;    /* int4: fp16 scales and zero terms; int8: fp32 scales */
    uint16_t* y;           /* [m][n] bf16 */
    int64_t m, n, k, gsize; /* gsize 0: int8 */
} product;

/* Units of work: blocks of 16 outputs by chunks of `rows` rows. */
static inline int64_t qgemm_units(int64_t m, int64_t n, int64_t rows) {
    return n / 16 * ((m + rows - 1) / rows);
}

/* x (bf16) -> fp32; with gsize, each row's input sum per group into xs. */
static inline void qgemm_widen(const uint16_t* x, float* xf, float* xs, int64_t m,
                               int64_t k, int64_t gsize) {
    for (int64_t i = 0; i < m * k; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, sizeof bits);
    }
    if (!gsize) return;
    const int64_t groups = k / gsize;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0;
            for (int64_t i = 0; i < gsize; i++) sum += xf[r * k + g * gsize + i];
            xs[r * groups + g] = sum;
        }
}

/* Bytes the fp32 kernels' prepared inputs take: fp32 rows and group sums. */
static inline size_t qgemm_widened_bytes(int64_t m, int64_t k, int64_t gsize) {
    return (size_t)(m * k + (gsize ? m * (k / gsize) : 0)) * sizeof(float);
}

/* The fp32 kernels' prepared inputs into scratch (qgemm_widened_bytes of it), pointed
   to by a. */
static inline void qgemm_prepare_widened(const uint16_t* x, void* scratch, product* a) {
    float* xf = (float*)scratch;
    qgemm_widen(x, xf, xf + a->m * a->k, a->m, a->k, a->gsize);
    a->xin = xf;
    a->xs = xf + a->m * a->k;
}

typedef struct {
    pool_job base;
    product a;  /* its xin and xs point into the job: a helper may read them later */
} product_job;

/* product_unit(a, unit, job): rows [16 rb, 16 rb + 16) of output block u (a unit), over
   a kernel's q4_tile and q8_tile (rows 1-3 and CHUNK at a time) into sums of type OUT,
   OUT_PER_ROW of them a row, then its store_sums(y, sums) of each row; a helper stores
   only once pool_commit says so. */
#define QGEMM_PRODUCT_UNIT(OUT, OUT_PER_ROW)                                            \
static void product_unit(const product* a, int64_t unit, pool_job* job) {              \
    const int64_t blocks = (a->m + MAX_ROWS - 1) / MAX_ROWS;                            \
    const int64_t u = unit / blocks, first = unit % blocks * MAX_ROWS;                  \
    const int64_t last = a->m < first + MAX_ROWS ? a->m : first + MAX_ROWS;            \
    OUT out[MAX_ROWS * (OUT_PER_ROW)];                                                  \
    for (int64_t m0 = first; m0 < last; m0 += CHUNK) {                                  \
        const int rows = last - m0 < CHUNK ? (int)(last - m0) : CHUNK;                  \
        OUT* o = out + (OUT_PER_ROW) * (m0 - first);                                    \
        const float* x = (const float*)a->xin + m0 * a->k;                                             \
        if (a->gsize) {                                                                 \
            const int64_t groups = a->k / a->gsize;                                     \
            const uint32_t* w = (const uint32_t*)a->w + u * 2 * a->k;                   \
            const uint16_t* sz = (const uint16_t*)a->scales + u * 32 * groups;          \
            const float* xs = a->xs + m0 * groups;                                      \
            switch (rows) {                                                             \
            case 1: q4_tile(x, xs, w, sz, o, 1, a->k, a->gsize); break;                 \
            case 2: q4_tile(x, xs, w, sz, o, 2, a->k, a->gsize); break;                 \
            case 3: q4_tile(x, xs, w, sz, o, 3, a->k, a->gsize); break;                 \
            default: q4_tile(x, xs, w, sz, o, CHUNK, a->k, a->gsize); break;            \
            }                                                                           \
        } else {                                                                        \
            const int8_t* w = (const int8_t*)a->w + u * 16 * a->k;                      \
            const float* s = (const float*)a->scales + 16 * u;                          \
            switch (rows) {                                                             \
            case 1: q8_tile(x, w, s, o, 1, a->k); break;                                \
            case 2: q8_tile(x, w, s, o, 2, a->k); break;                                \
            case 3: q8_tile(x, w, s, o, 3, a->k); break;                                \
            default: q8_tile(x, w, s, o, CHUNK, a->k); break;                           \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    if (job && !pool_commit(job, unit)) return;                                         \
    for (int64_t r = first; r < last; r++)                                              \
        store_sums(a->y + r * a->n + 16 * u, out + (OUT_PER_ROW) * (r - first));        \
}

/* NAME(x, w, scales, y, m, n, k, gsize, threads): y[m, n] = x[m, k] @ W^T, bf16 in and
   out; gsize: the int4 group size (a multiple of 8 dividing k), 0 for int8. Returns 0
   where memory for the prepared inputs ran out. NAME_pooled(..., helpers): the same on
   the calling thread and up to `helpers` pool helpers; `w` and `scales` must outlive the
   pool's next drain. Over the kernel's product_unit, with its inputs prepared by
   PREPARE(x, scratch, &a) into SCRATCH_BYTES(m, k, gsize) bytes. */
#define QGEMM_ENTRY_POINTS(NAME, SCRATCH_BYTES, PREPARE)                                \
int NAME(const uint16_t* x, const void* w, const void* scales, uint16_t* y, int64_t m,  \
         int64_t n, int64_t k, int64_t gsize, int threads)                              \
{                                                                                       \
    void* scratch = malloc(SCRATCH_BYTES(m, k, gsize));                                 \
    if (scratch == NULL) return 0;                                                      \
    product a = {NULL, NULL, w, scales, y, m, n, k, gsize};                             \
    PREPARE(x, scratch, &a);                                                            \
    const int64_t units = qgemm_units(m, n, MAX_ROWS);                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                   \
    for (int64_t unit = 0; unit < units; unit++) product_unit(&a, unit, NULL);          \
    free(scratch);                                                                      \
    return 1;                                                                           \
}                                                                                       \
                                                                                        \
static void product_job_unit(pool_job* base, int64_t unit, int helper) {               \
    product_unit(&((product_job*)base)->a, unit, helper ? base : NULL);                 \
}                                                                                       \
                                                                                        \
int NAME##_pooled(const uint16_t* x, const void* w, const void* scales, uint16_t* y,    \
                  int64_t m, int64_t n, int64_t k, int64_t gsize, int helpers)          \
{                                                                                       \
    const int64_t units = qgemm_units(m, n, MAX_ROWS);                                  \
    const size_t head = (sizeof(product_job) + (size_t)units + 63) & ~(size_t)63;      \
    product_job* job = (product_job*)malloc(head + SCRATCH_BYTES(m, k, gsize));         \
    if (job == NULL) return NAME(x, w, scales, y, m, n, k, gsize, 1);                   \
    job->base.run = product_job_unit;                                                   \
    job->base.units = units;                                                            \
    job->base.state = (_Atomic unsigned char*)(job + 1);                                \
    const product a = {NULL, NULL, w, scales, y, m, n, k, gsize};                       \
    job->a = a;                                                                         \
    PREPARE(x, (char*)job + head, &job->a);                                             \
    triollm_pool_run(&job->base, helpers);                                              \
    return 1;                                                                           \
}

/* NAME_supported (0), NAME and NAME_pooled with the entry points' signatures, for a
   build without the kernel's instructions: never called (NAME_supported says so). */
#define QGEMM_STUBS(NAME)                                                               \
_Pragma("GCC diagnostic push")                                                          \
_Pragma("GCC diagnostic ignored \"-Wunused-parameter\"")                               \
int NAME##_supported(void) { return 0; }                                                \
int NAME(const uint16_t* x, const void* w, const void* scales, uint16_t* y, int64_t m,  \
         int64_t n, int64_t k, int64_t gsize, int threads) {                            \
    return 0;                                                                           \
}                                                                                       \
int NAME##_pooled(const uint16_t* x, const void* w, const void* scales, uint16_t* y,    \
                  int64_t m, int64_t n, int64_t k, int64_t gsize, int helpers) {        \
    return 0;                                                                           \
}                                                                                       \
_Pragma("GCC diagnostic pop")

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 fp32 -> 16 bf16, rounded to nearest even (NaN stays NaN), without AVX512-BF16 (the
   AVX-512 and VNNI kernels). */
static inline __m256i to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                    _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
}
#endif

#endif
