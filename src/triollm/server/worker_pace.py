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
spread out is the client's payment already (``RequestWork.paced_seconds``), not charged
again when the answer starts. A pace that ends (the call answered, or cancelled) leaves
its process running.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable

import anyio

from triollm.server.client_budget import ALLOWANCE_SECONDS, RequestWork

__all__ = ["RUN_SECONDS", "WorkerPace"]

#: How long a paced process computes between two stops: short enough that the model's
#: threads barely wait for the core it shares (2, 5 and 10 ms slices at 5% of a core
#: cost the model alike, within the runs' noise), long enough
#: that the process gets its share (in 2 ms slices a tokenizer process sometimes made
#: a twentieth of it: a resumed process takes a while to compute again).
RUN_SECONDS = 0.01
#: Calls paced at once beyond the worker pool; more keep their place in it.
MOST_PACED = 8
_CAN_STOP = sys.platform != "win32"


class WorkerPace:
    """Paces worker-process calls (one ``pace`` task per call) to their clients' shares:
    a client's calls paced at once split its share between them."""

    def __init__(self) -> None:
        #: Per client address, its calls being paced now.
        self._paced: Counter[str] = Counter()

    @property
    def paced_now(self) -> int:
        """Calls being paced now, of all clients."""
        return sum(self._paced.values())

    async def pace(self, pid: int, work: RequestWork | None,
                   on_paced: Callable[[], None] = lambda: None) -> None:
        """Pace process ``pid``'s call for ``work``'s client until cancelled: at full
        speed for as much CPU as the client's allowance has left, then at its share.
        ``on_paced`` is called once, when the pacing starts (unless ``MOST_PACED`` calls
        are paced already: the caller may then give up the call's place in its pool).
        Returns at once outside a request, without a budget (or with one of a core or
        more), or where a process cannot be stopped."""
        if work is None or work.budget is None or work.budget.share >= 1.0 or not _CAN_STOP:
            return
        budget, client = work.budget, work.client
        await anyio.sleep(max(0.0, ALLOWANCE_SECONDS - budget.behind(client)) * budget.share)
        if self.paced_now < MOST_PACED:
            on_paced()
        self._paced[client] += 1
        stopped = False
        try:
            while True:
                share = budget.share / self._paced[client]
                stopped = _signal(pid, signal.SIGSTOP)
                if not stopped:
                    return  # the process is gone
                await anyio.sleep(RUN_SECONDS * (1.0 - share) / share)
                stopped = not _signal(pid, signal.SIGCONT)
                await anyio.sleep(RUN_SECONDS)
                work.paced_seconds += RUN_SECONDS
        finally:
            if stopped:
                _signal(pid, signal.SIGCONT)
            self._paced[client] -= 1
            if not self._paced[client]:
                del self._paced[client]


def _signal(pid: int, number: signal.Signals) -> bool:
    """Send ``number`` to ``pid``; False if the process is gone."""
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        return False
    return True
