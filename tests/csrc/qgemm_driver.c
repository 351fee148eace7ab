/* Drives an int4/int8 kernel (csrc/qgemm_avx2.c, or the one whose entry point
   -DQGEMM= names: csrc/qgemm_avx512.c's triollm_qgemm_avx512, csrc/qgemm_vnni.c's
   triollm_qgemm_vnni, whose int8 layout takes widths that are multiples of
   -DINT8_WIDTHS=8) for a sanitizer build
   (tests/test_kernel_sanitizers.py): each layout over partial and whole units of rows,
   on the pool with helpers that stall (so the caller takes units back) against the
   OpenMP entry point on one thread, and against a product known exactly. Exits 0
   when every answer is right (or the CPU lacks the kernel); the sanitizer reports the
   rest. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#ifndef QGEMM
#define QGEMM triollm_qgemm_avx2
#endif
#ifndef INT8_WIDTHS
#define INT8_WIDTHS 2
#endif
#define JOINED(a, b) a##b
#define NAMED(a, b) JOINED(a, b)

int NAMED(QGEMM, _supported)(void);
int QGEMM(const uint16_t*, const void*, const void*, uint16_t*, int64_t, int64_t, int64_t,
          int64_t, int);
int NAMED(QGEMM, _pooled)(const uint16_t*, const void*, const void*, uint16_t*, int64_t,
                          int64_t, int64_t, int64_t, int);

enum { BF16_ONE = 0x3F80, FP16_ONE = 0x3C00, FP16_EIGHT = 0x4800 };

/* m rows by n outputs of k inputs, int4 in groups of g (g == 0: int8); the weights
   all 7 after their zero point, the inputs all 1: every output is 7 k. */
static int check(int64_t m, int64_t n, int64_t k, int64_t g) {
    const size_t weight_bytes = g ? (size_t)(n * k / 2) : (size_t)(n * k);
    const size_t scale_bytes = g ? (size_t)(n * (k / g) * 4) : (size_t)(n * 4);
    uint16_t* x = malloc((size_t)(m * k) * 2);
    unsigned char* w = malloc(weight_bytes);
    unsigned char* s = malloc(scale_bytes);
    uint16_t* plain = malloc((size_t)(m * n) * 2);
    uint16_t* pooled = malloc((size_t)(m * n) * 2);
    for (int64_t i = 0; i < m * k; i++) x[i] = BF16_ONE;
    memset(w, g ? 0xFF : 7, weight_bytes);  /* int4: q = 15 with zero 8 */
    for (int64_t b = 0; g && b < n / 16 * (k / g); b++)
        for (int j = 0; j < 16; j++) {
            ((uint16_t*)s)[32 * b + j] = FP16_ONE;
            ((uint16_t*)s)[32 * b + 16 + j] = FP16_EIGHT;
        }
    for (int64_t j = 0; !g && j < n; j++) ((float*)s)[j] = 1.0f;
    int ok = QGEMM(x, w, s, plain, m, n, k, g, 1)
             && NAMED(QGEMM, _pooled)(x, w, s, pooled, m, n, k, g, 2);
    triollm_pool_drain();
    for (int64_t i = 0; ok && i < m * n; i++) {
        const uint32_t wide = (uint32_t)plain[i] << 16;
        float value;
        memcpy(&value, &wide, sizeof value);
        ok = value == (float)(7 * k) && plain[i] == pooled[i];
    }
    free(x), free(w), free(s), free(plain), free(pooled);
    return ok;
}

int main(void) {
    if (!NAMED(QGEMM, _supported)()) {
        printf("ok\n");
        return 0;
    }
    static const int64_t shapes[][4] = {
        {1, 16, 8, 8}, {3, 32, 24, 8}, {17, 48, 64, 32}, {37, 16, 128, 128},
        {5, 16, 30, 0}, {21, 32, 2, 0}, {16, 16, 34, 0}, {7, 32, 64, 0},
        {18, 16, 136, 0}, {2, 16, 1024, 0}};
    for (int delay = 0; delay <= 200; delay += 200) {
        triollm_pool_set_helper_delay(delay);
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            if ((shapes[i][3] || shapes[i][2] % INT8_WIDTHS == 0)
                && !check(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3])) {
                printf("wrong answer for shape %zu\n", i);
                return 1;
            }
    }
    printf("ok\n");
    return 0;
}
