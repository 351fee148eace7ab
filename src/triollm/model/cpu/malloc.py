"""glibc's malloc kept from handing a step's large buffers back to the kernel.

A CPU step allocates and frees the same few large tensors every layer (a pooling step
of 2,048 tokens: 3-12 MB each). glibc serves an allocation above its mmap threshold
with a fresh ``mmap`` and returns free memory at the top of a heap above its trim
threshold, so each of those tensors comes back as new pages that fault in on first
touch (docs/benchmarks.md, Embeddings, has the cost measured).
The thresholds start dynamic, but raising one by hand turns the adjustment off, so both
are set together: allocations up to 32 MiB (the most ``mallopt`` accepts) come from the
heap, and freed heap memory is kept for the next step. This is what tcmalloc or
jemalloc (vLLM's CPU docs preload tcmalloc) do by default; the price is that the
process keeps its peak heap rather than shrinking between bursts.

It is process-wide, so it is done once, when a CPU model runner starts, and only on
glibc; ``TRIOLLM_KEEP_MALLOC=1`` leaves malloc's settings alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache

__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc's ``mallopt`` accepts on 64-bit systems.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Freed memory is returned only above 2 GiB at the top of a heap (mallopt takes an int).
_TRIM_THRESHOLD = 2**31 - 1


@cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether they were set.
    False where the C library is not glibc or ``TRIOLLM_KEEP_MALLOC=1`` is set."""
    if os.environ.get("TRIOLLM_KEEP_MALLOC") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return False
    logger.info("malloc: allocations up to %d MiB from the heap, freed memory kept",
                MMAP_THRESHOLD >> 20)
    return True
