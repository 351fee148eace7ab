/* The helper pool: see pool.h for its interface and model/cpu/helpers.py for its design. */
#define _GNU_SOURCE
#include "pool.h"

#include <stdlib.h>
#include <string.h>

static _Atomic int64_t pool_jobs, pool_helper_units, pool_retaken_units;
static _Thread_local int pool_spare_threads;

void triollm_pool_set_spare_threads(int helpers) { pool_spare_threads = helpers; }

int triollm_pool_spare_threads(void) { return pool_spare_threads; }

void triollm_pool_statistics(int64_t* counts) {
    counts[0] = atomic_load(&pool_jobs);
    counts[1] = atomic_load(&pool_helper_units);
    counts[2] = atomic_load(&pool_retaken_units);
}

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define POOL_MAX_HELPERS 32

static _Atomic(pool_job*) pool_current;
static _Atomic int pool_generation;      /* the helpers' futex word: bumped per job */
static _Atomic int pool_sleepers;        /* helpers in (or entering) a futex wait */
static _Atomic(pool_job*) pool_hazard[POOL_MAX_HELPERS];
static _Atomic int pool_wanted;          /* helpers [0, wanted) may join a job */
static _Atomic int pool_owned;           /* a caller is using the pool */
static _Atomic int pool_caller_cpu;      /* where the caller ran when it published */
static _Atomic int pool_helper_delay_us; /* tests: a helper's pause before each unit */
static int pool_spawned;
static cpu_set_t pool_allowed;           /* the process's CPUs when helpers were made */
static pool_job* pool_retired;           /* freed once no hazard points at them */

static long pool_futex(_Atomic int* word, int op, int value) {
    return syscall(SYS_futex, (int*)word, op, value, NULL, NULL, 0);
}

static void pool_take_units(pool_job* job, int helper) {
    for (;;) {
        const int64_t unit = helper ? atomic_fetch_sub(&job->last, 1)
                                    : atomic_fetch_add(&job->next, 1);
        if (unit < 0 || unit >= job->units) return;
        unsigned char expected = UNIT_FREE;
        /* Failing means the other end took this unit: every unit past it is taken. */
        if (!atomic_compare_exchange_strong(&job->state[unit], &expected,
                                            helper ? UNIT_HELPER : UNIT_CALLER))
            return;
        if (!helper) {
            job->run(job, unit, 0);
            continue;
        }
        const int delay = atomic_load(&pool_helper_delay_us);
        if (delay > 0) usleep((useconds_t)delay);
        job->run(job, unit, 1);
        if (atomic_load(&job->state[unit]) == UNIT_STORING) {
            atomic_store(&job->state[unit], UNIT_DONE);
            atomic_fetch_add_explicit(&pool_helper_units, 1, memory_order_relaxed);
        }
        if (atomic_load(&pool_current) != job) return;  /* the caller has finished */
    }
}

/* A helper woken on the caller's CPU would only take turns with it there: it moves to
   the process's other CPUs (which the caller may move to later; then it moves again). */
static void pool_leave_callers_cpu(void) {
    const int caller_cpu = atomic_load(&pool_caller_cpu);
    if (caller_cpu < 0 || sched_getcpu() != caller_cpu) return;
    cpu_set_t others = pool_allowed;
    CPU_CLR(caller_cpu, &others);
    if (CPU_COUNT(&others) > 0) pthread_setaffinity_np(pthread_self(), sizeof others, &others);
}

static void* pool_helper_main(void* arg) {
    const int me = (int)(intptr_t)arg;
    int seen = atomic_load(&pool_generation);
    for (;;) {
        const int generation = atomic_load(&pool_generation);
        if (generation == seen) {
            atomic_fetch_add(&pool_sleepers, 1);
            pool_futex(&pool_generation, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&pool_sleepers, 1);
            continue;
        }
        seen = generation;
        pool_job* job = atomic_load(&pool_current);
        if (job == NULL || me >= atomic_load(&pool_wanted)) continue;
        atomic_store(&pool_hazard[me], job);
        if (atomic_load(&pool_current) == job) {
            pool_leave_callers_cpu();
            pool_take_units(job, 1);
        }
        atomic_store(&pool_hazard[me], NULL);
    }
    return NULL;
}

static void pool_after_fork(void) {
    /* Only the forking thread lives on in the child: no helpers, nothing hazarded. */
    pool_spawned = 0;
    for (int i = 0; i < POOL_MAX_HELPERS; i++) atomic_store(&pool_hazard[i], NULL);
    atomic_store(&pool_current, NULL);
    atomic_store(&pool_sleepers, 0);
    atomic_store(&pool_owned, 0);
}

static int pool_spawn(int helpers) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    if (pool_spawned == 0 && sched_getaffinity(0, sizeof pool_allowed, &pool_allowed) != 0)
        return 0;
    while (pool_spawned < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, pool_helper_main,
                                          (void*)(intptr_t)pool_spawned);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_spawned++;
    }
    return pool_spawned;
}

static int pool_hazarded(const pool_job* job) {
    for (int i = 0; i < pool_spawned; i++)
        if (atomic_load(&pool_hazard[i]) == job) return 1;
    return 0;
}

static void pool_free_retired(void) {
    pool_job** link = &pool_retired;
    while (*link) {
        pool_job* job = *link;
        if (pool_hazarded(job)) {
            link = &job->retired_next;
        } else {
            *link = job->retired_next;
            free(job);
        }
    }
}

static void pool_run_alone(pool_job* job) {
    for (int64_t unit = 0; unit < job->units; unit++) job->run(job, unit, 0);
    free(job);
}

void triollm_pool_run(pool_job* job, int helpers) {
    for (int64_t unit = 0; unit < job->units; unit++) atomic_init(&job->state[unit], UNIT_FREE);
    atomic_init(&job->next, 0);
    atomic_init(&job->last, job->units - 1);
    job->retired_next = NULL;
    int expected = 0;
    if (helpers > POOL_MAX_HELPERS) helpers = POOL_MAX_HELPERS;
    if (helpers <= 0 || job->units < 2
            || !atomic_compare_exchange_strong(&pool_owned, &expected, 1)) {
        pool_run_alone(job);
        return;
    }
    const int spawned = pool_spawn(helpers);  /* may exceed `helpers`: an earlier call's */
    if (spawned < helpers) helpers = spawned;
    if (helpers == 0) {
        atomic_store(&pool_owned, 0);
        pool_run_alone(job);
        return;
    }
    pool_free_retired();
    atomic_store(&pool_wanted, helpers);
    atomic_store(&pool_caller_cpu, sched_getcpu());
    atomic_store(&pool_current, job);
    atomic_fetch_add(&pool_generation, 1);
    if (atomic_load(&pool_sleepers) > 0)
        pool_futex(&pool_generation, FUTEX_WAKE_PRIVATE, INT_MAX);
    pool_take_units(job, 0);
    atomic_store(&pool_current, NULL);
    /* Take back what is left: units no one began, and units helpers hold unstored. */
    for (int64_t unit = 0; unit < job->units; unit++) {
        for (int spins = 0;; spins++) {
            unsigned char state = atomic_load(&job->state[unit]);
            if (state == UNIT_DONE || state == UNIT_CALLER) break;
            if (state == UNIT_FREE || state == UNIT_HELPER) {
                if (atomic_compare_exchange_strong(&job->state[unit], &state, UNIT_CALLER)) {
                    if (state == UNIT_HELPER)
                        atomic_fetch_add_explicit(&pool_retaken_units, 1,
                                                  memory_order_relaxed);
                    job->run(job, unit, 0);
                    break;
                }
                continue;
            }
            if (spins > 64) sched_yield();  /* a helper is storing the unit: a few stores */
        }
    }
    atomic_fetch_add_explicit(&pool_jobs, 1, memory_order_relaxed);
    if (pool_hazarded(job)) {
        job->retired_next = pool_retired;
        pool_retired = job;
    } else {
        free(job);
    }
    atomic_store(&pool_owned, 0);
}

int triollm_pool_drain(void) {
    int expected = 0;
    while (!atomic_compare_exchange_weak(&pool_owned, &expected, 1)) {
        expected = 0;
        sched_yield();
    }
    for (int i = 0; i < pool_spawned; i++)
        while (atomic_load(&pool_hazard[i]) != NULL) sched_yield();
    pool_free_retired();
    const int spawned = pool_spawned;
    atomic_store(&pool_owned, 0);
    return spawned;
}

void triollm_pool_set_helper_delay(int microseconds) {
    atomic_store(&pool_helper_delay_us, microseconds);
}

int triollm_pool_busy(void) {
    int busy = 0;
    for (int i = 0; i < POOL_MAX_HELPERS; i++) busy += atomic_load(&pool_hazard[i]) != NULL;
    return busy;
}
#else
/* No helpers off Linux (the pool waits on a futex): every unit on the calling thread. */
void triollm_pool_run(pool_job* job, int helpers) {
    (void)helpers;
    for (int64_t unit = 0; unit < job->units; unit++) {
        atomic_init(&job->state[unit], UNIT_CALLER);
        job->run(job, unit, 0);
    }
    free(job);
}
int triollm_pool_drain(void) { return 0; }
void triollm_pool_set_helper_delay(int microseconds) { (void)microseconds; }
int triollm_pool_busy(void) { return 0; }
#endif
