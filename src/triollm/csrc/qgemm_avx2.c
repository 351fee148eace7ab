/* Weight-only int4 (groups of scales and zero points) and int8 (a scale per output)
   products for CPUs with AVX2, FMA and F16C (model/quantization/avx2_kernels.py), on
   OpenMP or the helper pool; an empty library elsewhere.

   Layouts, per block of 16 outputs (n is a multiple of 16):
   - int4: uint32 [n/16][k/8][16]: the lane of output j holds its 8 inputs 8o..8o+7 as
     nibbles, input 8o+i at bits 4i; beside it fp16 [n/16][k/G][2][16]: each group's
     scale s and zero term s*z, so w = q*s - s*z.
   - int8: int8 [n/16][k][16], signed; fp32 [n] scales, w = q*s.
   A unit of work is a block of 16 outputs for up to 16 rows, computed 4 rows at a
   time, so a block's weights come from memory once and from cache for its further
   rows. Inputs are widened to fp32 once per call; the integer weights, converted to
   fp32, are multiplied by broadcast inputs into per-group sums, which the group's
   scale and zero term (times the group's input sum) fold into the output. Sums are
   fp32, the output is rounded to bf16 once (to nearest even). */
#include "qgemm_common.h"

#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define MAX_ROWS 16
#define CHUNK 4

int triollm_qgemm_avx2_supported(void) { return 1; }

/* 8 fp32 -> 8 bf16 in the low 16 bits of each lane, rounded to nearest even. */
static inline __m256i to_bf16_lanes(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

static inline void store_bf16(uint16_t* y, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_packus_epi32(to_bf16_lanes(lo), to_bf16_lanes(hi));
    _mm256_storeu_si256((__m256i*)y, _mm256_permute4x64_epi64(packed, 0xD8));
}

/* Rows [0, rows) of xf times int4 block w into out[rows][16] (fp32, overwritten).
   xs: each row's input sum per group. Up to 2 rows, even and odd inputs sum apart, so
   a row has 4 dependency chains. */
static inline __attribute__((always_inline)) void q4_tile(
    const float* xf, const float* xs, const uint32_t* w, const uint16_t* sz, float* out,
    const int rows, int64_t k, int64_t gsize)
{
    const int split = rows <= 2;
    const int64_t groups = k / gsize, octets = gsize / 8;
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + 16 * r, _mm256_setzero_ps());
        _mm256_storeu_ps(out + 16 * r + 8, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < groups; g++) {
        __m256 lo[CHUNK], hi[CHUNK], lo2[CHUNK], hi2[CHUNK];
        for (int r = 0; r < rows; r++) lo[r] = hi[r] = lo2[r] = hi2[r] = _mm256_setzero_ps();
        const uint32_t* wg = w + g * octets * 16;
        const float* xg = xf + g * gsize;
        for (int64_t o = 0; o < octets; o++) {
            const __m256i a = _mm256_loadu_si256((const __m256i*)(wg + 16 * o));
            const __m256i b = _mm256_loadu_si256((const __m256i*)(wg + 16 * o + 8));
            _mm_prefetch((const char*)(wg + 16 * o) + 1024, _MM_HINT_T0);
#define Q4_STEP(i, L, H)                                                              \
            {                                                                         \
                const __m256 qa = _mm256_cvtepi32_ps(                                 \
                    _mm256_and_si256(_mm256_srli_epi32(a, 4 * (i)), mask));           \
                const __m256 qb = _mm256_cvtepi32_ps(                                 \
                    _mm256_and_si256(_mm256_srli_epi32(b, 4 * (i)), mask));           \
                for (int r = 0; r < rows; r++) {                                      \
                    const __m256 x = _mm256_broadcast_ss(xg + r * k + 8 * o + (i));   \
                    L[r] = _mm256_fmadd_ps(qa, x, L[r]);                              \
                    H[r] = _mm256_fmadd_ps(qb, x, H[r]);                              \
                }                                                                     \
            }
            if (split) {
                Q4_STEP(0, lo, hi) Q4_STEP(1, lo2, hi2) Q4_STEP(2, lo, hi) Q4_STEP(3, lo2, hi2)
                Q4_STEP(4, lo, hi) Q4_STEP(5, lo2, hi2) Q4_STEP(6, lo, hi) Q4_STEP(7, lo2, hi2)
            } else {
                Q4_STEP(0, lo, hi) Q4_STEP(1, lo, hi) Q4_STEP(2, lo, hi) Q4_STEP(3, lo, hi)
                Q4_STEP(4, lo, hi) Q4_STEP(5, lo, hi) Q4_STEP(6, lo, hi) Q4_STEP(7, lo, hi)
            }
#undef Q4_STEP
        }
        const uint16_t* p = sz + 32 * g;
        const __m256 s_lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        const __m256 s_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)));
        const __m256 z_lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
        const __m256 z_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 24)));
        for (int r = 0; r < rows; r++) {
            if (split) {
                lo[r] = _mm256_add_ps(lo[r], lo2[r]);
                hi[r] = _mm256_add_ps(hi[r], hi2[r]);
            }
            const __m256 sum = _mm256_broadcast_ss(xs + r * groups + g);
            __m256 y_lo = _mm256_loadu_ps(out + 16 * r), y_hi = _mm256_loadu_ps(out + 16 * r + 8);
            y_lo = _mm256_fnmadd_ps(z_lo, sum, _mm256_fmadd_ps(s_lo, lo[r], y_lo));
            y_hi = _mm256_fnmadd_ps(z_hi, sum, _mm256_fmadd_ps(s_hi, hi[r], y_hi));
            _mm256_storeu_ps(out + 16 * r, y_lo);
            _mm256_storeu_ps(out + 16 * r + 8, y_hi);
        }
    }
}

/* Rows [0, rows) of xf times int8 block w (scaled by s[16]) into out[rows][16]. */
static inline __attribute__((always_inline)) void q8_tile(
    const float* xf, const int8_t* w, const float* s, float* out, const int rows, int64_t k)
{
    const int split = rows <= 2;
    __m256 lo[CHUNK], hi[CHUNK], lo2[CHUNK], hi2[CHUNK];
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = lo2[r] = hi2[r] = _mm256_setzero_ps();
    int64_t p = 0;
#define Q8_STEP(L, H)                                                                  \
    {                                                                                  \
        const __m256 wa = _mm256_cvtepi32_ps(                                          \
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 16 * p))));      \
        const __m256 wb = _mm256_cvtepi32_ps(                                          \
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 16 * p + 8))));  \
        for (int r = 0; r < rows; r++) {                                               \
            const __m256 x = _mm256_broadcast_ss(xf + r * k + p);                      \
            L[r] = _mm256_fmadd_ps(wa, x, L[r]);                                       \
            H[r] = _mm256_fmadd_ps(wb, x, H[r]);                                       \
        }                                                                              \
        p++;                                                                           \
    }
    for (; p + 2 <= k;) {
        _mm_prefetch((const char*)(w + 16 * p) + 1024, _MM_HINT_T0);
        if (split) {
            Q8_STEP(lo, hi) Q8_STEP(lo2, hi2)
        } else {
            Q8_STEP(lo, hi) Q8_STEP(lo, hi)
        }
    }
    if (p < k) Q8_STEP(lo, hi)
#undef Q8_STEP
    const __m256 s_lo = _mm256_loadu_ps(s), s_hi = _mm256_loadu_ps(s + 8);
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + 16 * r, _mm256_mul_ps(s_lo, _mm256_add_ps(lo[r], lo2[r])));
        _mm256_storeu_ps(out + 16 * r + 8, _mm256_mul_ps(s_hi, _mm256_add_ps(hi[r], hi2[r])));
    }
}

/* One row's 16 sums, rounded to bf16, into y. */
static inline void store_sums(uint16_t* y, const float* sums) {
    store_bf16(y, _mm256_loadu_ps(sums), _mm256_loadu_ps(sums + 8));
}

QGEMM_PRODUCT_UNIT(float, 16)

QGEMM_ENTRY_POINTS(triollm_qgemm_avx2, qgemm_widened_bytes, qgemm_prepare_widened)

#else
QGEMM_STUBS(triollm_qgemm_avx2)
#endif
