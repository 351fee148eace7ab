/* Weight-only int4 (groups of scales and zero points) and int8 (a scale per output)
   products for CPUs with AVX-512 (F, BW; model/quantization/avx512_kernels.py), on
   OpenMP or the helper pool; an empty library elsewhere.

   The layouts are the AVX2 kernel's (csrc/qgemm_avx2.c), per block of 16 outputs (n is
   a multiple of 16):
   - int4: uint32 [n/16][k/8][16]: the lane of output j holds its 8 inputs 8o..8o+7 as
     nibbles, input 8o+i at bits 4i; beside it fp16 [n/16][k/G][2][16]: each group's
     scale s and zero term s*z, so w = q*s - s*z.
   - int8: int8 [n/16][k][16], signed; fp32 [n] scales, w = q*s.
   Inputs are widened to fp32 once per call and the weights multiplied in fp32 FMAs,
   16 outputs an instruction (vdpbf16ps, 32 products an instruction, has a quarter of
   the FMA's throughput on the CPUs measured, so bf16 products lose). A nibble becomes
   its float in a table lookup (vpermps reads only the low 4 bits of an index) after a
   shift. A unit of work is one block's product for up to 16 rows, 4 at a time (its
   weights from memory once, from cache for the further rows). Sums are fp32, rounded
   to bf16 once.

   On CPUs with AMX, products of many rows (triollm_qgemm_amx) dequantize each pair of
   blocks into bf16 in gemm.c's layout, in a panel of the thread's own that stays in its
   cache, and multiply every row by it on AMX tiles (gemm_amx.h). */
#define _DEFAULT_SOURCE  /* syscall(), for the AMX permission */
#include "qgemm_common.h"

/* The AMX product where the build has no tiles (triollm_qgemm_amx_supported says so). */
#define QGEMM_AMX_STUBS                                                                 \
    int triollm_qgemm_amx_supported(void) { return 0; }                                \
    void triollm_qgemm_amx(const uint16_t* x, const void* w, const void* scales,        \
                           uint16_t* y, uint16_t* panels, int64_t m, int64_t n,         \
                           int64_t k, int64_t gsize, int threads) {                     \
        (void)x, (void)w, (void)scales, (void)y, (void)panels, (void)m, (void)n, (void)k, \
            (void)gsize, (void)threads;                                                 \
    }

#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MAX_ROWS 16
#define CHUNK 4

int triollm_qgemm_avx512_supported(void) { return 1; }

/* Octet o of a group (its weights at wg, its inputs at xg) into set t of the sums. */
static inline __attribute__((always_inline)) void q4_octet(
    const uint32_t* wg, const float* xg, __m512 acc[CHUNK][2][2], int64_t o,
    const int t, const int rows, int64_t k)
{
    const __m512i v = _mm512_loadu_si512(wg + 16 * o);
    _mm_prefetch((const char*)(wg + 16 * o) + 1024, _MM_HINT_T0);
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                         15);
    __m512 q[8];
    for (int i = 0; i < 8; i++)  /* vpermps reads an index's low 4 bits: the nibble */
        q[i] = _mm512_permutexvar_ps(i ? _mm512_srli_epi32(v, 4 * i) : v, values);
    for (int r = 0; r < rows; r++) {
        const float* x = xg + r * k + 8 * o;
        for (int i = 0; i < 8; i++)
            acc[r][t][i & 1] = _mm512_fmadd_ps(q[i], _mm512_set1_ps(x[i]),
                                               acc[r][t][i & 1]);
    }
}

/* Rows [0, rows) of xf (fp32, stride k) times int4 block w into out[rows]. xs: each
   row's input sum per group. Odd and even inputs sum apart, and at 1-2 rows odd and
   even octets too, so that no chain of FMAs is long enough to wait on. */
static inline __attribute__((always_inline)) void q4_tile(
    const float* xf, const float* xs, const uint32_t* w, const uint16_t* sz,
    __m512* out, const int rows, int64_t k, int64_t gsize)
{
    const int sets = rows <= 2 ? 2 : 1;
    const int64_t groups = k / gsize, octets = gsize / 8;
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[CHUNK][2][2];
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < sets; t++)
                acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
        const uint32_t* wg = w + g * octets * 16;
        const float* xg = xf + g * gsize;
        int64_t o = 0;
        for (; o + sets <= octets; o += sets)
            for (int t = 0; t < sets; t++) q4_octet(wg, xg, acc, o + t, t, rows, k);
        if (o < octets) q4_octet(wg, xg, acc, o, 0, rows, k);
        const uint16_t* p = sz + 32 * g;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 16)));
        for (int r = 0; r < rows; r++) {
            __m512 sum = _mm512_add_ps(acc[r][0][0], acc[r][0][1]);
            if (sets == 2)
                sum = _mm512_add_ps(sum, _mm512_add_ps(acc[r][1][0], acc[r][1][1]));
            out[r] = _mm512_fnmadd_ps(zero, _mm512_set1_ps(xs[r * groups + g]),
                                      _mm512_fmadd_ps(scale, sum, out[r]));
        }
    }
}

/* Rows [0, rows) of xf times int8 block w (scaled by s[16]) into out[rows]; inputs in
   4 chains at 1-2 rows, 2 from 3. */
static inline __attribute__((always_inline)) void q8_tile(
    const float* xf, const int8_t* w, const float* s, __m512* out, const int rows,
    int64_t k)
{
    const int chains = rows <= 2 ? 4 : 2;
    __m512 acc[CHUNK][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chains; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t p = 0;
#define Q8_INPUT(c)                                                                    \
    {                                                                                  \
        const __m512 q = _mm512_cvtepi32_ps(                                           \
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16 * p))));      \
        for (int r = 0; r < rows; r++)                                                 \
            acc[r][c] = _mm512_fmadd_ps(q, _mm512_set1_ps(xf[r * k + p]), acc[r][c]);  \
        p++;                                                                           \
    }
    for (; p + chains <= k;) {
        _mm_prefetch((const char*)(w + 16 * p) + 1024, _MM_HINT_T0);
        for (int c = 0; c < chains; c++) Q8_INPUT(c)
    }
    while (p < k) Q8_INPUT(0)
#undef Q8_INPUT
    const __m512 scale = _mm512_loadu_ps(s);
    for (int r = 0; r < rows; r++) {
        __m512 sum = acc[r][0];
        for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r][c]);
        out[r] = _mm512_mul_ps(scale, sum);
    }
}

/* One row's sums, rounded to bf16, into y. */
static inline void store_sums(uint16_t* y, const __m512* sums) {
    _mm256_storeu_si256((__m256i*)y, to_bf16(*sums));
}

QGEMM_PRODUCT_UNIT(__m512, 1)

QGEMM_ENTRY_POINTS(triollm_qgemm_avx512, qgemm_widened_bytes, qgemm_prepare_widened)

/* w[i] (i < 8): 16 outputs' fp32 weights of inputs c + i, as d[s]: dword j = output
   j's bf16 pair of inputs c + 2s, c + 2s + 1 (a 64-byte row of gemm.c's layout). */
static inline void pairs_of(const __m512 w[8], __m512i d[4]) {
#if defined(__AVX512BF16__)
    /* word 2j: the even input's output j (word j of the conversion), 2j + 1: the odd's */
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                            7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                                            13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_loadu_si512(interleave);
    for (int s = 0; s < 4; s++)
        d[s] = _mm512_permutexvar_epi16(
            order, (__m512i)_mm512_cvtne2ps_pbh(w[2 * s + 1], w[2 * s]));
#else
    for (int s = 0; s < 4; s++) {
        const __m512i even = _mm512_cvtepu16_epi32(to_bf16(w[2 * s]));
        const __m512i odd = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(to_bf16(w[2 * s + 1])), 16);
        d[s] = _mm512_or_si512(even, odd);
    }
#endif
}

/* w as pairs_of takes it, stored in gemm.c's layout: out is the block's [k/2][16][2]. */
static inline void store_pairs(uint16_t* out, int64_t c, const __m512 w[8]) {
    __m512i d[4];
    pairs_of(w, d);
    for (int s = 0; s < 4; s++)
        _mm512_storeu_si512(out + (c / 2 + s) * 32, d[s]);
}

/* w as pairs_of takes it, stored as rows j of out (bf16, stride k), 8 from column c. */
static inline void store_transposed(uint16_t* out, int64_t k, const __m512 w[8]) {
    const __m512i interleave = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                 6, 22, 7, 23);
    __m512i d[4];
    pairs_of(w, d);
    const __m512i pairs_hi = _mm512_add_epi32(interleave, _mm512_set1_epi32(8));
    const __m512i quads_lo = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21,
                                               6, 7, 22, 23);
    const __m512i quads_hi = _mm512_add_epi32(quads_lo, _mm512_set1_epi32(8));
    const __m512i a_lo = _mm512_permutex2var_epi32(d[0], interleave, d[1]);
    const __m512i a_hi = _mm512_permutex2var_epi32(d[0], pairs_hi, d[1]);
    const __m512i b_lo = _mm512_permutex2var_epi32(d[2], interleave, d[3]);
    const __m512i b_hi = _mm512_permutex2var_epi32(d[2], pairs_hi, d[3]);
    const __m512i rows[4] = {_mm512_permutex2var_epi32(a_lo, quads_lo, b_lo),
                             _mm512_permutex2var_epi32(a_lo, quads_hi, b_lo),
                             _mm512_permutex2var_epi32(a_hi, quads_lo, b_hi),
                             _mm512_permutex2var_epi32(a_hi, quads_hi, b_hi)};
    for (int i = 0; i < 4; i++) {
        uint16_t* row = out + 4 * i * k;
        _mm_storeu_si128((__m128i*)row, _mm512_castsi512_si128(rows[i]));
        _mm_storeu_si128((__m128i*)(row + k), _mm512_extracti32x4_epi32(rows[i], 1));
        _mm_storeu_si128((__m128i*)(row + 2 * k), _mm512_extracti32x4_epi32(rows[i], 2));
        _mm_storeu_si128((__m128i*)(row + 3 * k), _mm512_extracti32x4_epi32(rows[i], 3));
    }
}

/* Output block u of the weight, dequantized into block u - first of out (bf16, [16
   count][k] row-major, or with `pairs` gemm.c's [count][k/2][16][2]); k a multiple of 8. */
static void dequantize_block(const void* w, const void* scales, uint16_t* out,
                             int64_t u, int64_t first, int64_t k, int64_t gsize, int pairs) {
    uint16_t* rows = out + 16 * (u - first) * k;
    const __m512i nibble = _mm512_set1_epi32(0xF);
    if (gsize) {
        const uint32_t* wu = (const uint32_t*)w + u * 2 * k;
        const int64_t groups = k / gsize, octets = gsize / 8;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t* p = (const uint16_t*)scales + (u * groups + g) * 32;
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
            const __m512 zero = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i*)(p + 16)));
            for (int64_t o = g * octets; o < (g + 1) * octets; o++) {
                const __m512i v = _mm512_loadu_si512(wu + 16 * o);
                __m512 q[8];
                for (int i = 0; i < 8; i++)
                    q[i] = _mm512_fmsub_ps(scale, _mm512_cvtepi32_ps(_mm512_and_si512(
                        _mm512_srli_epi32(v, 4 * i), nibble)), zero);
                if (pairs) store_pairs(rows, 8 * o, q);
                else store_transposed(rows + 8 * o, k, q);
            }
        }
    } else {
        const int8_t* wu = (const int8_t*)w + u * 16 * k;
        const __m512 scale = _mm512_loadu_ps((const float*)scales + 16 * u);
        for (int64_t c = 0; c < k; c += 8) {
            __m512 q[8];
            for (int i = 0; i < 8; i++)
                q[i] = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i*)(wu + 16 * (c + i))))));
            if (pairs) store_pairs(rows, c, q);
            else store_transposed(rows + c, k, q);
        }
    }
}

/* Output blocks [first, first + count) of the weight (either layout, gsize 0: int8)
   dequantized into out: bf16 [16 count][k], row-major, as torch's linear takes it; k a
   multiple of 8. For many rows where the AMX product does not take the width. */
void triollm_qdequantize_avx512(const void* w, const void* scales, uint16_t* out,
                                int64_t first, int64_t count, int64_t k, int64_t gsize,
                                int threads)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = first; u < first + count; u++)
        dequantize_block(w, scales, out, u, first, k, gsize, 0);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>

#include "gemm_amx.h"

int triollm_qgemm_amx_supported(void) { return amx_usable(); }

/* bf16 y[m][n] = x[m][k] @ W^T for the weight in either layout (gsize 0: int8): each
   thread dequantizes a pair of output blocks at a time into its own panel of `panels`
   (threads panels of 32 k bf16, gemm.c's layout) and multiplies every row by it on the
   tiles; k a multiple of 32. */
void triollm_qgemm_amx(const uint16_t* x, const void* w, const void* scales, uint16_t* y,
                       uint16_t* panels, int64_t m, int64_t n, int64_t k, int64_t gsize,
                       int threads)
{
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        uint16_t* own = panels + omp_get_thread_num() * 32 * k;
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < pairs; u++) {
            const int64_t b = 2 * u;
            const int two = b + 1 < blocks;
            dequantize_block(w, scales, own, b, b, k, gsize, 1);
            if (two) dequantize_block(w, scales, own, b + 1, b, k, gsize, 1);
            for (int64_t m0 = 0; m0 < m; m0 += AMX_ROWS)
                amx_unit(x, own, two ? own + 16 * k : 0, 0, y, m0,
                         m - m0 < AMX_ROWS ? (int)(m - m0) : AMX_ROWS, n, k, 16 * b, 0, 0);
        }
        release_tiles();
    }
}
#else
QGEMM_AMX_STUBS
#endif

#else
QGEMM_STUBS(triollm_qgemm_avx512)
QGEMM_AMX_STUBS

/* never called either */
void triollm_qdequantize_avx512(const void* w, const void* scales, uint16_t* out,
                                int64_t first, int64_t count, int64_t k, int64_t gsize,
                                int threads) {
    (void)w, (void)scales, (void)out, (void)first, (void)count, (void)k, (void)gsize,
        (void)threads;
}
#endif
