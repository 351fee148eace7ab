/* Prompt attention for pooling steps, every prompt of a packed row attending to itself
   (model/cpu/varlen.py); fp32 on AVX-512, bf16 on AVX512-BF16. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define ROWS 8
#include "exp16.h"

static inline __mmask16 first(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF
        : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1u);
}

/* The largest of a row's first `seen` scores, scaled. */
static inline float row_max(const float* row, int64_t seen, __m512 scale) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t g = 0; g < (seen + 15) / 16; g++)
        top = _mm512_mask_max_ps(top, first(seen - 16 * g), top,
                                 _mm512_mul_ps(_mm512_loadu_ps(row + 16 * g), scale));
    return _mm512_reduce_max_ps(top);
}

/* Both element types below take a tile of 8 query rows at a time: its scores for 32
   keys at a time into `scores` (rows `padded` apart), the softmax numerators over
   each whole row, then the values summed into the 8 output rows in registers. */

/* ---- fp32: keys packed [round32(n)/16][dim][16], values read in place ---- */

static void pack_keys_f32(const float* k, int64_t stride, int64_t n, int64_t dim,
                          float* packed) {
    const int64_t blocks = (n + 31) / 32 * 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t l = 0; l < 16; l++) {
            const int64_t j = 16 * b + l;
            float* dst = packed + b * dim * 16 + l;
            for (int64_t d = 0; d < dim; d++) dst[16 * d] = j < n ? k[j * stride + d] : 0.0f;
        }
}

static void attend_head_f32(const float* q, int64_t q_stride, const float* keys,
                            const float* v, int64_t v_stride, float* out, int64_t out_stride,
                            int64_t length, int64_t dim, float scale, int causal,
                            float* scores)
{
    const int64_t padded = (length + 31) / 32 * 32, chunks = dim / 16;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i0 = 0; i0 < length; i0 += ROWS) {
        const int rows = length - i0 < ROWS ? (int)(length - i0) : ROWS;
        const float* qr[ROWS];
        for (int r = 0; r < ROWS; r++) qr[r] = q + (i0 + (r < rows ? r : rows - 1)) * q_stride;
        const int64_t n = causal ? i0 + rows : length;  /* keys any row of the tile sees */
        for (int64_t t = 0; t < (n + 31) / 32; t++) {
            __m512 s0[ROWS], s1[ROWS];
            for (int r = 0; r < ROWS; r++)
                s0[r] = s1[r] = _mm512_setzero_ps();
            const float* k0 = keys + 2 * t * dim * 16;
            const float* k1 = k0 + dim * 16;
            for (int64_t d = 0; d < dim; d++) {
                const __m512 a = _mm512_loadu_ps(k0 + 16 * d);
                const __m512 b = _mm512_loadu_ps(k1 + 16 * d);
                for (int r = 0; r < ROWS; r++) {
                    const __m512 x = _mm512_set1_ps(qr[r][d]);
                    s0[r] = _mm512_fmadd_ps(x, a, s0[r]);
                    s1[r] = _mm512_fmadd_ps(x, b, s1[r]);
                }
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_storeu_ps(scores + r * padded + 32 * t, s0[r]);
                _mm512_storeu_ps(scores + r * padded + 32 * t + 16, s1[r]);
            }
        }
        /* scores -> exp(score * scale - max) in place, 0 past what the row sees */
        float inverse[ROWS];
        for (int r = 0; r < ROWS; r++) {
            float* row = scores + r * padded;
            if (r >= rows) {  /* a short last tile: rows that add nothing */
                memset(row, 0, sizeof(float) * n);
                inverse[r] = 0.0f;
                continue;
            }
            const int64_t seen = causal ? i0 + r + 1 : length;
            const __m512 most = _mm512_set1_ps(row_max(row, seen, sc));
            __m512 total = _mm512_setzero_ps();
            for (int64_t g = 0; g < (n + 15) / 16; g++) {
                const __m512 e = _mm512_maskz_mov_ps(first(seen - 16 * g), exp16(
                    _mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * g), sc, most)));
                _mm512_storeu_ps(row + 16 * g, e);
                total = _mm512_add_ps(total, e);
            }
            inverse[r] = 1.0f / _mm512_reduce_add_ps(total);
        }
        for (int64_t c = 0; c < chunks; c += 2) {
            const int two = c + 1 < chunks;
            __m512 a0[ROWS], a1[ROWS];
            for (int r = 0; r < ROWS; r++)
                a0[r] = a1[r] = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const float* vj = v + j * v_stride + 16 * c;
                const __m512 x0 = _mm512_loadu_ps(vj);
                const __m512 x1 = two ? _mm512_loadu_ps(vj + 16) : x0;
                for (int r = 0; r < ROWS; r++) {
                    const __m512 w = _mm512_set1_ps(scores[r * padded + j]);
                    a0[r] = _mm512_fmadd_ps(w, x0, a0[r]);
                    a1[r] = _mm512_fmadd_ps(w, x1, a1[r]);
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m512 inv = _mm512_set1_ps(inverse[r]);
                float* o = out + (i0 + r) * out_stride + 16 * c;
                _mm512_storeu_ps(o, _mm512_mul_ps(a0[r], inv));
                if (two) _mm512_storeu_ps(o + 16, _mm512_mul_ps(a1[r], inv));
            }
        }
    }
}

#if defined(__AVX512BF16__)
#define HAVE_BF16 1

/* ---- bf16: keys packed [round32(n)/16][dim/2][16][2] and values
   [dim/16][ceil(n/2)][16][2], the pairs vdpbf16ps multiplies ---- */

static inline __m512bh pair_at(const uint16_t* p) {
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(bits);
}

static void pack_keys_bf16(const uint16_t* k, int64_t stride, int64_t n, int64_t dim,
                           uint32_t* packed) {
    const int64_t blocks = (n + 31) / 32 * 2, pairs = dim / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t l = 0; l < 16; l++) {
            const int64_t j = 16 * b + l;
            uint32_t* dst = packed + b * pairs * 16 + l;
            if (j < n) {
                const uint16_t* row = k + j * stride;
                for (int64_t p = 0; p < pairs; p++) memcpy(dst + 16 * p, row + 2 * p, 4);
            } else {
                for (int64_t p = 0; p < pairs; p++) dst[16 * p] = 0;
            }
        }
}

static void pack_values_bf16(const uint16_t* v, int64_t stride, int64_t n, int64_t dim,
                             uint16_t* packed) {
    const int64_t pairs = (n + 1) / 2, chunks = dim / 16;
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t jp = 0; jp < pairs; jp++) {
            const __m256i even = _mm256_loadu_si256((const __m256i*)(v + 2 * jp * stride + 16 * c));
            const __m256i odd = 2 * jp + 1 < n
                ? _mm256_loadu_si256((const __m256i*)(v + (2 * jp + 1) * stride + 16 * c))
                : _mm256_setzero_si256();
            const __m512i both = _mm512_or_si512(
                _mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
            _mm512_storeu_si512(packed + (c * pairs + jp) * 32, both);
        }
}

static void attend_head_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* keys,
                             const uint16_t* values, uint16_t* out, int64_t out_stride,
                             int64_t length, int64_t dim, float scale, int causal,
                             float* scores, uint16_t* probs)
{
    const int64_t padded = (length + 31) / 32 * 32, pairs = dim / 2, chunks = dim / 16;
    const int64_t value_pairs = (length + 1) / 2;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i0 = 0; i0 < length; i0 += ROWS) {
        const int rows = length - i0 < ROWS ? (int)(length - i0) : ROWS;
        const uint16_t* qr[ROWS];
        for (int r = 0; r < ROWS; r++) qr[r] = q + (i0 + (r < rows ? r : rows - 1)) * q_stride;
        const int64_t n = causal ? i0 + rows : length;
        for (int64_t t = 0; t < (n + 31) / 32; t++) {
            __m512 s0[ROWS], s1[ROWS];
            for (int r = 0; r < ROWS; r++)
                s0[r] = s1[r] = _mm512_setzero_ps();
            const uint16_t* k0 = keys + 2 * t * pairs * 32;
            const uint16_t* k1 = k0 + pairs * 32;
            for (int64_t p = 0; p < pairs; p++) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + 32 * p);
                const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + 32 * p);
                for (int r = 0; r < ROWS; r++) {
                    const __m512bh x = pair_at(qr[r] + 2 * p);
                    s0[r] = _mm512_dpbf16_ps(s0[r], x, a);
                    s1[r] = _mm512_dpbf16_ps(s1[r], x, b);
                }
            }
            for (int r = 0; r < ROWS; r++) {
                _mm512_storeu_ps(scores + r * padded + 32 * t, s0[r]);
                _mm512_storeu_ps(scores + r * padded + 32 * t + 16, s1[r]);
            }
        }
        /* probabilities rounded to bf16 (unnormalised, 0 past what the row sees); the
           sum is of the rounded values, those the values are multiplied by */
        const int64_t groups = (n + 15) / 16;
        float inverse[ROWS];
        for (int r = 0; r < ROWS; r++) {
            uint16_t* prob = probs + r * padded;
            if (r >= rows) {
                memset(prob, 0, sizeof(uint16_t) * 16 * groups);
                inverse[r] = 0.0f;
                continue;
            }
            const float* row = scores + r * padded;
            const int64_t seen = causal ? i0 + r + 1 : length;
            const __m512 most = _mm512_set1_ps(row_max(row, seen, sc));
            __m512 total = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const __m512 e = _mm512_maskz_mov_ps(first(seen - 16 * g), exp16(
                    _mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * g), sc, most)));
                const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
                _mm256_storeu_si256((__m256i*)(prob + 16 * g), rounded);
                total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(rounded), 16)));
            }
            inverse[r] = 1.0f / _mm512_reduce_add_ps(total);
        }
        for (int64_t c = 0; c < chunks; c += 2) {
            const int two = c + 1 < chunks;
            __m512 a0[ROWS], a1[ROWS];
            for (int r = 0; r < ROWS; r++)
                a0[r] = a1[r] = _mm512_setzero_ps();
            const uint16_t* v0 = values + c * value_pairs * 32;
            const uint16_t* v1 = two ? v0 + value_pairs * 32 : v0;
            for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512(v0 + 32 * jp);
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512(v1 + 32 * jp);
                for (int r = 0; r < ROWS; r++) {
                    const __m512bh w = pair_at(probs + r * padded + 2 * jp);
                    a0[r] = _mm512_dpbf16_ps(a0[r], w, x0);
                    a1[r] = _mm512_dpbf16_ps(a1[r], w, x1);
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m512 inv = _mm512_set1_ps(inverse[r]);
                uint16_t* o = out + (i0 + r) * out_stride + 16 * c;
                _mm256_storeu_si256((__m256i*)o,
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a0[r], inv)));
                if (two)
                    _mm256_storeu_si256((__m256i*)(o + 16),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a1[r], inv)));
            }
        }
    }
}
#endif

/* bit 0: fp32 inputs run here; bit 1: bf16 ones */
int triollm_varlen_supported(void) {
#ifdef HAVE_BF16
    return 3;
#else
    return 1;
#endif
}

/* q [T][q_heads][dim] with strides (q_token, q_head), k and v [T][kv_heads][dim] with
   strides (kv_token, kv_head) each, the last dimension contiguous; out [T][q_heads][dim]
   contiguous. Prompt p is tokens [starts[p], starts[p] + lengths[p]). `bf16` says the
   element type (else fp32). Returns nonzero where scratch could not be allocated or the
   type is not supported here. */
int triollm_varlen_attention(const void* q, const void* k, const void* v, void* out,
                             const int64_t* starts, const int64_t* lengths, int64_t prompts,
                             int64_t q_heads, int64_t kv_heads, int64_t dim,
                             int64_t q_token, int64_t q_head, int64_t k_token, int64_t k_head,
                             int64_t v_token, int64_t v_head, float scale, int causal,
                             int bf16, int threads)
{
#ifndef HAVE_BF16
    if (bf16) return 1;
#endif
    int64_t longest = 0;
    for (int64_t p = 0; p < prompts; p++) longest = lengths[p] > longest ? lengths[p] : longest;
    const int64_t padded = (longest + 31) / 32 * 32, group = q_heads / kv_heads;
    /* packed keys and values (bf16) or keys (fp32), probabilities, scores */
    const size_t bytes = (size_t)(2 * padded * dim) * (bf16 ? 2 : 4)
                         + sizeof(uint16_t) * (size_t)(ROWS * padded)
                         + sizeof(float) * (size_t)(ROWS * padded) + 64;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        char* scratch = (char*)malloc(bytes);
        if (scratch == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        char* aligned = (char*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
        float* scores = (float*)aligned;
        uint16_t* probs = (uint16_t*)(scores + ROWS * padded);
        char* packed = (char*)(probs + ROWS * padded);
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t p = 0; p < prompts; p++) {
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                if (scratch == NULL) continue;
                const int64_t start = starts[p], length = lengths[p];
                if (!bf16) {
                    const float *qf = (const float*)q, *kf = (const float*)k, *vf = (const float*)v;
                    pack_keys_f32(kf + start * k_token + kh * k_head, k_token, length, dim,
                                  (float*)packed);
                    for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                        attend_head_f32(qf + start * q_token + h * q_head, q_token,
                                        (const float*)packed,
                                        vf + start * v_token + kh * v_head, v_token,
                                        (float*)out + (start * q_heads + h) * dim,
                                        q_heads * dim, length, dim, scale, causal, scores);
                    continue;
                }
#ifdef HAVE_BF16
                const uint16_t *qb = (const uint16_t*)q, *kb = (const uint16_t*)k,
                               *vb = (const uint16_t*)v;
                uint16_t* keys = (uint16_t*)packed;
                uint16_t* values = keys + padded * dim;
                pack_keys_bf16(kb + start * k_token + kh * k_head, k_token, length, dim,
                               (uint32_t*)keys);
                pack_values_bf16(vb + start * v_token + kh * v_head, v_token, length, dim,
                                 values);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    attend_head_bf16(qb + start * q_token + h * q_head, q_token, keys, values,
                                     (uint16_t*)out + (start * q_heads + h) * dim,
                                     q_heads * dim, length, dim, scale, causal, scores, probs);
#endif
            }
        }
        free(scratch);
    }
    return failed;
}
#else
/* A stub with the same signature, never called (triollm_varlen_supported says so). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
int triollm_varlen_supported(void) { return 0; }
int triollm_varlen_attention(const void* q, const void* k, const void* v, void* out,
                             const int64_t* starts, const int64_t* lengths, int64_t prompts,
                             int64_t q_heads, int64_t kv_heads, int64_t dim,
                             int64_t q_token, int64_t q_head, int64_t k_token, int64_t k_head,
                             int64_t v_token, int64_t v_head, float scale, int causal,
                             int bf16, int threads)
{ return 1; }
#pragma GCC diagnostic pop
#endif
