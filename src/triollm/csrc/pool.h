/* The helper pool the kernels share (pool.c, built as its own library that every kernel
   library links, so a process has one pool). A call is a job of independent units: the
   calling thread takes them from the first up, helpers from the last down, and the caller
   never waits for a helper (model/cpu/helpers.py tells the whole design). */
#ifndef TRIOLLM_POOL_H
#define TRIOLLM_POOL_H

#include <stdatomic.h>
#include <stdint.h>

enum { UNIT_FREE = 0, UNIT_CALLER = 1, UNIT_HELPER = 2, UNIT_STORING = 3, UNIT_DONE = 4 };

typedef struct pool_job pool_job;
/* Computes `unit`. The caller (helper == 0) stores straight into the output; a helper
   computes first and stores only after pool_commit says the unit is still its own. */
typedef void (*pool_unit_fn)(pool_job* job, int64_t unit, int helper);

struct pool_job {
    pool_unit_fn run;
    int64_t units;
    _Atomic int64_t next;          /* the caller's next unit: it takes them upwards */
    _Atomic int64_t last;          /* the helpers' next unit: they take them downwards */
    _Atomic unsigned char* state;  /* one per unit, UNIT_* */
    pool_job* retired_next;
};

/* Whether the unit a helper computed is still its own to store (else the caller took
   it back); call it after computing, before the first store. */
static inline int pool_commit(pool_job* job, int64_t unit) {
    unsigned char expected = UNIT_HELPER;
    return atomic_compare_exchange_strong(&job->state[unit], &expected, UNIT_STORING);
}

/* Runs every unit of `job` (malloc'd, with `run` and `units` set and `state` pointing
   at `units` bytes; the pool frees it) on the calling thread and up to `helpers`
   helpers; returns once every unit's output is stored. */
void triollm_pool_run(pool_job* job, int helpers);

/* Waits until no helper is inside a job, then frees the retired jobs: after it, no
   helper reads memory that an earlier call pointed it at. Returns the helper count. */
int triollm_pool_drain(void);

/* The helpers the calling thread's kernels may use (0, the default: OpenMP), which
   helpers.py's set_spare_threads sets here too for callers in C (kernel_ops.cpp). */
void triollm_pool_set_spare_threads(int helpers);
int triollm_pool_spare_threads(void);

/* Jobs run with helpers, units helpers stored, units the caller took back from them. */
void triollm_pool_statistics(int64_t* counts);

/* Tests: make helpers pause this long after taking each unit, so the caller takes
   units back from them. */
void triollm_pool_set_helper_delay(int microseconds);

/* Tests: how many helpers are inside a job now (what a drain would wait for). */
int triollm_pool_busy(void);

#endif
