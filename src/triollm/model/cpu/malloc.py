"""glibc's malloc kept from handing a step's large buffers back to the kernel, up to a
bound.

A CPU step allocates and frees the same few large tensors every layer (a pooling step
of 2,048 tokens: 3-12 MB each). glibc serves an allocation above its mmap threshold
with a fresh ``mmap`` and returns free memory at the top of a heap above its trim
threshold, so each of those tensors comes back as new pages that fault in on first
touch (docs/benchmarks.md, Embeddings, has the cost measured).
The thresholds start dynamic, but raising one by hand turns the adjustment off, so both
are set together: allocations up to 32 MiB (the most ``mallopt`` accepts) come from the
heap, and up to 64 MiB of free memory at the top of each heap is kept for the next step.
Above that it goes back to the kernel: a client's large request (an 8 MB prompt
tokenized: hundreds of MB for a moment) would otherwise leave the process at its peak
for good (docs/benchmarks.md, Resident memory, has both measured).

It is process-wide, so it is done once, when a CPU model runner starts, and only on
glibc; ``TRIOLLM_KEEP_MALLOC=1`` leaves malloc's settings alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc's ``mallopt`` accepts on 64-bit systems.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the top of a heap is returned above this: more than a step's buffers.
TRIM_THRESHOLD = 64 * 1024 * 1024


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
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    logger.info("malloc: allocations up to %d MiB from the heap, up to %d MiB freed kept",
                MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
