/* Weight-only int4 and int8 products on integer dot products (AVX512-VNNI's vpdpbusd,
   64 byte products an instruction), over the AVX2 kernel's layouts
   (csrc/qgemm_avx2.c; model/quantization/vnni_kernels.py); an empty library on CPUs
   without AVX-512 F, BW, VL, VBMI and VNNI. int8 takes input widths that are multiples
   of 8 (int4's groups are already).

   The inputs (bf16) become integers once per call: each row's block of inputs
   (block_size: up to 128, inside one int4 group) is scaled by a power of two d that
   puts its largest magnitude in [2^13, 2^14), and rounded. So an input within seven
   binades of its block's largest stays exact, and none is off by more than 2^-14 of
   that largest, against bf16's own rounding of every input by up to 2^-9 of itself
   (a block whose largest is under 2^-112 counts as zeros; inputs past about 2^119 can
   overflow a block's fp32 terms into NaN).
   Each integer q = 256 h + l is split into two signed bytes (h in [-64, 64], l in
   [-128, 127]) and the weight's unsigned bytes are multiplied by both: 4 dot products
   of 4 bytes per output and row for 8 inputs, in int32, exact. A block's sums turn
   into fp32 once: y += s d (256 H + L) - s z d Q, where Q is the block's sum of q.

   - int4: a lane of 8 nibbles (inputs 8o..8o+7 of one output) is split by a mask and
     a shift into its even and odd inputs, one unsigned byte each; the inputs are
     prepared in that order.
   - int8: the signed weight of 4 inputs for 16 outputs (64 bytes) is transposed to
     4 bytes per output (vpermb) and offset by 128 into an unsigned byte; its zero
     term is 128 s.

   A unit of work is one block of 16 outputs for up to 16 rows, 4 at a time (int4 at
   one row: two octets at a time on two sets of accumulators, whose integer sums add up
   to the same bits, since one set's chain of vpdpbusd waits on its latency). Weights
   are prefetched AHEAD bytes ahead: at a byte or half a byte a weight the loop runs
   well ahead of memory, which a nearer prefetch left waiting (one decode token of a
   0.5B model's layers, docs/benchmarks.md). */
#include "qgemm_common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define MAX_ROWS 16
#define CHUNK 4
#define AHEAD 4096

int triollm_qgemm_vnni_supported(void) { return 1; }

/* Inputs sharing one scale: up to 128, dividing k and (int4) the group size. */
static inline int64_t block_size(int64_t k, int64_t gsize) {
    int64_t b = 128;
    while (b > 8 && (k % b || (gsize && gsize % b))) b /= 2;
    return b;
}

/* Bytes the prepared inputs take: 2 bytes an input, then a block's d and d Q. */
static size_t prepared_bytes(int64_t m, int64_t k, int64_t gsize) {
    return (size_t)(2 * m * k) + (size_t)(2 * m * (k / block_size(k, gsize))) * sizeof(float);
}

/* Each row's inputs: per octet 16 bytes, the high bytes of its first and second quad,
   then their low bytes (int4: inputs 0 2 4 6 and 1 3 5 7; int8: 0-3 and 4-7); a->xs: per
   row and block d and d Q. Into scratch (prepared_bytes of it). */
static void prepare_integers(const uint16_t* x, void* scratch, product* a) {
    const int64_t m = a->m, k = a->k, size = block_size(k, a->gsize), blocks = k / size;
    int8_t* xq = (int8_t*)scratch;
    float* terms = (float*)(xq + 2 * m * k);
    /* int4: input i of an octet goes to byte (i & 1) * 4 + i / 2 of its quads */
    static const int at4[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t* xb = x + r * k + b * size;
            __m512 v[8];  /* size <= 128 */
            __m512 largest = _mm512_setzero_ps();
            for (int64_t c = 0; c < size; c += 16) {
                const __mmask16 lanes = size - c >= 16 ? 0xFFFF
                                                      : (__mmask16)((1u << (size - c)) - 1);
                v[c / 16] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(lanes, xb + c)), 16));
                largest = _mm512_max_ps(largest, _mm512_abs_ps(v[c / 16]));
            }
            const float top = _mm512_reduce_max_ps(largest);
            int finite = 1;
            for (int64_t c = 0; c < size; c += 16)  /* max_ps drops NaNs */
                if (_mm512_cmp_ps_mask(v[c / 16], v[c / 16], _CMP_UNORD_Q)) finite = 0;
            float d = 0;
            if (!finite || !(top <= 3.4e38f)) d = NAN;
            else if (top >= 0x1p-112f) {  /* 1 / d stays a finite power of 2 */
                int e;
                frexpf(top, &e);  /* top in [2^(e-1), 2^e) */
                d = ldexpf(1.0f, e - 14);
            }
            int32_t q[128];
            if (d > 0) {
                const __m512 inverse = _mm512_set1_ps(1.0f / d);  /* exact: a power of 2 */
                for (int64_t c = 0; c < size; c += 16)
                    _mm512_storeu_si512(q + c, _mm512_cvtps_epi32(
                        _mm512_mul_ps(v[c / 16], inverse)));  /* to nearest, even */
            } else {
                memset(q, 0, sizeof q);
            }
            int32_t sum = 0;
            int8_t* out = xq + r * 2 * k + b * 2 * size;
            for (int64_t o = 0; o < size / 8; o++)
                for (int i = 0; i < 8; i++) {
                    const int32_t value = q[8 * o + i], h = (value + 128) >> 8;
                    const int at = a->gsize ? at4[i] : i;
                    out[16 * o + at] = (int8_t)h;
                    out[16 * o + 8 + at] = (int8_t)(value - 256 * h);
                    sum += value;
                }
            terms[(r * blocks + b) * 2] = d;
            terms[(r * blocks + b) * 2 + 1] = d * (float)sum;
        }
    a->xin = xq;
    a->xs = terms;
}

/* acc += a (unsigned bytes) . the 4 signed bytes at b, broadcast, in place: gcc's
   register allocation of the intrinsic copies every accumulator on each use (about
   twice the instructions), and a broadcast from memory is a load where one from a
   general register is two more uops on the vector ports. */
static inline __attribute__((always_inline)) __m512i dot(__m512i acc, __m512i a,
                                                         const int8_t* b) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t*)b));
    return acc;
}

/* acc[r]: the high and low bytes' dot products of the octet's first and second quads
   (w0, w1: 4 unsigned weight bytes per output each) for rows [0, rows). */
#define DOT_OCTET(w0, w1, at)                                                            \
    for (int r = 0; r < rows; r++) {                                                     \
        const int8_t* q = xq + r * 2 * k + (at);                                        \
        acc[r][0] = dot(acc[r][0], w0, q);                                               \
        acc[r][1] = dot(acc[r][1], w1, q + 4);                                           \
        acc[r][2] = dot(acc[r][2], w0, q + 8);                                           \
        acc[r][3] = dot(acc[r][3], w1, q + 12);                                          \
    }

/* Zeroes a block's accumulators for rows [0, rows). */
static inline __attribute__((always_inline)) void zero_accumulators(
    __m512i acc[CHUNK][4], const int rows)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
}

/* A block's integer sums for rows [0, rows) into out: scale and zero (16 outputs'
   fp32 scales and zero terms) with each row's d and d Q. */
static inline __attribute__((always_inline)) void add_block(
    __m512i acc[CHUNK][4], __m512* out, const float* terms, int64_t term_stride,
    __m512 scale, __m512 zero, const int rows)
{
    for (int r = 0; r < rows; r++) {
        const __m512i high = _mm512_add_epi32(acc[r][0], acc[r][1]);
        const __m512i low = _mm512_add_epi32(acc[r][2], acc[r][3]);
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(256.0f),
                                           _mm512_cvtepi32_ps(low));
        const float* t = terms + r * term_stride;
        out[r] = _mm512_fnmadd_ps(zero, _mm512_set1_ps(t[1]), _mm512_fmadd_ps(
            _mm512_mul_ps(scale, _mm512_set1_ps(t[0])), sum, out[r]));
    }
}

/* Rows [0, rows) of the prepared inputs (xq, terms) times int4 block w into out. */
static inline __attribute__((always_inline)) void q4_tile(
    const int8_t* xq, const float* terms, const uint32_t* w, const uint16_t* sz,
    __m512* out, const int rows, int64_t k, int64_t gsize)
{
    const int64_t size = block_size(k, gsize), blocks = k / size, octets = size / 8;
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[CHUNK][4];
        zero_accumulators(acc, rows);
        int64_t o = b * octets;
        if (rows == 1) {  /* a second set of chains for every other octet: one row's 4
                             chains alone wait on vpdpbusd's latency */
            __m512i* odd_acc = acc[1];
            for (int c = 0; c < 4; c++) odd_acc[c] = _mm512_setzero_si512();
            for (; o + 1 < (b + 1) * octets; o += 2) {
                const __m512i v0 = _mm512_loadu_si512(w + 16 * o);
                const __m512i v1 = _mm512_loadu_si512(w + 16 * o + 16);
                _mm_prefetch((const char*)(w + 16 * o) + AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char*)(w + 16 * o) + AHEAD + 64, _MM_HINT_T0);
                const __m512i even0 = _mm512_and_si512(v0, nibbles);
                const __m512i odd0 = _mm512_and_si512(_mm512_srli_epi32(v0, 4), nibbles);
                const __m512i even1 = _mm512_and_si512(v1, nibbles);
                const __m512i odd1 = _mm512_and_si512(_mm512_srli_epi32(v1, 4), nibbles);
                const int8_t* q = xq + 16 * o;
                acc[0][0] = dot(acc[0][0], even0, q);
                acc[0][1] = dot(acc[0][1], odd0, q + 4);
                acc[0][2] = dot(acc[0][2], even0, q + 8);
                acc[0][3] = dot(acc[0][3], odd0, q + 12);
                odd_acc[0] = dot(odd_acc[0], even1, q + 16);
                odd_acc[1] = dot(odd_acc[1], odd1, q + 20);
                odd_acc[2] = dot(odd_acc[2], even1, q + 24);
                odd_acc[3] = dot(odd_acc[3], odd1, q + 28);
            }
            for (int c = 0; c < 4; c++) acc[0][c] = _mm512_add_epi32(acc[0][c], odd_acc[c]);
        }
        for (; o < (b + 1) * octets; o++) {
            const __m512i v = _mm512_loadu_si512(w + 16 * o);
            _mm_prefetch((const char*)(w + 16 * o) + AHEAD, _MM_HINT_T0);
            const __m512i even = _mm512_and_si512(v, nibbles);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles);
            DOT_OCTET(even, odd, 16 * o)
        }
        const uint16_t* p = sz + 32 * (b * size / gsize);
        add_block(acc, out, terms + 2 * b, 2 * blocks,
                  _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)),
                  _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 16))), rows);
    }
}

/* Rows [0, rows) of the prepared inputs times int8 block w (scaled by s[16]) into out. */
static inline __attribute__((always_inline)) void q8_tile(
    const int8_t* xq, const float* terms, const int8_t* w, const float* s, __m512* out,
    const int rows, int64_t k)
{
    const int64_t size = block_size(k, 0), blocks = k / size, octets = size / 8;
    /* byte 4j + i of a quad: input i of output j, from byte 16 i + j */
    const __m512i transpose = _mm512_set_epi8(
        63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
        59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
        55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
        51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const __m512 scale = _mm512_loadu_ps(s);
    const __m512 zero = _mm512_mul_ps(scale, _mm512_set1_ps(128.0f));
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[CHUNK][4];
        zero_accumulators(acc, rows);
        for (int64_t o = b * octets; o < (b + 1) * octets; o++) {
            const int8_t* wo = w + 128 * o;
            _mm_prefetch((const char*)wo + AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)wo + AHEAD + 64, _MM_HINT_T0);
            const __m512i w0 = _mm512_xor_si512(
                _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(wo)), offset);
            const __m512i w1 = _mm512_xor_si512(
                _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(wo + 64)), offset);
            DOT_OCTET(w0, w1, 16 * o)
        }
        add_block(acc, out, terms + 2 * b, 2 * blocks, scale, zero, rows);
    }
}

/* The unit of work: rows [16 rb, 16 rb + 16) of output block u, CHUNK rows at a time;
   a helper stores only once pool_commit says so. */
static void product_unit(const product* a, int64_t unit, pool_job* job) {
    const int64_t row_blocks = (a->m + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t u = unit / row_blocks, first = unit % row_blocks * MAX_ROWS;
    const int64_t last = a->m < first + MAX_ROWS ? a->m : first + MAX_ROWS;
    const int64_t term_row = 2 * (a->k / block_size(a->k, a->gsize));
    __m512 out[MAX_ROWS];
    for (int64_t m0 = first; m0 < last; m0 += CHUNK) {
        const int rows = last - m0 < CHUNK ? (int)(last - m0) : CHUNK;
        const int8_t* xq = (const int8_t*)a->xin + m0 * 2 * a->k;
        const float* terms = a->xs + m0 * term_row;
        __m512* o = out + (m0 - first);
        if (a->gsize) {
            const int64_t groups = a->k / a->gsize;
            const uint32_t* w = (const uint32_t*)a->w + u * 2 * a->k;
            const uint16_t* sz = (const uint16_t*)a->scales + u * 32 * groups;
            switch (rows) {
            case 1: q4_tile(xq, terms, w, sz, o, 1, a->k, a->gsize); break;
            case 2: q4_tile(xq, terms, w, sz, o, 2, a->k, a->gsize); break;
            case 3: q4_tile(xq, terms, w, sz, o, 3, a->k, a->gsize); break;
            default: q4_tile(xq, terms, w, sz, o, CHUNK, a->k, a->gsize); break;
            }
        } else {
            const int8_t* w = (const int8_t*)a->w + u * 16 * a->k;
            const float* s = (const float*)a->scales + 16 * u;
            switch (rows) {
            case 1: q8_tile(xq, terms, w, s, o, 1, a->k); break;
            case 2: q8_tile(xq, terms, w, s, o, 2, a->k); break;
            case 3: q8_tile(xq, terms, w, s, o, 3, a->k); break;
            default: q8_tile(xq, terms, w, s, o, CHUNK, a->k); break;
            }
        }
    }
    if (job && !pool_commit(job, unit)) return;
    for (int64_t r = first; r < last; r++)
        _mm256_storeu_si256((__m256i*)(a->y + r * a->n + 16 * u), to_bf16(out[r - first]));
}

QGEMM_ENTRY_POINTS(triollm_qgemm_vnni, prepared_bytes, prepare_integers)

#else
QGEMM_STUBS(triollm_qgemm_vnni)
#endif
