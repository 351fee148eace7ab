/* Drives the helper pool and the decode kernel for a sanitizer build
   (tests/test_kernel_sanitizers.py): jobs with helpers, helpers that stall so the caller
   takes units back, two callers at once, drains; decode attention on the pool against
   its OpenMP entry point. Exits 0 when every answer is right; the sanitizer reports the
   rest. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

int triollm_paged_decode(const float*, const void*, const void*, const int64_t*,
                         const int64_t*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, float, int64_t, float, int, int);
int triollm_paged_decode_pooled(const float*, const void*, const void*, const int64_t*,
                                const int64_t*, float*, int64_t, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, float, int64_t, float, int, int);

enum { UNITS = 48, WIDTH = 64 };

typedef struct {
    pool_job base;
    const double* input;  /* the job's own copy */
    double* out;
} sum_job;

static double unit_value(const double* input, int64_t unit) {
    double total = 0.0;
    for (int i = 0; i < WIDTH; i++) total += input[(unit * 7 + i) % WIDTH] * (double)(i + 1);
    return total;
}

static void sum_unit(pool_job* base, int64_t unit, int helper) {
    sum_job* job = (sum_job*)base;
    const double value = unit_value(job->input, unit);
    if (helper && !pool_commit(base, unit)) return;
    job->out[unit] = value;
}

static void run_sum(const double* input, double* out, int helpers) {
    const size_t head = (sizeof(sum_job) + UNITS + 63) & ~(size_t)63;
    sum_job* job = malloc(head + sizeof(double) * WIDTH);
    if (job == NULL) abort();
    double* copy = (double*)((char*)job + head);
    memcpy(copy, input, sizeof(double) * WIDTH);
    job->base.run = sum_unit;
    job->base.units = UNITS;
    job->base.state = (_Atomic unsigned char*)(job + 1);
    job->input = copy;
    job->out = out;
    triollm_pool_run(&job->base, helpers);
}

static int check_sums(int rounds, int helpers, unsigned seed) {
    double input[WIDTH], out[UNITS];
    for (int round = 0; round < rounds; round++) {
        for (int i = 0; i < WIDTH; i++) input[i] = (double)((seed + (unsigned)(round * 31 + i)) % 97);
        memset(out, 0, sizeof out);
        run_sum(input, out, helpers);
        for (int64_t u = 0; u < UNITS; u++)
            if (out[u] != unit_value(input, u)) {
                fprintf(stderr, "round %d unit %lld: wrong sum\n", round, (long long)u);
                return 1;
            }
    }
    return 0;
}

static void* second_caller(void* arg) {
    (void)arg;
    return (void*)(intptr_t)check_sums(100, 2, 7);
}

/* A helper that stalls after taking a unit loses it to the caller; what it computes on
   waking must never be stored: the outputs, zeroed after each call, stay zero. */
static int check_stalled_helpers(void) {
    static double outs[20][UNITS];
    double input[WIDTH];
    for (int i = 0; i < WIDTH; i++) input[i] = (double)i;
    int64_t before[3], after[3];
    triollm_pool_statistics(before);
    triollm_pool_set_helper_delay(20000);
    for (int call = 0; call < 20; call++) {
        run_sum(input, outs[call], 2);
        for (int64_t u = 0; u < UNITS; u++)
            if (outs[call][u] != unit_value(input, u)) return 1;
        memset(outs[call], 0, sizeof outs[call]);
    }
    triollm_pool_set_helper_delay(0);
    triollm_pool_drain();
    if (triollm_pool_busy() != 0) return 1;
    for (int call = 0; call < 20; call++)
        for (int64_t u = 0; u < UNITS; u++)
            if (outs[call][u] != 0.0) {
                fprintf(stderr, "a helper stored a unit it had lost\n");
                return 1;
            }
    triollm_pool_statistics(after);
    if (after[0] <= before[0]) {
        fprintf(stderr, "no job ran with helpers\n");
        return 1;
    }
    return 0;
}

static int check_decode(void) {
    enum { BATCH = 5, KV = 2, GROUPS = 2, DIM = 64, BLOCKS = 16, BLOCK = 4, MAX = 6 };
    static float keys[KV * BLOCKS * BLOCK * DIM], values[KV * BLOCKS * BLOCK * DIM];
    static float query[BATCH * KV * GROUPS * DIM], plain[BATCH * KV * GROUPS * DIM],
        pooled[BATCH * KV * GROUPS * DIM];
    int64_t tables[BATCH * MAX], lens[BATCH] = {21, 3, 17, 1, 24};
    unsigned state = 1;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        state = state * 1103515245u + 12345u;
        keys[i] = (float)((state >> 16) % 200) / 100.0f - 1.0f;
        values[i] = (float)((state >> 8) % 200) / 100.0f - 1.0f;
    }
    for (size_t i = 0; i < sizeof query / sizeof query[0]; i++)
        query[i] = (float)(i % 13) / 13.0f - 0.5f;
    for (int b = 0; b < BATCH; b++)
        for (int j = 0; j < MAX; j++) tables[b * MAX + j] = (b * 3 + j * 5) % BLOCKS;
    for (int round = 0; round < 20; round++) {
        if (triollm_paged_decode(query, keys, values, tables, lens, plain, BATCH, KV * GROUPS,
                                 KV, BLOCKS, BLOCK, DIM, MAX, 0.125f, 0, 0.0f, 0, 1)
            || triollm_paged_decode_pooled(query, keys, values, tables, lens, pooled, BATCH,
                                           KV * GROUPS, KV, BLOCKS, BLOCK, DIM, MAX, 0.125f, 0,
                                           0.0f, 0, 2))
            return 1;
        if (memcmp(plain, pooled, sizeof plain) != 0) {
            fprintf(stderr, "decode on the pool differs\n");
            return 1;
        }
    }
    return 0;
}

int main(void) {
    if (check_sums(200, 2, 1)) return 1;
    pthread_t other;
    if (pthread_create(&other, NULL, second_caller, NULL)) return 1;
    const int mine = check_sums(100, 2, 3);
    void* theirs = NULL;
    pthread_join(other, &theirs);
    if (mine || theirs) return 1;
    if (check_stalled_helpers()) return 1;
    if (check_decode()) return 1;
    triollm_pool_drain();
    puts("ok");
    return 0;
}
