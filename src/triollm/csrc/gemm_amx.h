/* bf16 products on AMX tiles over gemm.c's packed layout [out/16][in/2][16][2], which
   is already what a tile multiply reads as its second operand (16 rows of pairs, 64
   bytes each, for 16 outputs), so the weights are read in place. A unit of work is up
   to 32 rows by 32 outputs (two tiles of inputs, two of weights, four fp32 sums), over
   inputs a multiple of 32. Included where the compiler targets AMX-BF16 and
   AVX512-BF16: by gemm.c (bf16 weights) and qgemm_avx512.c (int4/int8 weights, each 32
   outputs dequantized into this layout first). */
#ifndef TRIOLLM_GEMM_AMX_H
#define TRIOLLM_GEMM_AMX_H

#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pool.h"

#define AMX_ROWS 32
/* How far ahead (elements: 4 KiB) a unit prefetches its weights. */
#define PREFETCH 2048

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands a process the tiles' state only once asked: 1 granted, -1 refused. */
static _Atomic int amx_permission;
/* The tile shape this thread configured (first and second row tile), -1: none. */
static __thread int configured_shape = -1;

static inline int amx_usable(void) {
    int state = atomic_load(&amx_permission);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&amx_permission, state);
    }
    return state == 1;
}

/* Tiles 0-3: sums (rows r0 by block 0, r0 by block 1, r1 by block 0, r1 by block 1);
   4, 5: inputs (r0 and r1 rows); 6, 7: the two blocks' weights. */
static inline void configure_tiles(int r0, int r1) {
    const int shape = r0 * 64 + r1;
    if (configured_shape == shape) return;
    tile_config config = {0};
    config.palette = 1;
    const uint8_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t];
        config.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&config);
    configured_shape = shape;
}

static inline void release_tiles(void) {
    if (configured_shape != -1) {
        _tile_release();
        configured_shape = -1;
    }
}

/* 16 outputs of `rows` rows (stride n), fp32 sums plus bias, rounded to bf16. */
static inline void tile_store(uint16_t* y, const float* sums, int rows, int64_t n,
                              const float* bias) {
    for (int r = 0; r < rows; r++) {
        __m512 row = _mm512_loadu_ps(sums + 16 * r);
        if (bias) row = _mm512_add_ps(row, _mm512_loadu_ps(bias));
        _mm256_storeu_si256((__m256i*)(y + r * n), (__m256i)_mm512_cvtneps_pbh(row));
    }
}

/* Rows [m0, m0 + rows) (rows <= 32) of y[., n] from column `column` on: x (bf16 [.][k])
   times the output blocks w0 and w1 (NULL: only w0), each [k/2][16][2]. A pool helper
   (job != NULL) stores only once pool_commit says the unit is still its own. */
static void amx_unit(const uint16_t* x, const uint16_t* w0, const uint16_t* w1,
                     const float* bias, uint16_t* y, int64_t m0, int rows, int64_t n,
                     int64_t k, int64_t column, pool_job* job, int64_t unit)
{
    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    const uint16_t* a0 = x + m0 * k;
    const uint16_t* a1 = a0 + 16 * k;
    const int64_t stride = 2 * k;
    configure_tiles(r0, r1);
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {  /* a tile configured with no rows is an invalid operand */
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t i = 0; i < k; i += 32) {  /* 16 pairs: 1 KiB of each block */
        for (int line = 0; line < 512; line += 32) {
            _mm_prefetch((const char*)(w0 + 16 * i + PREFETCH + line), _MM_HINT_T0);
            if (w1) _mm_prefetch((const char*)(w1 + 16 * i + PREFETCH + line), _MM_HINT_T0);
        }
        _tile_loadd(4, a0 + i, stride);
        _tile_loadd(6, w0 + 16 * i, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (w1) {
            _tile_loadd(7, w1 + 16 * i, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (r1) {
            _tile_loadd(5, a1 + i, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (w1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[4][256] __attribute__((aligned(64)));
    _tile_stored(0, sums[0], 64);
    if (w1) _tile_stored(1, sums[1], 64);
    if (r1) {
        _tile_stored(2, sums[2], 64);
        if (w1) _tile_stored(3, sums[3], 64);
    }
    if (job && !pool_commit(job, unit)) return;
    uint16_t* out = y + m0 * n + column;
    const float* bias1 = bias ? bias + column + 16 : 0;
    if (bias) bias += column;
    tile_store(out, sums[0], r0, n, bias);
    if (w1) tile_store(out + 16, sums[1], r0, n, bias1);
    if (r1) {
        tile_store(out + 16 * n, sums[2], r1, n, bias);
        if (w1) tile_store(out + 16 * n + 16, sums[3], r1, n, bias1);
    }
}

#endif
