"""How many intra-op threads the model thread computes with on CPU, decided at run time.

torch splits every op across its OpenMP threads, and each op ends at a barrier where all
of them wait for the slowest. When another process keeps one of those cores busy, the
thread that shares its core gets a time slice only every few milliseconds, and every op
waits for it: beside one busy-loop process a 2-thread engine on 2 cores runs several
times slower, where one thread on the free core loses only that core's share.

So by default (``cpu_threads=None``) the model thread measures, at most every
``WINDOW_SECONDS`` before a step, how many of the cores it may run on were kept busy by
other processes (``/proc/stat`` for those cores, minus this process's own CPU time), and
computes on the cores left: usable cores minus ``round(others)``, at least one and at
most what torch started with. Fewer
threads are taken at once; more only after two windows agree, so a brief burst next
door does not make it flap. While it computes on one thread, the C kernels take
helpers for the cores given up (model/cpu/helpers.py), which use those cores' spare time
without ever holding up a step. A fixed ``cpu_threads``, or ``OMP_NUM_THREADS`` in the
environment, turns this off. Where ``/proc`` cannot be read the count stays fixed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from triollm.model.cpu.helpers import set_spare_threads

__all__ = ["ComputeThreads", "CpuTimes", "read_cpu_times"]

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 0.25
#: Other processes' load (in cores) from which a core counts as taken; below it, a
#: core shared with a light, bursty neighbour still pays to compute on.
TAKEN_CORE = 0.5


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Busy seconds of a set of cores and of this process, at one instant."""

    cores_busy: float
    process: float
    wall: float


def read_cpu_times(cores: frozenset[int]) -> CpuTimes | None:
    """Busy time of ``cores`` (from ``/proc/stat``) and of this process, or None where
    ``/proc`` is not there (not Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if int(name[3:]) in cores:
                    # user nice system idle iowait irq softirq steal: all but idle/iowait.
                    fields = [int(value) for value in rest.split()[:8]]
                    busy += sum(fields) - fields[3] - fields[4]
        with open("/proc/self/stat") as stat:
            fields_self = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    process = int(fields_self[11]) + int(fields_self[12])
    return CpuTimes(busy / ticks, process / ticks, time.monotonic())


class ComputeThreads:
    """The model thread's intra-op thread count: fixed, or adapted to other processes.

    Call ``adjust()`` from the model thread before each step; it is cheap between
    windows and sets ``torch.set_num_threads`` only when the count changes."""

    def __init__(self, fixed: int | None, *,
                 read: Callable[[frozenset[int]], CpuTimes | None] = read_cpu_times,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._clock = clock
        self._set_threads = set_threads
        self._cores = frozenset(os.sched_getaffinity(0)) if hasattr(
            os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
        self.max_threads = fixed if fixed is not None else torch.get_num_threads()
        self.threads = self.max_threads
        self.adaptive = (fixed is None and "OMP_NUM_THREADS" not in os.environ
                         and self.max_threads > 1)
        self._last = read(self._cores) if self.adaptive else None
        if self._last is None:
            self.adaptive = False
        self._raise_votes = 0
        self._allowed = list(range(1, self.max_threads + 1))
        #: Other processes' load over the last window, in cores.
        self.others_cores = 0.0
        if fixed is not None:
            set_threads(fixed)
        set_spare_threads(0)  # this thread's kernels: on OpenMP until the count drops to 1

    def thread_counts(self) -> list[int]:
        """Every count ``adjust`` may set, fewest first."""
        return self._allowed if self.adaptive else [self.threads]

    def ladder(self) -> list[int]:
        """Powers of two and the most, of the counts ``adjust`` may set: few enough to
        compile a model for each (torch.compile specialises to the thread count)."""
        return [count for count in self.thread_counts()
                if count == self.max_threads or count & (count - 1) == 0]

    def keep_to(self, counts: list[int]) -> None:
        """From now on set only these counts (rounding down): those a model was compiled
        for. Call from the model thread: a count in use that is not among them is
        rounded down now."""
        self._allowed = sorted(set(counts) | {1})
        if self.threads not in self._allowed:
            self._change(max(count for count in self._allowed if count <= self.threads))

    def adjust(self) -> int:
        """Re-decide the thread count if a window has passed; returns the count."""
        if not self.adaptive or self._last is None:
            return self.threads
        # /proc is read only once a window has passed: reading it is not free.
        if self._clock() - self._last.wall < WINDOW_SECONDS:
            return self.threads
        now = self._read(self._cores)
        if now is None:
            return self.threads
        elapsed = now.wall - self._last.wall
        others = ((now.cores_busy - self._last.cores_busy)
                  - (now.process - self._last.process)) / elapsed
        self._last = now
        self.others_cores = max(0.0, others)
        taken = int(self.others_cores + (1 - TAKEN_CORE))
        target = max(1, min(self.max_threads, len(self._cores) - taken))
        target = max(count for count in self._allowed if count <= target)
        if target < self.threads:
            self._raise_votes = 0
            self._change(target)
        elif target > self.threads:
            self._raise_votes += 1
            if self._raise_votes >= 2:
                self._raise_votes = 0
                self._change(target)
        else:
            self._raise_votes = 0
        return self.threads

    def _change(self, threads: int) -> None:
        logger.info("other processes keep %.1f of %d cores busy: computing on %d thread%s",
                    self.others_cores, len(self._cores), threads, "" if threads == 1 else "s")
        self.threads = threads
        self._set_threads(threads)
        # On one thread the C kernels may use helpers on the cores given up (helpers.py).
        set_spare_threads(self.max_threads - 1 if threads == 1 else 0)

