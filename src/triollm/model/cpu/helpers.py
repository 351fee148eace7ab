"""Helper threads that give the C kernels a share of cores other processes keep busy.

When another process keeps a core busy, the thread policy (threads.py) computes on
one thread: every torch op and OpenMP region ends at a barrier, and a thread that shares
its core with a busy process gets a time slice only every few milliseconds, so each op
would wait for it. That leaves the busy core's spare time unused, though Linux would
give a thread that sleeps between short bursts of work a good share of it (its
scheduler runs a task woken after a sleep ahead of one that has been running).

The kernels in gemm.py and decode.py therefore have a second way to run in that case,
over one helper pool (``csrc/pool.c``, a library of its own that every pooled kernel
library links, build.py). A call is a job of independent units (a GEMM's output tiles,
decode attention's (sequence, KV head) pairs):

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
- Helpers are made on the pool's first call with helpers and live as long as the
  process, asleep when unused, like OpenMP's own threads. Off Linux there are none.

``set_spare_threads`` (called by the thread policy on the model thread) says how many
helpers the kernels called from that thread may use: ``0`` (the default, and whenever
torch computes on more than one thread) keeps the kernels on OpenMP with torch's thread
count.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from typing import Any

import torch

from triollm.model.cpu.build import KernelBuildError, load_pool

__all__ = ["PooledFunction", "drain_pools", "set_spare_threads", "spare_threads"]

logger = logging.getLogger(__name__)

_local = threading.local()
#: The pool's ``triollm_pool_drain``, once a kernel that may use the pool has loaded.
_drain: Any = None
#: The pool failed to build (no C compiler): its spare-thread count is not set.
_no_pool = False


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
    # the pool's copy, which kernels called from C++ (kernel_ops.py) read: its default
    # is 0 too, so a count of 0 needs no pool (any C kernel has built it already)
    global _no_pool
    if (count or load_pool.cache_info().currsize) and not _no_pool:
        try:
            load_pool().triollm_pool_set_spare_threads(count)
        except (OSError, subprocess.SubprocessError, KernelBuildError) as error:
            _no_pool = True  # nor any pooled kernel, then: not tried again
            logger.warning("the helper pool did not build (%s); kernels compute on one "
                           "thread", error)


def _use_pool() -> None:
    """Note that kernels on the pool (``build.load_pool``: one per process) may run, for
    ``drain_pools``."""
    global _drain
    if _drain is None:
        drain = load_pool().triollm_pool_drain
        drain.restype = ctypes.c_int
        _drain = drain


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
        _use_pool()

    def entry_points(self) -> tuple[Any, Any]:
        """The ctypes functions: the OpenMP one and its pooled twin."""
        return self._plain, self._pooled

    def __call__(self, *args: Any) -> Any:
        helpers = spare_threads()
        if helpers:
            return self._pooled(*args, helpers)
        return self._plain(*args, torch.get_num_threads())


def drain_pools() -> None:
    """Wait until no helper still reads memory an earlier call pointed it at (weights, a
    KV cache): call it before freeing such memory."""
    if _drain is not None:
        _drain()
