/* Weight-only int4 (groups of scales and zero points) and int8 (a scale per output)
   products for CPUs with AVX512-BF16 (model/quantization/avx512_kernels.py), on OpenMP
   or the helper pool; an empty library elsewhere.

   Both turn the integer weights into bf16 in registers and multiply them with
   vdpbf16ps, 16 outputs by a pair of bf16 inputs an instruction, the inputs used as
   they come (no fp32 copy). Layouts, per block of 16 outputs (n is a multiple of 16):
   - int4: uint16 [n/16][k/8][32]: in a step of 8 inputs 8o..8o+7, word 2j+t holds in
     its nibble s output j's input 8o+2s+t. A nibble q OR-ed into 0x4300 is the bf16 of
     128 + q, so a nibble costs one shift or none and one ternary-logic op per 32
     weights. Beside it fp16 [n/16][k/G][2][16]: each group's scale s and zero term
     s*z; with X the group's input sum, the group adds s * (acc - 128 X) - s*z * X.
   - int8: int8 [n/16][k/2][16][2], signed (pairs of inputs per output), widened to
     fp32 and narrowed to bf16 (exact: |q| <= 128); fp32 [n] scales.
   A unit of work is one block's product for up to 16 rows, 8 at a time (its weights
   from memory once, from cache for the further rows). Sums are fp32, rounded to bf16
   once. */
#include "pool.h"

#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MAX_ROWS 16
#define CHUNK 8
#define CHAINS 4

int triollm_qgemm_avx512_supported(void) { return 1; }

static inline __m512bh pair_at(const uint16_t* x) {
    return (__m512bh)_mm512_set1_epi32(*(const int32_t*)x);
}

/* Sums per row: 4 dependency chains at 1-2 rows, 2 at 3-4, 1 from 5 (the rows are
   chains enough), so that vdpbf16ps's latency never bounds a tile. */
#define CHAINS_FOR(rows) ((rows) <= 2 ? 4 : (rows) <= 4 ? 2 : 1)

/* Rows [0, rows) of x (bf16, stride k) times int4 block w into out[rows]. xs: each
   row's input sum per group. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint16_t* x, const float* xs, const uint16_t* w, const uint16_t* sz,
    __m512* out, const int rows, int64_t k, int64_t gsize)
{
    const int chains = CHAINS_FOR(rows);
    const int64_t groups = k / gsize, steps = gsize / 8;
    const __m512i nibble = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
    const __m512 offset = _mm512_set1_ps(128.0f);
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[CHUNK][CHAINS];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < chains; c++) acc[r][c] = _mm512_setzero_ps();
        const uint16_t* wg = w + g * steps * 32;
        const uint16_t* xg = x + g * gsize;
        for (int64_t o = 0; o < steps; o++) {
            const __m512i v = _mm512_loadu_si512(wg + 32 * o);
            _mm_prefetch((const char*)(wg + 32 * o) + 1024, _MM_HINT_T0);
            /* (A & B) | C: a nibble into the low bits of 0x4300 */
            const __m512bh q[4] = {
                (__m512bh)_mm512_ternarylogic_epi32(v, nibble, magic, 0xEA),
                (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, magic,
                                                    0xEA),
                (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), nibble, magic,
                                                    0xEA),
                (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), magic)};
            for (int r = 0; r < rows; r++) {
                const uint16_t* xr = xg + r * k + 8 * o;
                for (int s = 0; s < 4; s++)
                    acc[r][s % chains] = _mm512_dpbf16_ps(acc[r][s % chains],
                                                          pair_at(xr + 2 * s), q[s]);
            }
        }
        const uint16_t* p = sz + 32 * g;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 16)));
        for (int r = 0; r < rows; r++) {
            __m512 sum = acc[r][0];
            for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r][c]);
            const __m512 total = _mm512_set1_ps(xs[r * groups + g]);
            sum = _mm512_fnmadd_ps(offset, total, sum);
            out[r] = _mm512_fnmadd_ps(zero, total, _mm512_fmadd_ps(scale, sum, out[r]));
        }
    }
}

/* Input pair p (x at it) times int8 block w (at it) into chain c of each row's sums. */
static inline __attribute__((always_inline)) void q8_pair(
    const uint16_t* x, const int8_t* w, __m512 acc[CHUNK][CHAINS], const int c,
    const int rows, int64_t k)
{
    _mm_prefetch((const char*)w + 1024, _MM_HINT_T0);
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
    const __m512bh q = _mm512_cvtne2ps_pbh(hi, lo);
    for (int r = 0; r < rows; r++)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair_at(x + r * k), q);
}

/* Rows [0, rows) of x times int8 block w (scaled by s[16]) into out[rows]. */
static inline __attribute__((always_inline)) void q8_tile(
    const uint16_t* x, const int8_t* w, const float* s, __m512* out, const int rows,
    int64_t k)
{
    const int chains = CHAINS_FOR(rows);
    __m512 acc[CHUNK][CHAINS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chains; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    int64_t p = 0;
    for (; p + chains <= pairs; p += chains)
        for (int c = 0; c < chains; c++)
            q8_pair(x + 2 * (p + c), w + 32 * (p + c), acc, c, rows, k);
    for (; p < pairs; p++) q8_pair(x + 2 * p, w + 32 * p, acc, 0, rows, k);
    const __m512 scale = _mm512_loadu_ps(s);
    for (int r = 0; r < rows; r++) {
        __m512 sum = acc[r][0];
        for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r][c]);
        out[r] = _mm512_mul_ps(scale, sum);
    }
}

/* The product's arguments, as the plain call and the pooled job both hold them. */
typedef struct {
    const uint16_t* x;     /* [m][k] bf16 inputs */
    const float* xs;       /* int4: [m][k/gsize] input sums per group */
    const void* w;         /* the packed weight */
    const void* scales;    /* int4: fp16 scales and zero terms; int8: fp32 scales */
    uint16_t* y;           /* [m][n] bf16 */
    int64_t m, n, k, gsize; /* gsize 0: int8 */
} product;

#define TILE_CASES(call)                                                              \
    switch (rows) {                                                                   \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;           \
    case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;           \
    case 7: call(7); break; default: call(CHUNK); break;                              \
    }

/* Rows [16 rb, 16 rb + 16) of output block u (a unit); a helper stores only once
   pool_commit says so. */
static void product_unit(const product* a, int64_t unit, pool_job* job) {
    const int64_t blocks = (a->m + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t u = unit / blocks, first = unit % blocks * MAX_ROWS;
    const int64_t last = a->m < first + MAX_ROWS ? a->m : first + MAX_ROWS;
    __m512 out[MAX_ROWS];
    for (int64_t m0 = first; m0 < last; m0 += CHUNK) {
        const int rows = last - m0 < CHUNK ? (int)(last - m0) : CHUNK;
        __m512* o = out + (m0 - first);
        const uint16_t* x = a->x + m0 * a->k;
        if (a->gsize) {
            const int64_t groups = a->k / a->gsize;
            const uint16_t* w = (const uint16_t*)a->w + u * 4 * a->k;
            const uint16_t* sz = (const uint16_t*)a->scales + u * 32 * groups;
            const float* xs = a->xs + m0 * groups;
#define Q4(R) q4_tile(x, xs, w, sz, o, R, a->k, a->gsize)
            TILE_CASES(Q4)
#undef Q4
        } else {
            const int8_t* w = (const int8_t*)a->w + u * 16 * a->k;
            const float* s = (const float*)a->scales + 16 * u;
#define Q8(R) q8_tile(x, w, s, o, R, a->k)
            TILE_CASES(Q8)
#undef Q8
        }
    }
    if (job && !pool_commit(job, unit)) return;
    for (int64_t r = first; r < last; r++)
        _mm256_storeu_si256((__m256i*)(a->y + r * a->n + 16 * u),
                            (__m256i)_mm512_cvtneps_pbh(out[r - first]));
}

static int64_t units_of(int64_t m, int64_t n) {
    return n / 16 * ((m + MAX_ROWS - 1) / MAX_ROWS);
}

/* Each row's input sum per group of gsize (int4) into xs. */
static void group_sums(const uint16_t* x, float* xs, int64_t m, int64_t k, int64_t gsize) {
    const int64_t groups = k / gsize;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0;
            for (int64_t i = 0; i < gsize; i++) {
                const uint32_t bits = (uint32_t)x[r * k + g * gsize + i] << 16;
                float value;
                memcpy(&value, &bits, sizeof value);
                sum += value;
            }
            xs[r * groups + g] = sum;
        }
}

/* y[m, n] = x[m, k] @ W^T, bf16 in and out; gsize: the int4 group size (a multiple
   of 8 dividing k), 0 for int8 (k even). Returns 0 where memory for the group sums
   ran out. */
int triollm_qgemm_avx512(const uint16_t* x, const void* w, const void* scales, uint16_t* y,
                         int64_t m, int64_t n, int64_t k, int64_t gsize, int threads)
{
    float* xs = NULL;
    if (gsize) {
        xs = (float*)malloc((size_t)(m * (k / gsize)) * sizeof(float));
        if (xs == NULL) return 0;
        group_sums(x, xs, m, k, gsize);
    }
    const product a = {x, xs, w, scales, y, m, n, k, gsize};
    const int64_t units = units_of(m, n);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t unit = 0; unit < units; unit++) product_unit(&a, unit, NULL);
    free(xs);
    return 1;
}

typedef struct {
    pool_job base;
    product a;  /* its x and xs point into the job: a helper may read them later */
} product_job;

static void product_job_unit(pool_job* base, int64_t unit, int helper) {
    product_unit(&((product_job*)base)->a, unit, helper ? base : NULL);
}

/* triollm_qgemm_avx512 on the calling thread and up to `helpers` pool helpers; `w` and
   `scales` must outlive the pool's next drain. */
int triollm_qgemm_avx512_pooled(const uint16_t* x, const void* w, const void* scales,
                                uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t gsize,
                                int helpers)
{
    const int64_t units = units_of(m, n), sums = gsize ? m * (k / gsize) : 0;
    const size_t head = (sizeof(product_job) + (size_t)units + 63) & ~(size_t)63;
    product_job* job = (product_job*)malloc(
        head + (size_t)sums * sizeof(float) + (size_t)(m * k) * sizeof(uint16_t));
    if (job == NULL) return triollm_qgemm_avx512(x, w, scales, y, m, n, k, gsize, 1);
    job->base.run = product_job_unit;
    job->base.units = units;
    job->base.state = (_Atomic unsigned char*)(job + 1);
    float* xs = (float*)((char*)job + head);
    uint16_t* copy = (uint16_t*)(xs + sums);
    memcpy(copy, x, (size_t)(m * k) * sizeof(uint16_t));
    if (gsize) group_sums(copy, xs, m, k, gsize);
    const product a = {copy, gsize ? xs : NULL, w, scales, y, m, n, k, gsize};
    job->a = a;
    triollm_pool_run(&job->base, helpers);
    return 1;
}

/* d[s][j]: output j's bf16 pair of inputs c + 2s, c + 2s + 1, for s < 4 and j < 16;
   stored as rows j of out (stride k), 8 bf16 from column c. */
static inline void store_transposed(uint16_t* out, int64_t k, const __m512i d[4]) {
    const __m512i pairs_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                               6, 22, 7, 23);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512i quads_lo = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21,
                                               6, 7, 22, 23);
    const __m512i quads_hi = _mm512_add_epi32(quads_lo, _mm512_set1_epi32(8));
    const __m512i a_lo = _mm512_permutex2var_epi32(d[0], pairs_lo, d[1]);
    const __m512i a_hi = _mm512_permutex2var_epi32(d[0], pairs_hi, d[1]);
    const __m512i b_lo = _mm512_permutex2var_epi32(d[2], pairs_lo, d[3]);
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

/* 32 fp32 weights (16 outputs j by a pair t, element 2j + t) scaled by their output's
   scale, minus its zero term (NULL: none), as 32 bf16. */
static inline __m512i scaled_pairs(__m512 lo, __m512 hi, __m512 scale, const __m512* zero) {
    const __m512i each_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6,
                                              7, 7);
    const __m512i each_hi = _mm512_add_epi32(each_lo, _mm512_set1_epi32(8));
    const __m512 s_lo = _mm512_permutexvar_ps(each_lo, scale);
    const __m512 s_hi = _mm512_permutexvar_ps(each_hi, scale);
    if (zero) {
        lo = _mm512_fmsub_ps(s_lo, lo, _mm512_permutexvar_ps(each_lo, *zero));
        hi = _mm512_fmsub_ps(s_hi, hi, _mm512_permutexvar_ps(each_hi, *zero));
    } else {
        lo = _mm512_mul_ps(s_lo, lo);
        hi = _mm512_mul_ps(s_hi, hi);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Output block u of the weight, dequantized into rows [16 u, 16 u + 16) of out (bf16,
   [n][k]); k a multiple of 8. */
static void dequantize_block(const void* w, const void* scales, uint16_t* out,
                             int64_t u, int64_t k, int64_t gsize) {
    uint16_t* rows = out + 16 * u * k;
    if (gsize) {
        const uint16_t* wu = (const uint16_t*)w + u * 4 * k;
        const int64_t groups = k / gsize, steps = gsize / 8;
        const __m512i nibble = _mm512_set1_epi16(0x000F);
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t* p = (const uint16_t*)scales + (u * groups + g) * 32;
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
            const __m512 zero = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i*)(p + 16)));
            for (int64_t o = g * steps; o < (g + 1) * steps; o++) {
                const __m512i v = _mm512_loadu_si512(wu + 32 * o);
                __m512i d[4];
                for (int s = 0; s < 4; s++) {
                    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 4 * s), nibble);
                    const __m256i lo = _mm512_castsi512_si256(q);
                    const __m256i hi = _mm512_extracti64x4_epi64(q, 1);
                    d[s] = scaled_pairs(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(lo)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(hi)),
                                        scale, &zero);
                }
                store_transposed(rows + 8 * o, k, d);
            }
        }
    } else {
        const int8_t* wu = (const int8_t*)w + u * 16 * k;
        const __m512 scale = _mm512_loadu_ps((const float*)scales + 16 * u);
        for (int64_t c = 0; c < k; c += 8) {
            __m512i d[4];
            for (int s = 0; s < 4; s++) {
                const int8_t* wp = wu + 16 * (c + 2 * s);
                d[s] = scaled_pairs(
                    _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)wp))),
                    _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wp + 16)))),
                    scale, NULL);
            }
            store_transposed(rows + c, k, d);
        }
    }
}

/* Output blocks [first, first + count) of the weight (either layout, gsize 0: int8)
   dequantized into out: bf16 [16 count][k], row-major, as torch's linear takes it; k a
   multiple of 8. For many rows, where a bf16 GEMM (oneDNN's, on AMX) outruns
   unpacking the weight once per 8 rows. */
void triollm_qdequantize_avx512(const void* w, const void* scales, uint16_t* out,
                                int64_t first, int64_t count, int64_t k, int64_t gsize,
                                int threads)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = first; u < first + count; u++)
        dequantize_block(w, scales, out - 16 * first * k, u, k, gsize);
}

#else
/* Stubs with the same signatures, never called (triollm_qgemm_avx512_supported says
   so). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
int triollm_qgemm_avx512_supported(void) { return 0; }
int triollm_qgemm_avx512(const uint16_t* x, const void* w, const void* scales, uint16_t* y,
                         int64_t m, int64_t n, int64_t k, int64_t gsize, int threads) {
    return 0;
}
int triollm_qgemm_avx512_pooled(const uint16_t* x, const void* w, const void* scales,
                                uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t gsize,
                                int helpers) {
    return 0;
}
void triollm_qdequantize_avx512(const void* w, const void* scales, uint16_t* out,
                                int64_t first, int64_t count, int64_t k, int64_t gsize,
                                int threads) {}
#pragma GCC diagnostic pop
#endif
