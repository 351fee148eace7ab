/* One (sequence, KV head) of paged decode attention, as decode.c calls it: the portable
   three-pass loop and, where the compiler targets AVX-512, the one-pass online softmax;
   each for a cache of fp32, bf16, e5m2 or e4m3 elements (fp8.h), widened as it is read.
   Included by decode.c alone (its static functions are that file's). */
#ifndef TRIOLLM_DECODE_PAIR_H
#define TRIOLLM_DECODE_PAIR_H

#include <math.h>
#include <stdint.h>

#include "fp8.h"

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value;
    value.u = ((uint32_t)bits) << 16;
    return value.f;
}

#define AS_FLOAT(x) (x)
#define FROM_BF16(x) bf16_to_float(x)

/* A block's rows [begin, end) as the loops below read them: in place (fp32, bf16), or
   widened to fp32 once into `wide` (8-bit caches), so that a block's keys and values
   are converted once for all the query heads of their group, not once per head. */
#define DEFINE_ROWS_IN_PLACE(NAME, CACHE_T)                                             \
static inline const CACHE_T* NAME(float* wide, const CACHE_T* rows, int64_t begin,      \
                                  int64_t end, int64_t dim) {                           \
    (void)wide; (void)begin; (void)end; (void)dim;                                      \
    return rows;                                                                        \
}
#define DEFINE_ROWS_WIDENED(NAME, CONVERT)                                              \
static inline const float* NAME(float* wide, const uint8_t* rows, int64_t begin,        \
                                int64_t end, int64_t dim) {                             \
    _Pragma("omp simd")                                                                 \
    for (int64_t i = begin * dim; i < end * dim; i++) wide[i] = CONVERT(rows[i]);       \
    return wide;                                                                        \
}

DEFINE_ROWS_IN_PLACE(rows_f32, float)
DEFINE_ROWS_IN_PLACE(rows_bf16, uint16_t)
DEFINE_ROWS_WIDENED(rows_e5m2, e5m2_to_float)
DEFINE_ROWS_WIDENED(rows_e4m3, e4m3_to_float)

/* One (sequence, KV head): its `groups` query heads attend over tokens [start, ctx),
   read block by block through the sequence's row of the block table (no division per
   token). Four tokens' dot products are summed at once so their reductions overlap.
   ROWS gives a block's rows of ROW_T elements, which LOAD widens to fp32. */
#define DEFINE_ATTEND(NAME, CACHE_T, ROW_T, ROWS, WIDE, LOAD)                           \
static inline __attribute__((always_inline)) void NAME(                                 \
    const float* query, const CACHE_T* keys, const CACHE_T* vals,                       \
    const int64_t* row_table, float* scores, float* out,                                \
    int64_t groups, int64_t block_size, int64_t dim, int64_t start, int64_t ctx,        \
    float scale, float softcap)                                                         \
{                                                                                       \
    const int64_t span = ctx - start;                                                   \
    float wide[WIDE ? block_size * dim : 1];                                            \
    for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {            \
        const int64_t first = blk * block_size;                                         \
        const int64_t begin = first < start ? start - first : 0;                        \
        const int64_t end = ctx - first < block_size ? ctx - first : block_size;        \
        const ROW_T* kb = ROWS(wide, keys + row_table[blk] * block_size * dim,          \
                               begin, end, dim);                                        \
        for (int64_t g = 0; g < groups; g++) {                                          \
            const float* qv = query + g * dim;                                          \
            float* row = scores + g * span + (first - start);                           \
            int64_t j = begin;                                                          \
            for (; j + 4 <= end; j += 4) {                                              \
                const ROW_T* k0 = kb + j * dim;                                         \
                const ROW_T* k1 = k0 + dim;                                             \
                const ROW_T* k2 = k1 + dim;                                             \
                const ROW_T* k3 = k2 + dim;                                             \
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;                       \
                _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                            \
                for (int64_t d = 0; d < dim; d++) {                                     \
                    const float q = qv[d];                                              \
                    d0 += q * LOAD(k0[d]); d1 += q * LOAD(k1[d]);                       \
                    d2 += q * LOAD(k2[d]); d3 += q * LOAD(k3[d]);                       \
                }                                                                       \
                row[j] = d0 * scale; row[j + 1] = d1 * scale;                           \
                row[j + 2] = d2 * scale; row[j + 3] = d3 * scale;                       \
            }                                                                           \
            for (; j < end; j++) {                                                      \
                const ROW_T* k0 = kb + j * dim;                                         \
                float d0 = 0.0f;                                                        \
                _Pragma("omp simd reduction(+:d0)")                                     \
                for (int64_t d = 0; d < dim; d++) d0 += qv[d] * LOAD(k0[d]);            \
                row[j] = d0 * scale;                                                    \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    for (int64_t g = 0; g < groups; g++) {                                              \
        float* row = scores + g * span;                                                 \
        if (softcap > 0.0f)                                                             \
            for (int64_t i = 0; i < span; i++) row[i] = tanhf(row[i] / softcap) * softcap; \
        float top = -INFINITY;                                                          \
        for (int64_t i = 0; i < span; i++) top = row[i] > top ? row[i] : top;           \
        float total = 0.0f;                                                             \
        for (int64_t i = 0; i < span; i++) { row[i] = expf(row[i] - top); total += row[i]; } \
        const float inverse = 1.0f / total;                                             \
        for (int64_t i = 0; i < span; i++) row[i] *= inverse;                           \
    }                                                                                   \
    for (int64_t i = 0; i < groups * dim; i++) out[i] = 0.0f;                           \
    for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {            \
        const int64_t first = blk * block_size;                                         \
        const int64_t begin = first < start ? start - first : 0;                        \
        const int64_t end = ctx - first < block_size ? ctx - first : block_size;        \
        const ROW_T* vb = ROWS(wide, vals + row_table[blk] * block_size * dim,          \
                               begin, end, dim);                                        \
        for (int64_t g = 0; g < groups; g++) {                                          \
            const float* weights = scores + g * span + (first - start);                 \
            float* sum = out + g * dim;                                                 \
            for (int64_t j = begin; j < end; j++) {                                     \
                const ROW_T* v = vb + j * dim;                                          \
                const float w = weights[j];                                             \
                _Pragma("omp simd")                                                     \
                for (int64_t d = 0; d < dim; d++) sum[d] += w * LOAD(v[d]);             \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
}

DEFINE_ATTEND(attend_f32, float, float, rows_f32, 0, AS_FLOAT)
DEFINE_ATTEND(attend_bf16, uint16_t, uint16_t, rows_bf16, 0, FROM_BF16)
DEFINE_ATTEND(attend_e5m2, uint8_t, float, rows_e5m2, 1, AS_FLOAT)
DEFINE_ATTEND(attend_e4m3, uint8_t, float, rows_e4m3, 1, AS_FLOAT)

#if defined(__AVX512F__) && !defined(TRIOLLM_PORTABLE)
#include <immintrin.h>
#define HAVE_AVX512 1

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

#include "exp16.h"

/* The same (sequence, KV head) work in one pass over the blocks with an online softmax:
   up to 16 tokens' scores at a time in one vector, the running maximum and sum, and the
   output rows in registers (dim = 16 * CHUNKS; CHUNKS 0 means dim / 16, read at run
   time). No scratch memory: `scores` is there only so one call macro serves both paths.
   LOAD16 reads the cache's values times 1 / UNIT (a power of two: the query is scaled by
   UNIT and the output too, exactly). */
#define DEFINE_ATTEND16(NAME, CACHE_T, LOAD16, CHUNKS, UNIT)                            \
static void NAME(                                                                       \
    const float* query, const CACHE_T* keys, const CACHE_T* vals,                       \
    const int64_t* row_table, float* scores, float* out,                                \
    int64_t groups, int64_t block_size, int64_t dim, int64_t start, int64_t ctx,        \
    float scale, float softcap)                                                         \
{                                                                                       \
    (void)scores;                                                                       \
    const int64_t chunks = CHUNKS > 0 ? CHUNKS : dim / 16;                              \
    for (int64_t g = 0; g < groups; g++) {                                              \
        __m512 q[CHUNKS > 0 ? CHUNKS : 16], acc[CHUNKS > 0 ? CHUNKS : 16];              \
        for (int64_t c = 0; c < chunks; c++) {                                          \
            q[c] = _mm512_mul_ps(_mm512_loadu_ps(query + g * dim + 16 * c),             \
                                 _mm512_set1_ps(scale * (UNIT)));                       \
            acc[c] = _mm512_setzero_ps();                                               \
        }                                                                               \
        float top = -INFINITY, total = 0.0f;                                            \
        float weights[16] __attribute__((aligned(64)));                                 \
        for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {        \
            const int64_t first = blk * block_size;                                     \
            const CACHE_T* kb = keys + row_table[blk] * block_size * dim;               \
            const CACHE_T* vb = vals + row_table[blk] * block_size * dim;               \
            const int64_t begin = first < start ? start - first : 0;                    \
            const int64_t end = ctx - first < block_size ? ctx - first : block_size;    \
            for (int64_t j0 = begin; j0 < end; j0 += 16) {                              \
                const int64_t count = end - j0 < 16 ? end - j0 : 16;                    \
                for (int64_t t = 0; t < count; t++) {                                   \
                    const CACHE_T* k = kb + (j0 + t) * dim;                             \
                    __m512 dot = _mm512_mul_ps(q[0], LOAD16(k));                        \
                    for (int64_t c = 1; c < chunks; c++)                                \
                        dot = _mm512_fmadd_ps(q[c], LOAD16(k + 16 * c), dot);           \
                    weights[t] = _mm512_reduce_add_ps(dot);                             \
                }                                                                       \
                if (softcap > 0.0f)                                                     \
                    for (int64_t t = 0; t < count; t++)                                 \
                        weights[t] = tanhf(weights[t] / softcap) * softcap;             \
                const __mmask16 valid = (__mmask16)((1u << count) - 1u);                \
                const __m512 s = _mm512_maskz_load_ps(valid, weights);                  \
                const float block_top = _mm512_mask_reduce_max_ps(valid, s);            \
                const float new_top = block_top > top ? block_top : top;                \
                const __m512 p = _mm512_maskz_mov_ps(                                   \
                    valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_top))));           \
                if (new_top > top) {                                                    \
                    const float shrink = expf(top - new_top);                           \
                    total *= shrink;                                                    \
                    for (int64_t c = 0; c < chunks; c++)                                \
                        acc[c] = _mm512_mul_ps(acc[c], _mm512_set1_ps(shrink));         \
                    top = new_top;                                                      \
                }                                                                       \
                total += _mm512_reduce_add_ps(p);                                       \
                _mm512_store_ps(weights, p);                                            \
                for (int64_t t = 0; t < count; t++) {                                   \
                    const CACHE_T* v = vb + (j0 + t) * dim;                             \
                    const __m512 w = _mm512_set1_ps(weights[t]);                        \
                    for (int64_t c = 0; c < chunks; c++)                                \
                        acc[c] = _mm512_fmadd_ps(w, LOAD16(v + 16 * c), acc[c]);        \
                }                                                                       \
            }                                                                           \
        }                                                                               \
        const __m512 inverse = _mm512_set1_ps((UNIT) / total);                          \
        for (int64_t c = 0; c < chunks; c++)                                            \
            _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(acc[c], inverse));   \
    }                                                                                   \
}

DEFINE_ATTEND16(attend16_f32_d64, float, load16_f32, 4, 1.0f)
DEFINE_ATTEND16(attend16_bf16_d64, uint16_t, load16_bf16, 4, 1.0f)
DEFINE_ATTEND16(attend16_f32_d128, float, load16_f32, 8, 1.0f)
DEFINE_ATTEND16(attend16_bf16_d128, uint16_t, load16_bf16, 8, 1.0f)
DEFINE_ATTEND16(attend16_f32, float, load16_f32, 0, 1.0f)
DEFINE_ATTEND16(attend16_bf16, uint16_t, load16_bf16, 0, 1.0f)
DEFINE_ATTEND16(attend16_e5m2_d64, uint8_t, load16_e5m2, 4, 1.0f)
DEFINE_ATTEND16(attend16_e5m2_d128, uint8_t, load16_e5m2, 8, 1.0f)
DEFINE_ATTEND16(attend16_e5m2, uint8_t, load16_e5m2, 0, 1.0f)
DEFINE_ATTEND16(attend16_e4m3_d64, uint8_t, load16_e4m3_under_256, 4, 0x1p8f)
DEFINE_ATTEND16(attend16_e4m3_d128, uint8_t, load16_e4m3_under_256, 8, 0x1p8f)
DEFINE_ATTEND16(attend16_e4m3, uint8_t, load16_e4m3_under_256, 0, 0x1p8f)
#else
#define HAVE_AVX512 0
#endif

#endif
