/* bf16 products on AMX tiles over a row-major weight [n][k], read in place: a tied LM
   head, whose weight is also the embedding table and so cannot be packed without a
   copy of its own (model/cpu/tied_head.py). The roles of gemm_amx.h are swapped: 16
   weight rows (64 bytes of each) are a tile's first operand, loaded with the row
   stride, and the inputs, transposed into pairs (16 pairs of up to 16 rows), the
   second; a sum tile is 16 outputs by up to 16 rows. A unit of work is 32 consecutive
   weight rows (one contiguous stretch of memory) for every row of inputs, 16 at a
   time; while it reads its first 16 rows of inputs it prefetches the next unit's rows.
   Included by gemm.c where the compiler targets AMX-BF16 and AVX512-BF16, after
   gemm_amx.h (its permission and tile state). */
#ifndef TRIOLLM_GEMM_ROWS_AMX_H
#define TRIOLLM_GEMM_ROWS_AMX_H

#include <stdlib.h>

/* Tiles 0, 1: sums (16 outputs by `columns` rows); 2, 3: weights (16 rows, 64 bytes);
   4: inputs (16 pairs by `columns` rows). Recorded in gemm_amx.h's configured_shape as
   -2 - columns, which its own shapes (>= 64) never equal. */
static inline void configure_row_tiles(int columns) {
    const int shape = -2 - columns;
    if (configured_shape == shape) return;
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 5; t++) {
        config.rows[t] = 16;
        config.colsb[t] = t == 2 || t == 3 ? 64 : (uint16_t)(4 * columns);
    }
    _tile_loadconfig(&config);
    configured_shape = shape;
}

/* Rows [16 b, 16 b + columns) of x [m][k] as the second operand for each step of 32
   inputs: pairs[i / 2][j][2] = x[16 b + j][i, i + 1]. */
static void transpose_inputs(const uint16_t* x, uint16_t* pairs, int64_t k, int64_t b,
                             int columns) {
    const uint32_t* rows = (const uint32_t*)(x + 16 * b * k);
    uint32_t* out = (uint32_t*)pairs;
    for (int64_t p = 0; p < k / 2; p++)
        for (int j = 0; j < columns; j++) out[p * columns + j] = rows[j * (k / 2) + p];
}

/* Weight rows [32 u, 32 u + 16 outputs) (and the next 16 where `both`) times every row
   of the transposed inputs, into y [m][n] plus bias. */
static void rows_unit(const uint16_t* pairs, const uint16_t* w, const float* bias,
                      uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t u, int both) {
    const uint16_t* w0 = w + 32 * u * k;
    const uint16_t* w1 = w0 + 16 * k;
    const uint16_t* next = w0 + 32 * k;  /* past the end: prefetches never fault */
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set1_epi32(16),
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    for (int64_t b = 0; b * 16 < m; b++) {
        const int columns = m - 16 * b < 16 ? (int)(m - 16 * b) : 16;
        const uint16_t* block = pairs + 16 * b * k;
        configure_row_tiles(columns);
        _tile_zero(0);
        if (both) _tile_zero(1);
        for (int64_t i = 0; i < k; i += 32) {
            if (b == 0)
                for (int r = 0; r < 32; r++)
                    _mm_prefetch((const char*)(next + r * k + i), _MM_HINT_T0);
            _tile_loadd(4, block + i * columns, 4 * columns);
            _tile_loadd(2, w0 + i, 2 * k);
            _tile_dpbf16ps(0, 2, 4);
            if (both) {
                _tile_loadd(3, w1 + i, 2 * k);
                _tile_dpbf16ps(1, 3, 4);
            }
        }
        float sums[2][256] __attribute__((aligned(64)));
        _tile_stored(0, sums[0], 64);
        if (both) _tile_stored(1, sums[1], 64);
        for (int half = 0; half < 1 + both; half++) {
            const int64_t column = 32 * u + 16 * half;
            for (int j = 0; j < columns; j++) {
                /* output o of row j is sums[half][16 o + j] */
                __m512 row = _mm512_i32gather_ps(lanes, sums[half] + j, 4);
                if (bias) row = _mm512_add_ps(row, _mm512_loadu_ps(bias + column));
                _mm256_storeu_si256((__m256i*)(y + (16 * b + j) * n + column),
                                    (__m256i)_mm512_cvtneps_pbh(row));
            }
        }
    }
}

/* y[m, n] = x[m, k] @ w^T (+ bias), bf16 in and out, w row-major [n][k]; k a multiple
   of 32 and n of 16. Returns 0, or 1 where the tiles are refused (nothing written) and
   2 where the transposed inputs found no memory. */
static int rows_gemm(const uint16_t* x, const uint16_t* w, const float* bias,
                     uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
    if (k % 32 || n % 16 || !amx_usable()) return 1;
    if (m == 0) return 0;
    uint16_t* pairs = (uint16_t*)malloc((size_t)(((m + 15) / 16) * 16 * k) * sizeof(uint16_t));
    if (pairs == NULL) return 2;
    for (int64_t b = 0; b * 16 < m; b++)
        transpose_inputs(x, pairs + 16 * b * k, k, b, m - 16 * b < 16 ? (int)(m - 16 * b) : 16);
    const int64_t units = (n + 31) / 32;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++)
            rows_unit(pairs, w, bias, y, m, n, k, u, 32 * u + 32 <= n);
        release_tiles();
    }
    free(pairs);
    return 0;
}

#endif
