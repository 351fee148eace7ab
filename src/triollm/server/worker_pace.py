"""``WorkerPace``: a worker process's call slowed to its client's share of a core.

A long text's encoding or a request's own chat template takes a worker process seconds
of CPU, and on a small machine that core is the model's: while the worker runs, the
model computes on one core fewer (model/cpu/threads.py; beside an 8 MB text's encoding
a 0.5B model on two cores made 0.78x its tokens). Holding the answer afterwards
(client_budget.py) spaces such calls out, but each still runs as a burst that every
stream in flight feels.

So a call runs at full speed only while its client is within its allowance; past it,
the process is stopped and continued (``SIGSTOP``, ``SIGCONT``) so that it computes
``RUN_SECONDS`` at a time and the client's calls so paced use its share of one core in
all. Beside a busy neighbour paced to 5% of a core, the same model made 0.90-0.98x its
tokens (two runs), against 0.69-0.78x beside one at full speed. The CPU time a pace
spread out (measured from ``/proc``) is the client's payment already
(``RequestWork.paced_seconds``), not charged again when the answer starts; a call beside
one of the client's already paced is paced from its start.

The pacing is done by the thread that waits for the call's answer
(``TokenizerProcess.call``), between its waits: only the call's owner ever stops the
process, and it continues it before it reads the answer or gives up.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

from triollm.server.client_budget import ALLOWANCE_SECONDS, RequestWork
from triollm.server.tokenizer_process import cpu_seconds

__all__ = ["RUN_SECONDS", "CallAbandoned", "WorkerPace"]

#: How long a paced process computes between two stops: short enough that the model's
#: threads barely wait for the core it shares (2, 5 and 10 ms slices at 5% of a core
#: cost the model alike, within the runs' noise), long enough
#: that the process gets its share (in 2 ms slices a tokenizer process sometimes made
#: a twentieth of it: a resumed process takes a while to compute again).
RUN_SECONDS = 0.01
#: How often a wait that is not paced looks whether its caller gave up.
CHECK_SECONDS = 0.05
#: Calls paced at once beyond the worker pool; more keep their place in it.
MOST_PACED = 8
_CAN_STOP = sys.platform != "win32"


class CallAbandoned(Exception):
    """The caller gave up the call (its request was cancelled): the process is to end."""


class WorkerPace:
    """Paces worker-process calls to their clients' shares: a client's calls paced at
    once split its share between them. Thread-safe: each call is waited for (and paced)
    in its own worker thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Per client address, its calls being paced now.
        self._paced: Counter[str] = Counter()

    @property
    def paced_now(self) -> int:
        """Calls being paced now, of all clients."""
        with self._lock:
            return sum(self._paced.values())

    def wait(self, pid: int, answered: Callable[[float], bool], work: RequestWork | None,
             *, abandoned: threading.Event, on_paced: Callable[[], None] = lambda: None
             ) -> None:
        """Return once ``answered(timeout)`` (which waits up to ``timeout`` seconds) says
        process ``pid`` has started its answer, pacing the process meanwhile for
        ``work``'s client: at full speed for as much CPU as the client's allowance has
        left, then at its share. ``on_paced`` is called once when the pacing starts
        (unless ``MOST_PACED`` calls are paced already: the caller may then give up the
        call's place in its pool). Raises ``CallAbandoned`` once ``abandoned`` is set.
        The process is running whenever this returns or raises. Without a budget (or
        with one of a core or more), or where a process cannot be stopped, it only
        waits."""
        budget = None if work is None else work.budget
        if budget is None or budget.share >= 1.0 or not _CAN_STOP or work is None:
            _wait(answered, abandoned, float("inf"))
            return
        client = work.client
        with self._lock:  # a call beside one already paced has no allowance left
            free = (0.0 if self._paced[client] else
                    max(0.0, ALLOWANCE_SECONDS - budget.behind(client)) * budget.share)
        if _wait(answered, abandoned, free):
            return
        with self._lock:
            crowded = sum(self._paced.values()) >= MOST_PACED
            self._paced[client] += 1
        started = cpu_seconds(pid)
        try:
            if not crowded:
                on_paced()
            while True:
                with self._lock:
                    share = budget.share / self._paced[client]
                if not _signal(pid, signal.SIGSTOP):
                    return  # the process is gone: reading its answer says so
                try:
                    if _wait(answered, abandoned, RUN_SECONDS * (1 - share) / share):
                        return
                finally:
                    _signal(pid, signal.SIGCONT)
                if _wait(answered, abandoned, RUN_SECONDS):
                    return
        finally:
            # what the process computed while paced (its slices' CPU, not their length:
            # beside busy cores it gets less), paid for as it ran
            work.paced_seconds += max(0.0, cpu_seconds(pid) - started)
            with self._lock:
                self._paced[client] -= 1
                if not self._paced[client]:
                    del self._paced[client]


def _wait(answered: Callable[[float], bool], abandoned: threading.Event,
          seconds: float) -> bool:
    """Wait up to ``seconds`` for the answer (one the process started before it was
    stopped shows at once), looking every ``CHECK_SECONDS`` whether the call was
    abandoned; True once answered."""
    deadline = time.monotonic() + seconds
    while True:
        if abandoned.is_set():
            raise CallAbandoned
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if answered(min(left, CHECK_SECONDS)):
            return True


def _signal(pid: int, number: signal.Signals) -> bool:
    """Send ``number`` to ``pid``; False if the process is gone."""
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        return False
    return True
