"""Helper threads that give the C kernels a share of cores other processes keep busy.

When another process keeps a core busy, the thread policy (cpu_threads.py) computes on
one thread: every torch op and OpenMP region ends at a barrier, and a thread that shares
its core with a busy process gets a time slice only every few milliseconds, so each op
would wait for it. That leaves the busy core's spare time unused, though Linux would
give a thread that sleeps between short bursts of work a good share of it (its
scheduler runs a task woken after a sleep ahead of one that has been running).

The kernels in cpu_gemm.py and cpu_decode.py therefore have a second way to run in that
case, over the pool whose C source is ``POOL_SOURCE`` (compiled into each kernel's
library, so each library has its own pool). A call is a job of independent units (a
GEMM's output tiles, decode attention's (sequence, KV head) pairs):

- The calling thread publishes the job, wakes the helpers, and takes units one by one
  from the first up; helpers that get a time slice take them from the last down, and
  sleep (a futex) when they meet the caller. So each thread streams one contiguous run
  of weights, as under OpenMP's static schedule: taking turns from one counter (each
  thread's next unit a few blocks on from its last, and for a batch of more than one
  tile of rows the same weights as the other thread's) was 2-9% slower beside a busy
  neighbour.
- Nothing ever waits for a helper. A helper computes a unit in registers and scratch of
  its own, and claims the right to store it (``pool_commit``) only when it is done; the
  caller, once no unit is left to take, computes again every unit a helper holds but has
  not claimed to store, so a helper descheduled mid-unit costs that unit twice, not its
  time slice. Only the handful of stores after a claim are waited for.
- A helper may still be computing a unit the caller took back after the call returned.
  So it reads only the job (which copies the caller's small inputs, and is freed when no
  helper holds it: hazard pointers) and memory that outlives any call (weights, the KV
  cache: runners call ``drain_pools`` before freeing them).
- A helper woken on the caller's CPU would only take turns with it; it moves to the
  process's other CPUs.
- One caller at a time: a call that finds the pool in use by another thread (two engines
  in one process) computes alone.
- Helpers are made on a library's first call with helpers and live as long as the
  process, asleep when unused, like OpenMP's own threads. Off Linux there are none.

``set_spare_threads`` (called by the thread policy on the model thread) says how many
helpers the kernels called from that thread may use: ``0`` (the default, and whenever
torch computes on more than one thread) keeps the kernels on OpenMP with torch's thread
count.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

__all__ = ["POOL_SOURCE", "PooledFunction", "drain_pools", "register_pool",
           "set_spare_threads", "spare_threads"]

_local = threading.local()
_pools: dict[str, ctypes.CDLL] = {}
_pools_lock = threading.Lock()


def spare_threads() -> int:
    """How many helper threads the C kernels may use beside the calling thread (set per
    thread: each model thread has its own policy)."""
    count: int = getattr(_local, "count", 0)
    return count


def set_spare_threads(count: int) -> None:
    """Let the C kernels called from this thread use ``count`` helper threads (0: compute
    on OpenMP with torch's thread count instead)."""
    if count < 0:
        raise ValueError(f"spare thread count must be >= 0, got {count}")
    _local.count = count


def register_pool(library: ctypes.CDLL) -> None:
    """Note a kernel library built with ``POOL_SOURCE``, for ``drain_pools``."""
    library.triollm_pool_drain.restype = ctypes.c_int
    with _pools_lock:
        _pools[library._name] = library


class PooledFunction:
    """A kernel's C entry point ``name`` (OpenMP; last argument: its thread count) and its
    twin ``name + "_pooled"`` (last argument: helpers), both taking ``argtypes`` (the
    count included). Called without the count, it runs the twin when the calling thread
    may use helpers, else the OpenMP one with torch's thread count."""

    def __init__(self, library: ctypes.CDLL, name: str, argtypes: list[Any],
                 restype: Any) -> None:
        self._plain = getattr(library, name)
        self._pooled = getattr(library, name + "_pooled")
        for function in (self._plain, self._pooled):
            function.argtypes = argtypes
            function.restype = restype
        register_pool(library)

    def __call__(self, *args: Any) -> Any:
        helpers = spare_threads()
        if helpers:
            return self._pooled(*args, helpers)
        return self._plain(*args, torch.get_num_threads())


def drain_pools() -> None:
    """Wait until no helper of any kernel library still reads memory an earlier call
    pointed it at (weights, a KV cache): call it before freeing such memory."""
    with _pools_lock:
        libraries = list(_pools.values())
    for library in libraries:
        library.triollm_pool_drain()


#: C source of the helper pool: ``pool_job``, ``pool_run``, ``pool_commit`` and the
#: exported ``triollm_pool_drain`` / ``triollm_pool_statistics`` /
#: ``triollm_pool_set_helper_delay``; it must come first in a library's source (it
#: defines ``_GNU_SOURCE``).
POOL_SOURCE = r"""
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static _Atomic int64_t pool_jobs, pool_helper_units, pool_retaken_units;

/* Jobs run with helpers, units helpers stored, units the caller took back from them. */
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

/* Runs every unit of `job` (malloc'd, with `run` and `units` set and `state` pointing
   at `units` bytes; the pool frees it) on the calling thread and up to `helpers`
   helpers; returns once every unit's output is stored. */
static void pool_run(pool_job* job, int helpers) {
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

/* Waits until no helper is inside a job, then frees the retired jobs: after it, no
   helper reads memory that an earlier call pointed it at. Returns the helper count. */
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

/* Tests: make helpers pause this long after taking each unit, so the caller takes
   units back from them. */
void triollm_pool_set_helper_delay(int microseconds) {
    atomic_store(&pool_helper_delay_us, microseconds);
}
#else
/* No helpers off Linux (the pool waits on a futex): every unit on the calling thread. */
static void pool_run(pool_job* job, int helpers) {
    (void)helpers;
    for (int64_t unit = 0; unit < job->units; unit++) {
        atomic_init(&job->state[unit], UNIT_CALLER);
        job->run(job, unit, 0);
    }
    free(job);
}
int triollm_pool_drain(void) { return 0; }
void triollm_pool_set_helper_delay(int microseconds) { (void)microseconds; }
#endif
"""
